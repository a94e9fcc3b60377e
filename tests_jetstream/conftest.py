"""JAX settings for the JetStream interop tests (run in .venv-jetstream): CPU only with 8 virtual devices and the
main suite's code generator (tests/xla_flags.py: set for compile time), strict rank promotion."""

import os

from tests.xla_flags import xla_flags

os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # seqio imports TensorFlow; keep its start-up chatter quiet

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")

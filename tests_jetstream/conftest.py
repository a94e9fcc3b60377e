"""JAX settings for the JetStream interop tests (run in .venv-jetstream): CPU only with 8 virtual devices, strict
rank promotion."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # seqio imports TensorFlow; keep its start-up chatter quiet

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")

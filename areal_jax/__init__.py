"""areal-jax: fully asynchronous RL training of LLM reasoning models in JAX (after AReaL)."""

__version__ = "0.1.0"

# Imported with the package, not on first use: it turns fsspec's gs:// listing cache off, which must happen
# before any gs:// filesystem (ours, or etils'/Orbax's) is made in this process.
from areal_jax import storage  # noqa: F401

# Before any JAX backend starts, wherever the package is entered (the CLI, a benchmark, a worker): with libtpu
# installed (the test environment's, for `areal-jax compile`) on a machine without TPU chips, JAX starts on the
# other platforms instead of trying the TPU one (areal_jax/jax_platforms.py).
from areal_jax.jax_platforms import quiet_absent_tpu

quiet_absent_tpu()

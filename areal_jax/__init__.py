"""areal-jax: fully asynchronous RL training of LLM reasoning models in JAX (after AReaL)."""

__version__ = "0.1.0"

# Imported with the package, not on first use: it turns fsspec's gs:// listing cache off, which must happen
# before any gs:// filesystem (ours, or etils'/Orbax's) is made in this process.
from areal_jax import storage  # noqa: F401

"""areal-jax: fully asynchronous RL training of LLM reasoning models in JAX (after AReaL)."""

__version__ = "0.1.0"

"""Shared pieces of the benchmarks: the ~100M-parameter model and the matmul peak of this machine."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models.config import ModelConfig

MODEL_100M = ModelConfig(
    family="qwen2",
    vocab_size=32768,
    hidden_size=768,
    intermediate_size=2048,
    num_layers=12,
    num_heads=12,
    num_kv_heads=4,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    logprob_chunk=512,
)


def measure_matmul_peak(size: int = 1024, repeats: int = 5, dtype: jnp.dtype = jnp.float32) -> float:
    """Best observed FLOP/s of a chain of four square matmuls, compiled once."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((size, size)), dtype) / size**0.5

    @jax.jit
    def chain(x: jax.Array) -> jax.Array:
        for _ in range(4):
            x = x @ a
        return x

    chain(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        chain(a).block_until_ready()
        best = min(best, time.perf_counter() - started)
    return 4 * 2 * size**3 / best

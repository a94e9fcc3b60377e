"""Shared pieces of the benchmarks: the ~100M-parameter model, the matmul peak of this machine, and the
generation benchmarks' policy, workloads and timing."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.inference.engine import Engine, VersionedParams
from areal_jax.inference.generator import Generator
from areal_jax.inference.sampling import SamplingParams
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


QWEN2_3M = ModelConfig(
    family="qwen2",
    vocab_size=512,
    hidden_size=256,
    intermediate_size=688,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.05,
)
"""The generation benchmarks' policy: a ~3M-parameter Qwen2-shaped decoder."""

QWEN2_12M = QWEN2_3M.replace(hidden_size=384, num_layers=6, intermediate_size=1024, num_heads=6, num_kv_heads=1)
"""A ~12M-parameter decoder of the same shape family: turns that cost ~4x the 3M policy's to generate."""


def long_tailed_lengths(count: int, cap: int, seed: int, mean_log: float = 2.2) -> list[int]:
    """Output lengths with a heavy tail (4 + lognormal(mean_log, 1)): most short, a few near `cap`."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(4 + rng.lognormal(mean=mean_log, sigma=1.0, size=count)), 4, cap).astype(int).tolist()


def prompts_for(count: int, vocab: int, seed: int, low: int = 8, high: int = 24) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, int(rng.integers(low, high))).tolist() for _ in range(count)]


def run_requests(gen: Generator, prompts: list[list[int]], lengths: list[int], temperature: float) -> float:
    """Submit all requests at once; return emitted tokens per second until the last one finishes."""
    started = time.perf_counter()
    futures = [
        gen.submit(p, SamplingParams(temperature=temperature, max_new_tokens=n, seed=i))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    tokens = sum(len(f.result(timeout=1200)[0].output_ids) for f in futures)
    return tokens / (time.perf_counter() - started)


def warm_engine(engine: Engine, params: VersionedParams) -> float:
    """Compile every program the timed runs can use, so no compilation lands inside a timing; returns
    the seconds it took (printed by the benchmarks as `engine_warmup`)."""
    started = time.perf_counter()
    engine.warmup(params)
    return time.perf_counter() - started

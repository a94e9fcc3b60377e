"""The engine's token sampler over a real vocabulary, plain temperature sampling: `sample_slots` against the
sampler before it (one running sum over the whole vocabulary, the truncation's cond returning the whole
logits, a vocabulary-wide search for the last id with mass), side by side with the same XLA flags.

Each decode step samples every slot once, so on CPU the sampler's time is paid per decode step. Prints
`name: value unit` lines; the last is `ratio sampler_new_vs_previous: X.XX` (previous time / new time).
Run it also with XLA_FLAGS=--xla_backend_optimization_level=0 (the test suite's flag), where XLA's
vocabulary-wide running sum is slowest.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.inference.sampling import sample_slots, truncate_logits

QWEN_VOCAB = 151_936  # Qwen2/2.5/3 embedding rows


def previous_sample_slots(
    logits_SxV: jax.Array, keys_S: jax.Array, temperature_S: jax.Array, top_k_S: jax.Array, top_p_S: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """`sample_slots` as it was (the baseline): the truncation's cond returns the whole [S, V] logits, one
    running sum over the vocabulary, and a vocabulary-wide search for the last id with mass."""
    logits_SxV = logits_SxV.astype(jnp.float32)
    greedy_S = temperature_S <= 0
    scaled_SxV = logits_SxV / jnp.where(greedy_S, 1.0, temperature_S)[:, None]
    truncating = jnp.any((top_k_S > 0) | (top_p_S < 1.0))
    restricted_SxV = jax.lax.cond(truncating, lambda z: truncate_logits(z, top_k_S, top_p_S), lambda z: z, scaled_SxV)
    source_SxV = jnp.where(greedy_S[:, None], logits_SxV, restricted_SxV)
    top_S = jnp.max(source_SxV, axis=-1)
    weights_SxV = jnp.exp(source_SxV - top_S[:, None])
    cdf_SxV = jnp.cumsum(weights_SxV, axis=-1)
    threshold_S = jax.vmap(jax.random.uniform)(keys_S) * cdf_SxV[:, -1]
    ids_SxV = jax.lax.broadcasted_iota(jnp.int32, source_SxV.shape, 1)
    last_S = jnp.max(jnp.where(weights_SxV > 0, ids_SxV, 0), axis=-1)
    drawn_S = jnp.minimum(jnp.sum(cdf_SxV <= threshold_S[:, None], axis=-1, dtype=jnp.int32), last_S)
    tokens_S = jnp.where(greedy_S, jnp.argmax(logits_SxV, axis=-1), drawn_S).astype(jnp.int32)
    chosen_S = jnp.take_along_axis(source_SxV, tokens_S[:, None], axis=-1)[:, 0]
    return tokens_S, chosen_S - top_S - jnp.log(jnp.sum(weights_SxV, axis=-1))


def best_seconds(fn, args: tuple, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats (under a minute)")
    parser.add_argument("--slots", type=int, default=64)
    args = parser.parse_args()
    repeats = 3 if args.quick else 10
    slots = args.slots
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((slots, QWEN_VOCAB), np.float32) * 3)
    keys = jax.random.split(jax.random.key(0), slots)
    temperature = jnp.ones(slots)
    off_k, off_p = jnp.zeros(slots, jnp.int32), jnp.ones(slots)
    two_level = jax.jit(lambda z, k, t: sample_slots(z, k, t, off_k, off_p))
    flat = jax.jit(lambda z, k, t: previous_sample_slots(z, k, t, off_k, off_p))
    # the two draw the same distribution: their log-prob of the same token agree
    tokens, logp = two_level(logits, keys, temperature)
    reference = jax.nn.log_softmax(logits)[jnp.arange(slots), tokens]
    np.testing.assert_allclose(np.asarray(logp), np.asarray(reference), atol=1e-4)
    flat_s, two_level_s = [], []
    for _ in range(2):  # alternated, so a busy machine slows both
        flat_s.append(best_seconds(flat, (logits, keys, temperature), repeats))
        two_level_s.append(best_seconds(two_level, (logits, keys, temperature), repeats))
    print(f"shape: {slots} slots x {QWEN_VOCAB} ids")
    print(f"previous_sampler: {min(flat_s) * 1e3:.1f} ms")
    print(f"new_sampler: {min(two_level_s) * 1e3:.1f} ms")
    print(f"ratio sampler_new_vs_previous: {min(flat_s) / min(two_level_s):.2f}")


if __name__ == "__main__":
    main()

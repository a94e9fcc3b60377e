"""Masked token statistics, per-staleness breakdowns, and merging statistics of several micro-batches.

Statistic keys follow one rule so that micro-batch results can be merged (`merge_stats`):
  `<prefix>/n_tokens`   a count, summed;
  `<name>_max`          a maximum, maxed;
  `<name>_loss`         a loss part already divided by the global token count, summed;
  anything else         a mean over the tokens counted by the sibling `<prefix>/n_tokens`, count-weighted.
Legend: B rows of a packed micro-batch, L row length, K staleness buckets, M micro-batches.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp


def safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """num / den, and 0 where den == 0 (no NaN, no NaN gradient)."""
    ok = den != 0
    return jnp.where(ok, num / jnp.where(ok, den, 1), 0)


def masked_mean(x_BxL: jax.Array, mask_BxL: jax.Array) -> jax.Array:
    """Mean of x over the tokens where mask is true; 0 if there are none."""
    return safe_div(jnp.sum(jnp.where(mask_BxL, x_BxL, 0)), jnp.sum(mask_BxL).astype(x_BxL.dtype))


def masked_max(x_BxL: jax.Array, mask_BxL: jax.Array) -> jax.Array:
    """Max of x over the tokens where mask is true; 0 if there are none."""
    return jnp.where(jnp.any(mask_BxL), jnp.max(jnp.where(mask_BxL, x_BxL, -jnp.inf)), 0).astype(x_BxL.dtype)


def staleness_buckets(token_version_BxL: jax.Array, trainer_version: jax.Array | int, num_buckets: int) -> jax.Array:
    """Bucket of each token: staleness = trainer_version - token_version clipped to [0, K], K meaning '>= K'."""
    return jnp.clip(trainer_version - token_version_BxL, 0, num_buckets).astype(jnp.int32)


def bucket_labels(num_buckets: int) -> list[str]:
    """Key labels of the K + 1 staleness buckets: '0', ..., 'K-1', '>=K'."""
    return [str(k) for k in range(num_buckets)] + [f">={num_buckets}"]


def bucketed_stats(
    means_BxL: Mapping[str, jax.Array],
    maxes_BxL: Mapping[str, jax.Array],
    mask_BxL: jax.Array,
    bucket_BxL: jax.Array,
    num_buckets: int,
    prefix: str = "staleness",
) -> dict[str, jax.Array]:
    """Masked means and maxima of each token statistic within each staleness bucket (0..K-1 and >=K).

    Returns `<prefix>/<label>/n_tokens`, `<prefix>/<label>/<name>` for `means_BxL` and for `maxes_BxL`
    (whose names should end in `_max`); an empty bucket reports 0.
    """
    num_segments = num_buckets + 2  # the last segment collects the non-loss tokens and is dropped
    bucket_N = jnp.where(mask_BxL, bucket_BxL, num_buckets + 1).reshape(-1)
    count_K = jax.ops.segment_sum(jnp.ones_like(bucket_N, dtype=jnp.float32), bucket_N, num_segments=num_segments)
    out: dict[str, jax.Array] = {}
    labels = bucket_labels(num_buckets)
    for k, label in enumerate(labels):
        out[f"{prefix}/{label}/n_tokens"] = count_K[k]
    for name, x_BxL in means_BxL.items():
        sum_K = jax.ops.segment_sum(x_BxL.reshape(-1), bucket_N, num_segments=num_segments)
        mean_K = safe_div(sum_K, count_K.astype(sum_K.dtype))
        for k, label in enumerate(labels):
            out[f"{prefix}/{label}/{name}"] = mean_K[k]
    for name, x_BxL in maxes_BxL.items():
        max_K = jax.ops.segment_max(x_BxL.reshape(-1), bucket_N, num_segments=num_segments)
        max_K = jnp.where(count_K > 0, max_K, 0).astype(x_BxL.dtype)
        for k, label in enumerate(labels):
            out[f"{prefix}/{label}/{name}"] = max_K[k]
    return out


def merge_stats(stats_M: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Merge statistics of M micro-batches stacked on a leading axis into those of the whole batch.

    Applies the key rule of this module: counts and `_loss` parts summed, `_max` maxed, other values
    averaged weighted by their sibling `n_tokens` (0 when the total count is 0). A list of per-micro-batch
    dicts can be stacked first with `jax.tree.map(lambda *x: jnp.stack(x), *stats_list)`.
    """
    merged: dict[str, jax.Array] = {}
    for key, value_M in stats_M.items():
        prefix, _, name = key.rpartition("/")
        if name == "n_tokens" or name.endswith("_loss"):
            merged[key] = jnp.sum(value_M, axis=0)
        elif name.endswith("_max"):
            merged[key] = jnp.max(value_M, axis=0)
        else:
            count_key = f"{prefix}/n_tokens" if prefix else "n_tokens"
            if count_key not in stats_M:
                raise KeyError(f"statistic {key!r} is a mean but its count {count_key!r} is missing")
            count_M = stats_M[count_key].astype(value_M.dtype)
            merged[key] = safe_div(jnp.sum(value_M * count_M, axis=0), jnp.sum(count_M, axis=0))
    return merged

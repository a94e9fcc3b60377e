"""Loss-token counts, masked token statistics, per-staleness breakdowns, and merging the statistics of parts.

Statistic keys follow one rule, by the last part of the key, so that the statistics of the parts of a step
can be merged (`merge_stats`):
  `*_tokens`, `*_updates`   counts, summed;
  `*_max`                   maxima, maxed;
  `loss`, `*_loss`          loss parts, each divided by its update's loss-token count: summed over the
                            micro-batches of one update, averaged over the updates of a step;
  `lr`                      the learning rate: the last update's;
  anything else             a mean over the tokens counted by the sibling `<prefix>/n_tokens`, count-weighted;
                            without a sibling count (a per-update value such as `train/grad_norm`) a plain mean.
Legend: B rows of a packed micro-batch, L row length, K staleness buckets, M parts (micro-batches or updates).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp


def safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """num / den, and 0 where den == 0 (no NaN, no NaN gradient)."""
    ok = den != 0
    return jnp.where(ok, num / jnp.where(ok, den, 1), 0)


def count_loss_tokens(loss_mask: Any) -> Any:
    """The number of loss tokens (where the loss mask is true) in a NumPy or JAX mask of any shape."""
    return loss_mask.astype(bool).sum()


def loss_token_mean(total: jax.Array, num_loss_tokens_global: jax.Array | int) -> jax.Array:
    """A sum over loss tokens divided by the global loss-token count (at least 1): how every loss is normalised."""
    return total / jnp.maximum(jnp.asarray(num_loss_tokens_global, total.dtype), 1)


def masked_mean(x_BxL: jax.Array, mask_BxL: jax.Array) -> jax.Array:
    """Mean of x over the tokens where mask is true; 0 if there are none."""
    return safe_div(jnp.sum(jnp.where(mask_BxL, x_BxL, 0)), count_loss_tokens(mask_BxL).astype(x_BxL.dtype))


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


def merge_stats(
    stats_M: Mapping[str, jax.Array], over: Literal["microbatches", "updates"] = "microbatches"
) -> dict[str, jax.Array]:
    """Merge the statistics of M parts stacked on a leading axis into those of the whole, by the key rule of
    this module: the micro-batches of one update (parts of one normalised loss) or the updates of a step.

    Takes JAX or NumPy arrays; a single part is returned as it is. A list of per-part dicts can be stacked with
    `jax.tree.map(lambda *x: jnp.stack(x), *stats_list)`.
    """
    merged: dict[str, jax.Array] = {}
    for key, value_M in stats_M.items():
        prefix, _, name = key.rpartition("/")
        count_key = f"{prefix}/n_tokens" if prefix else "n_tokens"
        if value_M.shape[0] == 1:
            merged[key] = value_M[0]
        elif name.endswith(("_tokens", "_updates")):
            merged[key] = jnp.sum(value_M, axis=0)
        elif name.endswith("_max"):
            merged[key] = jnp.max(value_M, axis=0)
        elif name == "loss" or name.endswith("_loss"):
            merged[key] = jnp.sum(value_M, axis=0) if over == "microbatches" else jnp.mean(value_M, axis=0)
        elif name == "lr":
            merged[key] = value_M[-1]
        elif count_key in stats_M:
            count_M = stats_M[count_key].astype(value_M.dtype)
            merged[key] = safe_div(jnp.sum(value_M * count_M, axis=0), jnp.sum(count_M, axis=0))
        else:
            merged[key] = jnp.mean(value_M, axis=0)
    return merged

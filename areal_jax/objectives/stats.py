"""Loss-token counts, masked token statistics, per-staleness breakdowns, and merging the statistics of parts.

Statistic keys follow one rule, by the last part of the key, so that the statistics of the parts of a step
can be merged (`merge_stats`):
  `*_tokens`, `*_updates`,
  `*_seqs`                  counts, summed;
  `*_max`                   maxima, maxed;
  `loss`, `*_loss`          loss parts, each divided by its update's loss-token count: summed over the
                            micro-batches of one update, averaged over the updates of a step;
  `lr`                      the learning rate: the last update's;
  `ess`                     an effective sample size mean(w)^2 / mean(w^2): recomputed from the merged siblings
                            `<prefix>/weight_mean` and `<prefix>/weight_sq_mean` (exact, not an average of parts);
  anything else             a mean over the tokens counted by the sibling `<prefix>/n_tokens` (or, without one, the
                            sequences counted by `<prefix>/n_seqs`), count-weighted; without a sibling count (a
                            per-update value such as `train/grad_norm`) a plain mean.
Legend: B rows of a packed micro-batch, L row length, S = L + 1 segment slots of a row (slot 0 = padding),
K staleness buckets, M parts (micro-batches or updates).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

ArrayT = TypeVar("ArrayT", jax.Array, np.ndarray)


def safe_div(num: jax.Array | np.ndarray, den: jax.Array | np.ndarray) -> jax.Array:
    """num / den, and 0 where den == 0 (no NaN, no NaN gradient)."""
    ok = den != 0
    return jnp.where(ok, num / jnp.where(ok, den, 1), 0)


def count_loss_tokens(loss_mask: Any) -> Any:
    """The number of loss tokens (where the loss mask is true) in a NumPy or JAX mask of any shape."""
    return loss_mask.astype(bool).sum()


def loss_token_mean(total: jax.Array, num_loss_tokens_global: jax.Array | int) -> jax.Array:
    """A sum over loss tokens divided by the global loss-token count (at least 1): how every loss is normalised."""
    return total / jnp.maximum(jnp.asarray(num_loss_tokens_global, total.dtype), 1)


def segment_sums(x_BxL: jax.Array, segment_ids_BxL: jax.Array) -> jax.Array:
    """Per row, the sum of x over each segment id: `[B, S]`, slot s the sum over segment s of its row (a packed
    sequence never spans rows, so (row, segment id) names it); slot 0 collects the padding."""
    num_segments = x_BxL.shape[1] + 1
    return jax.vmap(lambda x_L, s_L: jax.ops.segment_sum(x_L, s_L, num_segments=num_segments))(x_BxL, segment_ids_BxL)


def per_token(x_BxS: jax.Array, segment_ids_BxL: jax.Array) -> jax.Array:
    """A per-segment value `[B, S]` broadcast back to each token of its segment: `[B, L]`."""
    return jnp.take_along_axis(x_BxS, segment_ids_BxL, axis=1)


def segment_mean(x_BxL: jax.Array, mask_BxL: jax.Array, segment_ids_BxL: jax.Array) -> jax.Array:
    """Each token's sequence mean of x over the sequence's loss tokens, `[B, L]` (0 for a sequence without any)."""
    total_BxS = segment_sums(jnp.where(mask_BxL, x_BxL, 0), segment_ids_BxL)
    count_BxS = segment_sums(mask_BxL.astype(x_BxL.dtype), segment_ids_BxL)
    return per_token(safe_div(total_BxS, count_BxS), segment_ids_BxL)


def loss_sequences_BxS(segment_ids_BxL: jax.Array, mask_BxL: jax.Array) -> jax.Array:
    """`[B, S]` bool: slot s of a row is a sequence with at least one loss token (never the padding slot 0)."""
    count_BxS = segment_sums(mask_BxL.astype(jnp.int32), segment_ids_BxL)
    return (count_BxS > 0) & (jnp.arange(count_BxS.shape[1]) > 0)[None, :]


def count_loss_sequences(segment_ids: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """The number of packed sequences with at least one loss token in `[..., B, L]` arrays (any leading axes)."""
    length = segment_ids.shape[-1]
    return jnp.sum(loss_sequences_BxS(segment_ids.reshape(-1, length), loss_mask.reshape(-1, length).astype(bool)))


def effective_sample_size(mean_w: jax.Array | np.ndarray, mean_w_sq: jax.Array | np.ndarray) -> jax.Array:
    """Normalised ESS (sum w)^2 / (n sum w^2) = mean(w)^2 / mean(w^2), in [0, 1]; 0 when every w is 0."""
    return safe_div(jnp.square(mean_w), mean_w_sq)


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
    stats_M: Mapping[str, ArrayT], over: Literal["microbatches", "updates"] = "microbatches"
) -> dict[str, ArrayT | jax.Array]:
    """Merge the statistics of M parts stacked on a leading axis into those of the whole, by the key rule of
    this module: the micro-batches of one update (parts of one normalised loss) or the updates of a step.

    Takes JAX or NumPy arrays; a single part is returned as it is. A list of per-part dicts can be stacked with
    `jax.tree.map(lambda *x: jnp.stack(x), *stats_list)`.
    """
    merged: dict[str, ArrayT | jax.Array] = {}
    ess_keys = []
    for key, value_M in stats_M.items():
        prefix, _, name = key.rpartition("/")
        count_key = f"{prefix}/n_tokens" if prefix else "n_tokens"
        if f"{prefix}/n_seqs" in stats_M and count_key not in stats_M:
            count_key = f"{prefix}/n_seqs"
        if value_M.shape[0] == 1:
            merged[key] = value_M[0]
        elif name == "ess":
            ess_keys.append((key, prefix))
        elif name.endswith(("_tokens", "_updates", "_seqs")):
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
    for key, prefix in ess_keys:
        merged[key] = effective_sample_size(merged[f"{prefix}/weight_mean"], merged[f"{prefix}/weight_sq_mean"])
    return merged

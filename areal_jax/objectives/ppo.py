"""The policy loss: decoupled PPO (AReaL Eq. 5) or plain PPO over packed token arrays, and its statistics.

Legend: B rows of a packed micro-batch, L row length.
Per loss token t of packed sequence i, with advantage A and logp_old = logp_prox (decoupled) or logp_behav:
  token ratio:     u_t = exp(logp_t - logp_old_t)
  sequence ratio (GSPO): u_t = sg(s_i) * pi_t / sg(pi_t),  s_i = exp(mean_{t' in i} (logp_t' - logp_old_t'))
  c_t = max(-A*u, -A*clip(u, 1 - eps_low, 1 + eps_high))
  dual clip (if set, A < 0 only): c_t = min(c_t, dual_clip*|A|)       -- on the clipped term, before w
  decoupled: w_t = the rollout-corrected stop_gradient(pi_prox / pi_behav) (`correction.py`);  plain: w_t = 1
  L_t = w_t * c_t
loss = sum over loss tokens of L_t / num_loss_tokens_global                      (loss_agg token_mean)
     = sum over sequences of (sum_{t in i} L_t / n_i) / num_loss_sequences_global  (seq_mean_token_mean)
       (+ the KL loss term, token_mean, if kl_coef > 0).
`ppo_terms` is the per-token formula, `ppo_loss` the loss of a micro-batch, `ppo_stats` its statistics.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from areal_jax.objectives.config import PPOConfig
from areal_jax.objectives.correction import CorrectedWeight, correct_behav_weight, correction_stats
from areal_jax.objectives.kl import kl_loss
from areal_jax.objectives.stats import (
    bucketed_stats,
    count_loss_tokens,
    loss_token_mean,
    masked_max,
    masked_mean,
    per_token,
    safe_div,
    segment_mean,
    segment_sums,
    staleness_buckets,
)


class PPOTerms(NamedTuple):
    """The per-token parts of the loss, for the loss itself and its statistics; every field is [B, L]."""

    token_loss_BxL: jax.Array  # L_t
    ratio_BxL: jax.Array  # u
    clipped_BxL: jax.Array  # bool: the clipped term is strictly larger than the unclipped one
    dual_clipped_BxL: jax.Array  # bool: the dual-clip bound replaced the clipped term
    behav_weight_BxL: jax.Array | None  # w before any correction (stop-gradient); None without logp_prox
    corrected: CorrectedWeight | None  # the weight the loss applies (decoupled only)


def ppo_terms(
    logp_BxL: jax.Array,
    logp_behav_BxL: jax.Array,
    adv_BxL: jax.Array,
    config: PPOConfig,
    logp_prox_BxL: jax.Array | None = None,
    mask_BxL: jax.Array | None = None,
    segment_ids_BxL: jax.Array | None = None,
) -> PPOTerms:
    """Eq. 5 per token (see the module docstring), on arrays already zeroed outside the loss mask `mask_BxL`
    (default: every token); `segment_ids_BxL` is required when `config.needs_segments`."""
    mask_BxL = jnp.ones(logp_BxL.shape, bool) if mask_BxL is None else mask_BxL
    logp_old_BxL = logp_prox_BxL if config.decoupled else logp_behav_BxL
    assert logp_old_BxL is not None  # logp_prox_BxL is required when decoupled (`ppo_loss` checks)
    if config.ratio_level == "sequence":
        assert segment_ids_BxL is not None  # required when config.needs_segments (`ppo_loss` checks)
        seq_log_ratio_BxL = segment_mean(jax.lax.stop_gradient(logp_BxL - logp_old_BxL), mask_BxL, segment_ids_BxL)
        ratio_BxL = jnp.exp(logp_BxL - jax.lax.stop_gradient(logp_BxL) + seq_log_ratio_BxL)
    else:
        ratio_BxL = jnp.exp(logp_BxL - logp_old_BxL)
    ratio_clipped_BxL = jnp.clip(ratio_BxL, 1.0 - config.eps_clip_low, 1.0 + config.eps_clip_high)
    pg_plain_BxL = -adv_BxL * ratio_BxL
    pg_clipped_only_BxL = -adv_BxL * ratio_clipped_BxL
    pg_BxL = jnp.maximum(pg_plain_BxL, pg_clipped_only_BxL)
    dual_clipped_BxL = jnp.zeros(pg_BxL.shape, bool)
    if config.dual_clip is not None:
        dual_bound_BxL = config.dual_clip * jnp.abs(adv_BxL)
        dual_clipped_BxL = (adv_BxL < 0) & (pg_BxL > dual_bound_BxL)
        pg_BxL = jnp.where(dual_clipped_BxL, dual_bound_BxL, pg_BxL)

    behav_weight_BxL, corrected = None, None
    if logp_prox_BxL is not None:
        behav_weight_BxL = jax.lax.stop_gradient(jnp.exp(logp_prox_BxL - logp_behav_BxL))
    token_loss_BxL = pg_BxL
    if config.decoupled:
        assert logp_prox_BxL is not None  # as above
        corrected = correct_behav_weight(logp_prox_BxL - logp_behav_BxL, mask_BxL, config.correction, segment_ids_BxL)
        token_loss_BxL = corrected.weight_BxL * pg_BxL
    clipped_BxL = pg_clipped_only_BxL > pg_plain_BxL
    return PPOTerms(token_loss_BxL, ratio_BxL, clipped_BxL, dual_clipped_BxL, behav_weight_BxL, corrected)


def _check_shapes(reference_name: str, reference: jax.Array, **arrays: jax.Array | None) -> None:
    for name, array in arrays.items():
        if array is not None and array.shape != reference.shape:
            raise ValueError(f"{name} has shape {array.shape}; expected {reference.shape} like {reference_name}")


def ppo_loss(
    logp_BxL: jax.Array,
    logp_behav_BxL: jax.Array,
    adv_BxL: jax.Array,
    loss_mask_BxL: jax.Array,
    num_loss_tokens_global: jax.Array | int,
    config: PPOConfig,
    *,
    logp_prox_BxL: jax.Array | None = None,
    logp_ref_BxL: jax.Array | None = None,
    entropy_BxL: jax.Array | None = None,
    token_version_BxL: jax.Array | None = None,
    trainer_version: jax.Array | int | None = None,
    segment_ids_BxL: jax.Array | None = None,
    num_loss_sequences_global: jax.Array | int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The PPO loss of one micro-batch (see the module docstring) and its statistics (`ppo_stats`).

    `num_loss_tokens_global` is the number of loss tokens in the whole global batch (all micro-batches and
    data-parallel shards), and `num_loss_sequences_global` (required with `loss_agg: seq_mean_token_mean`) its
    number of sequences with a loss token, so summing the losses of the parts gives the loss of the whole.
    `segment_ids_BxL` (the packed segments, 0 = padding) is required when `config.needs_segments` and adds the
    per-sequence statistics. Gradients flow through `logp_BxL` (and `logp_prox_BxL` through a token-level u);
    the weight and all statistics are stop-gradient.
    `logp_prox_BxL` is required when `config.decoupled`; in plain PPO it is optional and only feeds the
    off-policy statistics. `logp_ref_BxL` is required when `config.kl_coef > 0`. `entropy_BxL` adds the
    `ppo/entropy` statistic; `token_version_BxL` with `trainer_version` adds the per-staleness breakdown.
    The loss mask is read as boolean; values on non-loss tokens are never read into the loss or gradient.
    """
    _check_shapes(
        "logp_BxL",
        logp_BxL,
        logp_behav_BxL=logp_behav_BxL,
        adv_BxL=adv_BxL,
        loss_mask_BxL=loss_mask_BxL,
        logp_prox_BxL=logp_prox_BxL,
        logp_ref_BxL=logp_ref_BxL,
        entropy_BxL=entropy_BxL,
        token_version_BxL=token_version_BxL,
        segment_ids_BxL=segment_ids_BxL,
    )
    if config.needs_segments and segment_ids_BxL is None:
        raise ValueError("segment_ids_BxL is None but the config has sequence-level terms; pass the segment ids")
    if config.loss_agg == "seq_mean_token_mean" and num_loss_sequences_global is None:
        raise ValueError("num_loss_sequences_global is None but loss_agg is 'seq_mean_token_mean'; pass it")
    if config.decoupled and logp_prox_BxL is None:
        raise ValueError("logp_prox_BxL is None but config.decoupled is true; pass the proximal log-probs")
    if config.kl_coef > 0 and logp_ref_BxL is None:
        raise ValueError(f"logp_ref_BxL is None but config.kl_coef is {config.kl_coef}; pass the reference log-probs")
    if (token_version_BxL is None) != (trainer_version is None):
        raise ValueError("token_version_BxL and trainer_version must be given together for the staleness stats")

    dtype = jnp.promote_types(logp_BxL.dtype, jnp.float32)
    mask_BxL = loss_mask_BxL.astype(bool)

    def clean(x_BxL: jax.Array) -> jax.Array:
        return jnp.where(mask_BxL, x_BxL.astype(dtype), 0.0)

    logp_BxL, logp_behav_BxL, adv_BxL = clean(logp_BxL), clean(logp_behav_BxL), clean(adv_BxL)
    logp_prox_BxL = None if logp_prox_BxL is None else clean(logp_prox_BxL)
    terms = ppo_terms(logp_BxL, logp_behav_BxL, adv_BxL, config, logp_prox_BxL, mask_BxL, segment_ids_BxL)
    token_loss_BxL = jnp.where(mask_BxL, terms.token_loss_BxL, 0.0)
    if config.loss_agg == "token_mean":
        pg_loss = loss_token_mean(jnp.sum(token_loss_BxL), num_loss_tokens_global)
    else:
        assert segment_ids_BxL is not None and num_loss_sequences_global is not None  # checked above
        seq_tokens_BxL = per_token(segment_sums(mask_BxL.astype(dtype), segment_ids_BxL), segment_ids_BxL)
        pg_loss = loss_token_mean(jnp.sum(safe_div(token_loss_BxL, seq_tokens_BxL)), num_loss_sequences_global)
    loss = pg_loss
    stats = {"ppo/pg_loss": jax.lax.stop_gradient(pg_loss)}
    stats |= ppo_stats(
        terms,
        mask_BxL,
        config,
        logp_prox_BxL,
        logp_behav_BxL,
        entropy_BxL,
        token_version_BxL,
        trainer_version,
        segment_ids_BxL,
    )
    if config.kl_coef > 0:
        assert logp_ref_BxL is not None  # checked above
        kl_term, kl_stats = kl_loss(
            logp_BxL, logp_ref_BxL, mask_BxL, num_loss_tokens_global, config.kl_coef, config.kl_estimator
        )
        loss = loss + kl_term
        stats |= {key: jax.lax.stop_gradient(value) for key, value in kl_stats.items()}
    return loss, stats


def ppo_stats(
    terms: PPOTerms,
    mask_BxL: jax.Array,
    config: PPOConfig,
    logp_prox_BxL: jax.Array | None,
    logp_behav_BxL: jax.Array,
    entropy_BxL: jax.Array | None = None,
    token_version_BxL: jax.Array | None = None,
    trainer_version: jax.Array | int | None = None,
    segment_ids_BxL: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Statistics of the loss over the loss tokens (see docs/objectives.md): token count, clip fractions,
    ratio, and with `logp_prox_BxL` the behaviour weight and KL(prox || behav); the rollout correction's
    (`correction_stats`, decoupled); entropy and the staleness breakdown when given."""
    dtype = terms.ratio_BxL.dtype
    stats: dict[str, jax.Array] = {"ppo/n_tokens": count_loss_tokens(mask_BxL).astype(dtype)}
    token_means = {
        "clip_frac": terms.clipped_BxL.astype(dtype),
        "dual_clip_frac": terms.dual_clipped_BxL.astype(dtype),
        "ratio_mean": jax.lax.stop_gradient(terms.ratio_BxL),
    }
    token_maxes = {}
    if terms.behav_weight_BxL is not None:
        assert logp_prox_BxL is not None  # the behaviour weight is computed from it
        w_BxL = terms.behav_weight_BxL
        log_w_BxL = logp_prox_BxL - logp_behav_BxL
        token_means["iw_mean"] = w_BxL
        # KL(prox || behav) from behaviour samples: E_behav[w log w - w + 1], non-negative per token
        token_means["approx_kl"] = jax.lax.stop_gradient(w_BxL * log_w_BxL - jnp.expm1(log_w_BxL))
        # |log pi_prox - log pi_behav|: on staleness-0 tokens both are the same weights, so this is the
        # numerical mismatch between the sampler and the trainer (the run's log-prob monitor)
        token_means["logp_abs_diff"] = jnp.abs(log_w_BxL)
        token_maxes["iw_max"] = w_BxL
        token_maxes["logp_abs_diff_max"] = jnp.abs(log_w_BxL)
    for name, x_BxL in token_means.items():
        stats[f"ppo/{name}"] = masked_mean(x_BxL, mask_BxL)
    for name, x_BxL in token_maxes.items():
        stats[f"ppo/{name}"] = masked_max(x_BxL, mask_BxL)
    if entropy_BxL is not None:
        stats["ppo/entropy"] = masked_mean(jax.lax.stop_gradient(entropy_BxL.astype(dtype)), mask_BxL)
    num_buckets = config.num_staleness_buckets
    bucket_BxL = None
    if token_version_BxL is not None:
        assert trainer_version is not None  # given together (`ppo_loss` checks)
        bucket_BxL = staleness_buckets(token_version_BxL, trainer_version, num_buckets)
        stats.update(bucketed_stats(token_means, token_maxes, mask_BxL, bucket_BxL, num_buckets))
    if terms.corrected is not None:
        stats |= correction_stats(terms.corrected, mask_BxL, segment_ids_BxL, bucket_BxL, num_buckets)
    return stats

"""The policy loss: decoupled PPO (AReaL Eq. 5) or plain PPO over packed token arrays, and its statistics.

Legend: B rows of a packed micro-batch, L row length.
Per loss token, with advantage A:
  decoupled:  u = exp(logp - logp_prox),  w = stop_gradient(exp(logp_prox - logp_behav))
  plain:      u = exp(logp - logp_behav), w = 1
  c_t = max(-A*u, -A*clip(u, 1 - eps_low, 1 + eps_high))
  dual clip (if set, A < 0 only): c_t = min(c_t, dual_clip*|A|)       -- on the clipped term, before w
  behaviour-weight cap (decoupled, if set): mask -> L_t = 0 where w > cap;  clamp -> w = min(w, cap)
  L_t = w * c_t
loss = sum over loss tokens of L_t / num_loss_tokens_global  (+ the KL loss term if kl_coef > 0).
`ppo_terms` is the per-token formula, `ppo_loss` the loss of a micro-batch, `ppo_stats` its statistics.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from areal_jax.objectives.config import PPOConfig
from areal_jax.objectives.kl import kl_loss
from areal_jax.objectives.stats import (
    bucketed_stats,
    count_loss_tokens,
    loss_token_mean,
    masked_max,
    masked_mean,
    staleness_buckets,
)


class PPOTerms(NamedTuple):
    """The per-token parts of the loss, for the loss itself and its statistics; every field is [B, L]."""

    token_loss_BxL: jax.Array  # L_t
    ratio_BxL: jax.Array  # u
    clipped_BxL: jax.Array  # bool: the clipped term is strictly larger than the unclipped one
    dual_clipped_BxL: jax.Array  # bool: the dual-clip bound replaced the clipped term
    behav_weight_BxL: jax.Array | None  # w before any cap (stop-gradient); None without logp_prox
    capped_BxL: jax.Array  # bool: w > behav_weight_cap


def ppo_terms(
    logp_BxL: jax.Array,
    logp_behav_BxL: jax.Array,
    adv_BxL: jax.Array,
    config: PPOConfig,
    logp_prox_BxL: jax.Array | None = None,
) -> PPOTerms:
    """Eq. 5 per token (see the module docstring), on arrays already zeroed outside the loss mask."""
    logp_old_BxL = logp_prox_BxL if config.decoupled else logp_behav_BxL
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

    behav_weight_BxL = None
    capped_BxL = jnp.zeros(pg_BxL.shape, bool)
    if logp_prox_BxL is not None:
        behav_weight_BxL = jax.lax.stop_gradient(jnp.exp(logp_prox_BxL - logp_behav_BxL))
        if config.decoupled and config.behav_weight_cap is not None:
            capped_BxL = behav_weight_BxL > config.behav_weight_cap
    token_loss_BxL = pg_BxL
    if config.decoupled:
        weight_BxL = behav_weight_BxL
        if config.behav_weight_cap is not None and config.behav_weight_cap_mode == "mask":
            weight_BxL = jnp.where(capped_BxL, 0.0, behav_weight_BxL)
        elif config.behav_weight_cap is not None:
            weight_BxL = jnp.minimum(behav_weight_BxL, config.behav_weight_cap)
        token_loss_BxL = weight_BxL * pg_BxL
    clipped_BxL = pg_clipped_only_BxL > pg_plain_BxL
    return PPOTerms(token_loss_BxL, ratio_BxL, clipped_BxL, dual_clipped_BxL, behav_weight_BxL, capped_BxL)


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
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The PPO loss of one micro-batch (see the module docstring) and its statistics (`ppo_stats`).

    `num_loss_tokens_global` is the number of loss tokens in the whole global batch (all micro-batches and
    data-parallel shards), so summing the losses of the parts gives the loss of the whole. Gradients flow
    through `logp_BxL` (and `logp_prox_BxL` through u); w and all statistics are stop-gradient.
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
    )
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
    terms = ppo_terms(logp_BxL, logp_behav_BxL, adv_BxL, config, logp_prox_BxL)
    pg_loss = loss_token_mean(jnp.sum(jnp.where(mask_BxL, terms.token_loss_BxL, 0.0)), num_loss_tokens_global)
    loss = pg_loss
    stats = {"ppo/pg_loss": jax.lax.stop_gradient(pg_loss)}
    stats |= ppo_stats(
        terms, mask_BxL, config, logp_prox_BxL, logp_behav_BxL, entropy_BxL, token_version_BxL, trainer_version
    )
    if config.kl_coef > 0:
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
) -> dict[str, jax.Array]:
    """Statistics of the loss over the loss tokens (see docs/objectives.md): token count, clip fractions,
    ratio, and with `logp_prox_BxL` the behaviour weight and KL(prox || behav); entropy and the staleness
    breakdown when given."""
    dtype = terms.ratio_BxL.dtype
    stats: dict[str, jax.Array] = {"ppo/n_tokens": count_loss_tokens(mask_BxL).astype(dtype)}
    token_means = {
        "clip_frac": terms.clipped_BxL.astype(dtype),
        "dual_clip_frac": terms.dual_clipped_BxL.astype(dtype),
        "ratio_mean": jax.lax.stop_gradient(terms.ratio_BxL),
    }
    token_maxes = {}
    if terms.behav_weight_BxL is not None:
        w_BxL = terms.behav_weight_BxL
        log_w_BxL = logp_prox_BxL - logp_behav_BxL
        token_means["iw_mean"] = w_BxL
        token_means["capped_frac"] = terms.capped_BxL.astype(dtype)
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
    if token_version_BxL is not None:
        bucket_BxL = staleness_buckets(token_version_BxL, trainer_version, config.num_staleness_buckets)
        stats.update(bucketed_stats(token_means, token_maxes, mask_BxL, bucket_BxL, config.num_staleness_buckets))
    return stats

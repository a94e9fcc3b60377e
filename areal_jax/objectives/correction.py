"""Rollout correction of decoupled PPO's behaviour weight w = pi_prox / pi_behav: truncated (TIS) and masked (MIS)
importance weights at token or sequence level, and rejection of tokens or sequences (RS, also by the geometric
mean), after verl's rollout correction (`rollout_is`, `rollout_rs`) and slime's TIS/MIS.

At staleness 0 (the step's weights sampled the token) pi_prox and pi_behav are the same weights, so w is exactly
the sampler/trainer log-prob mismatch; for stale tokens it is the policy lag as well.

Legend: B rows of a packed micro-batch, L row length, S = L + 1 segment slots of a row (slot 0 = padding).
Per loss token t of packed sequence i, log w_t = logp_prox - logp_behav:

  is_level   token:     rho_t = w_t
             sequence:  rho_t = W_i = exp(clip(sum_{t' in i} log w_t', -20, 20))     (verl's product, bounded)
  is_mode    plain:     rho_t                                       (AReaL Eq. 5: the weight as it is)
             truncate:  min(rho_t, is_high)                         (TIS)
             mask:      rho_t, or 0 where rho_t is outside [is_low, is_high]   (MIS)
  rs_level   token:     reject t where w_t is outside [rs_low, rs_high]
             sequence:  reject every token of i where W_i is outside [rs_low, rs_high]
             geometric: reject every token of i where G_i = exp(mean_{t' in i} log w_t') is outside it (geo-RS)
  weight_t = 0 where masked (MIS) or rejected (RS), else the (truncated) rho_t; stop-gradient.

A masked or rejected token leaves the numerator of the loss but still counts in its denominator (the global
loss-token or sequence count is fixed before the loss), as the behaviour-weight cap always did.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from areal_jax.configuration import Config, ConfigError, option
from areal_jax.objectives.stats import (
    bucket_labels,
    bucketed_stats,
    count_loss_tokens,
    effective_sample_size,
    loss_sequences_BxS,
    masked_mean,
    per_token,
    safe_div,
    segment_sums,
)

# verl's safety bound on a sequence's log weight: exp(20) ~ 5e8, far from float32 overflow
_SEQUENCE_LOG_BOUND = 20.0


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionConfig(Config):
    """Correction of the behaviour weight w = pi_prox / pi_behav (decoupled PPO): TIS, MIS and rejection."""

    is_level: Literal["token", "sequence"] = option(
        "token",
        doc="importance weight per token (w_t) or per sequence (W_i = product of its tokens' w, log bounded to "
        "[-20, 20]) given to every token of the sequence",
    )
    is_mode: Literal["plain", "truncate", "mask"] = option(
        "plain",
        doc="plain: the weight as it is (AReaL Eq. 5); truncate: min(weight, is_high) (TIS); mask: 0 where the "
        "weight is outside [is_low, is_high] (MIS; the token still counts in the loss denominator)",
    )
    is_high: float = option(2.0, gt=0.0, doc="truncate / mask: upper bound of the importance weight")
    is_low: float | None = option(
        None, ge=0.0, doc="mask only: lower bound of the importance weight; null = 1 / is_high"
    )
    rs_level: Literal["none", "token", "sequence", "geometric"] = option(
        "none",
        doc="rejection: tokens whose w_t, sequences whose W_i, or sequences whose geometric mean "
        "exp(mean log w_t) is outside [rs_low, rs_high] get weight 0 (still counted in the loss denominator)",
    )
    rs_high: float | None = option(
        None, gt=0.0, doc="rejection: upper bound, required with rs_level (geometric: close to 1, e.g. 1.001)"
    )
    rs_low: float | None = option(None, ge=0.0, doc="rejection: lower bound; null = 1 / rs_high")

    def validate(self) -> None:
        if self.is_low is not None and self.is_mode != "mask":
            raise ConfigError("is_low", f"is {self.is_low} but is_mode is {self.is_mode!r}; it bounds 'mask' only")
        if self.is_mode == "mask" and self.is_bounds[0] >= self.is_high:
            implied = " (null: 1 / is_high)" if self.is_low is None else ""
            raise ConfigError("is_low", f"value {self.is_bounds[0]}{implied} must be below is_high={self.is_high}")
        if self.rs_level == "none":
            for key in ("rs_high", "rs_low"):
                if getattr(self, key) is not None:
                    raise ConfigError(key, f"is {getattr(self, key)} but rs_level is 'none'; set it to null")
            return
        if self.rs_high is None:
            raise ConfigError(
                "rs_high", f"is null but rs_level is {self.rs_level!r}; set the upper bound (e.g. 1.001 for geometric)"
            )
        if self.rs_bounds[0] >= self.rs_high:
            implied = " (null: 1 / rs_high)" if self.rs_low is None else ""
            raise ConfigError("rs_low", f"value {self.rs_bounds[0]}{implied} must be below rs_high={self.rs_high}")

    @property
    def is_bounds(self) -> tuple[float, float]:
        """[low, high] of the masked importance weight."""
        return (1.0 / self.is_high if self.is_low is None else self.is_low), self.is_high

    @property
    def rs_bounds(self) -> tuple[float, float]:
        """[low, high] of the rejection test (rs_level set)."""
        assert self.rs_high is not None
        return (1.0 / self.rs_high if self.rs_low is None else self.rs_low), self.rs_high

    @property
    def active(self) -> bool:
        """Whether the weight differs from AReaL's plain token weight w_t."""
        return self.is_level != "token" or self.is_mode != "plain" or self.rs_level != "none"

    @property
    def needs_segments(self) -> bool:
        """Whether sequence-level quantities are needed (the packed segment ids)."""
        return self.is_level == "sequence" or self.rs_level in ("sequence", "geometric")


class CorrectedWeight(NamedTuple):
    """The weight the loss applies per token and what the correction did; every field is [B, L]."""

    weight_BxL: jax.Array  # stop-gradient, 0 off the loss mask
    truncated_BxL: jax.Array  # bool: TIS lowered the weight to is_high
    masked_BxL: jax.Array  # bool: MIS or RS set the weight to 0


def _outside(x_BxL: jax.Array, bounds: tuple[float, float]) -> jax.Array:
    low, high = bounds
    return (x_BxL < low) | (x_BxL > high)


def correct_behav_weight(
    log_w_BxL: jax.Array,
    mask_BxL: jax.Array,
    config: RolloutCorrectionConfig,
    segment_ids_BxL: jax.Array | None = None,
) -> CorrectedWeight:
    """The corrected behaviour weight (see the module docstring) from log w = logp_prox - logp_behav.

    `segment_ids_BxL` (packed segments, 0 = padding) is required when `config.needs_segments`.
    """
    if config.needs_segments and segment_ids_BxL is None:
        raise ValueError(f"segment_ids_BxL is None but {config} has sequence-level terms; pass the segment ids")
    log_w_BxL = jax.lax.stop_gradient(jnp.where(mask_BxL, log_w_BxL, 0.0))
    w_BxL = jnp.exp(log_w_BxL)
    rho_BxL = w_BxL
    if config.needs_segments:
        assert segment_ids_BxL is not None  # checked above
        log_total_BxS = segment_sums(log_w_BxL, segment_ids_BxL)
        bounded_BxS = jnp.clip(log_total_BxS, -_SEQUENCE_LOG_BOUND, _SEQUENCE_LOG_BOUND)
        seq_w_BxL = jnp.exp(per_token(bounded_BxS, segment_ids_BxL))  # W_i on every token of sequence i
        if config.is_level == "sequence":
            rho_BxL = seq_w_BxL

    truncated_BxL = jnp.zeros(rho_BxL.shape, bool)
    masked_BxL = jnp.zeros(rho_BxL.shape, bool)
    if config.is_mode == "truncate":
        truncated_BxL = rho_BxL > config.is_high
        rho_BxL = jnp.minimum(rho_BxL, config.is_high)
    elif config.is_mode == "mask":
        masked_BxL = _outside(rho_BxL, config.is_bounds)
    if config.rs_level != "none":
        if config.rs_level == "token":
            test_BxL = w_BxL
        elif config.rs_level == "sequence":
            test_BxL = seq_w_BxL
        else:
            assert segment_ids_BxL is not None  # a sequence-level test: checked above
            count_BxS = segment_sums(mask_BxL.astype(log_w_BxL.dtype), segment_ids_BxL)
            test_BxL = jnp.exp(per_token(safe_div(log_total_BxS, count_BxS), segment_ids_BxL))
        masked_BxL = masked_BxL | _outside(test_BxL, config.rs_bounds)
    masked_BxL = masked_BxL & mask_BxL
    truncated_BxL = truncated_BxL & mask_BxL & ~masked_BxL
    weight_BxL = jnp.where(mask_BxL & ~masked_BxL, rho_BxL, 0.0)
    return CorrectedWeight(weight_BxL, truncated_BxL, masked_BxL)


def correction_stats(
    corrected: CorrectedWeight,
    mask_BxL: jax.Array,
    segment_ids_BxL: jax.Array | None = None,
    bucket_BxL: jax.Array | None = None,
    num_buckets: int = 0,
) -> dict[str, jax.Array]:
    """`correction/*` statistics over the loss tokens: the applied weight's mean, mean square and normalised
    effective sample size (`ess`), the truncated and masked fractions; with `segment_ids_BxL` the fraction of
    sequences (with a loss token) whose every loss token is masked (`correction/seq/rejected_frac`); with
    `bucket_BxL` the same token statistics per staleness bucket (`correction/staleness/<k>/...`)."""
    dtype = corrected.weight_BxL.dtype
    w_BxL = corrected.weight_BxL
    token_means = {
        "weight_mean": w_BxL,
        "weight_sq_mean": jnp.square(w_BxL),
        "truncated_frac": corrected.truncated_BxL.astype(dtype),
        "masked_frac": corrected.masked_BxL.astype(dtype),
    }
    stats = {"correction/n_tokens": count_loss_tokens(mask_BxL).astype(dtype)}
    for name, x_BxL in token_means.items():
        stats[f"correction/{name}"] = masked_mean(x_BxL, mask_BxL)
    stats["correction/ess"] = effective_sample_size(stats["correction/weight_mean"], stats["correction/weight_sq_mean"])
    if segment_ids_BxL is not None:
        sequences_BxS = loss_sequences_BxS(segment_ids_BxL, mask_BxL)
        kept_BxS = segment_sums((mask_BxL & ~corrected.masked_BxL).astype(jnp.int32), segment_ids_BxL)
        n_seqs = jnp.sum(sequences_BxS).astype(dtype)
        stats["correction/seq/n_seqs"] = n_seqs
        stats["correction/seq/rejected_frac"] = safe_div(jnp.sum(sequences_BxS & (kept_BxS == 0)).astype(dtype), n_seqs)
    if bucket_BxL is not None:
        prefix = "correction/staleness"
        stats |= bucketed_stats(token_means, {}, mask_BxL, bucket_BxL, num_buckets, prefix=prefix)
        for label in bucket_labels(num_buckets):
            mean, mean_sq = stats[f"{prefix}/{label}/weight_mean"], stats[f"{prefix}/{label}/weight_sq_mean"]
            stats[f"{prefix}/{label}/ess"] = effective_sample_size(mean, mean_sq)
    return stats

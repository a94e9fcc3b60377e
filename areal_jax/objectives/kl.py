"""KL penalty to a reference policy: Schulman's k1/k2/k3 estimators, as a loss term or as reward shaping.

Legend: B rows of a packed micro-batch, L row length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from areal_jax.objectives.config import KLEstimator
from areal_jax.objectives.stats import count_loss_tokens, loss_token_mean, safe_div


def kl_estimate(logp_BxL: jax.Array, logp_ref_BxL: jax.Array, estimator: KLEstimator) -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) on tokens sampled from pi, with log r = logp_ref - logp.

    k1 = -log r;  k2 = (log r)^2 / 2;  k3 = (r - 1) - log r.
    """
    log_r_BxL = logp_ref_BxL - logp_BxL
    if estimator == "k1":
        return -log_r_BxL
    if estimator == "k2":
        return 0.5 * jnp.square(log_r_BxL)
    if estimator == "k3":
        return jnp.expm1(log_r_BxL) - log_r_BxL
    raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1', 'k2' or 'k3'")


def kl_loss(
    logp_BxL: jax.Array,
    logp_ref_BxL: jax.Array,
    loss_mask_BxL: jax.Array,
    num_loss_tokens_global: jax.Array | int,
    coef: float,
    estimator: KLEstimator,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """coef * sum over loss tokens of the KL estimate, divided by the global loss-token count."""
    mask_BxL = loss_mask_BxL.astype(bool)
    kl_BxL = kl_estimate(jnp.where(mask_BxL, logp_BxL, 0.0), jnp.where(mask_BxL, logp_ref_BxL, 0.0), estimator)
    kl_sum = jnp.sum(jnp.where(mask_BxL, kl_BxL, 0.0))
    loss = loss_token_mean(coef * kl_sum, num_loss_tokens_global)
    n_tokens = count_loss_tokens(mask_BxL).astype(kl_sum.dtype)
    return loss, {"kl/kl_loss": loss, "kl/kl_mean": safe_div(kl_sum, n_tokens), "kl/n_tokens": n_tokens}


def _segmented_reverse_cumsum(x_BxL: jax.Array, segment_ids_BxL: jax.Array) -> jax.Array:
    """out[b, t] = sum of x[b, t'] over t' >= t in the same (contiguous) segment of row b."""
    seg_rev_BxL = segment_ids_BxL[:, ::-1]
    starts_rev_BxL = jnp.concatenate(
        [jnp.ones_like(seg_rev_BxL[:, :1], dtype=bool), seg_rev_BxL[:, 1:] != seg_rev_BxL[:, :-1]], axis=1
    )

    def combine(left: tuple[jax.Array, jax.Array], right: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        left_sum, left_start = left
        right_sum, right_start = right
        return jnp.where(right_start, right_sum, left_sum + right_sum), left_start | right_start

    summed_rev_BxL, _ = jax.lax.associative_scan(combine, (x_BxL[:, ::-1], starts_rev_BxL), axis=1)
    return summed_rev_BxL[:, ::-1]


def kl_shaped_advantages(
    adv_BxL: jax.Array,
    logp_BxL: jax.Array,
    logp_ref_BxL: jax.Array,
    segment_ids_BxL: jax.Array,
    loss_mask_BxL: jax.Array,
    coef: float,
    estimator: KLEstimator,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Advantages with the per-token reward -coef*KL_t folded in as a gamma = 1 return-to-go.

    adv'_t = adv_t - coef * sum_{t' >= t, same segment, t' a loss token} KL_t'; 0 on non-loss tokens.
    `logp_BxL` is the policy the penalty refers to (e.g. the proximal or behaviour log-probs); no gradient.
    """
    mask_BxL = loss_mask_BxL.astype(bool)
    kl_BxL = kl_estimate(jnp.where(mask_BxL, logp_BxL, 0.0), jnp.where(mask_BxL, logp_ref_BxL, 0.0), estimator)
    kl_BxL = jax.lax.stop_gradient(jnp.where(mask_BxL, kl_BxL, 0.0))
    to_go_BxL = _segmented_reverse_cumsum(kl_BxL, segment_ids_BxL)
    shaped_BxL = jnp.where(mask_BxL, adv_BxL - coef * to_go_BxL, 0.0)
    n_tokens = count_loss_tokens(mask_BxL).astype(kl_BxL.dtype)
    return shaped_BxL, {"kl_reward/kl_mean": safe_div(jnp.sum(kl_BxL), n_tokens), "kl_reward/n_tokens": n_tokens}

"""Proximal log-probs without the proximal forward pass (AReaL's `prox_logp_method`) and their errors.

Decoupled PPO needs log pi_prox, the log-prob under the weights the step starts from. `recompute` takes it
from a forward pass over the whole batch (a quarter of a step's FLOPs); the approximations read only what
the update has anyway; `auto` (the default) decides per step on the host: `rollout`, exact, when every loss
token of the step was sampled by the step's starting weights (v = V), `recompute` otherwise. Per token, with V
the trainer's version during the step and v the token's version:

  rollout:    log pi_prox ~= log pi_behav                 exact where v = V (the step's weights sampled it)
  loglinear:  log pi_prox ~= log pi_behav + alpha * (sg(log pi_theta) - log pi_behav)
              alpha = clip((v_prox - v) / (v_theta - v), 0, 1), 0 where v_theta <= v or v < 0,
              with AReaL's versions v_theta = V and v_prox = V - 1 (areal `compute_prox_logp_approximations`)

log pi_theta is the update's own forward pass, under stop-gradient (the proximal policy is a constant).
Legend: B rows of a packed micro-batch, L row length.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from areal_jax.objectives.stats import count_loss_tokens, masked_mean

ProxLogpMethod = Literal["auto", "recompute", "rollout", "loglinear", "metrics"]
APPROXIMATIONS: tuple[ProxLogpMethod, ...] = ("rollout", "loglinear")


def loglinear_alpha(token_version_BxL: jax.Array, trainer_version: jax.Array | int) -> jax.Array:
    """AReaL's interpolation weight per token (see the module docstring); 0 on tokens the policy did not sample."""
    v_BxL = token_version_BxL.astype(jnp.float32)
    v_theta = jnp.asarray(trainer_version, jnp.float32)
    gap_BxL = v_theta - v_BxL
    ok_BxL = (gap_BxL > 0) & (token_version_BxL >= 0)
    alpha_BxL = jnp.where(ok_BxL, (v_theta - 1.0 - v_BxL) / jnp.where(ok_BxL, gap_BxL, 1.0), 0.0)
    return jnp.clip(alpha_BxL, 0.0, 1.0)


def approximate_prox_logp(
    method: ProxLogpMethod,
    logp_BxL: jax.Array,
    logp_behav_BxL: jax.Array,
    token_version_BxL: jax.Array,
    trainer_version: jax.Array | int,
) -> jax.Array:
    """log pi_prox by `method` ('rollout' or 'loglinear'), from the update's log-probs and the behaviour ones."""
    if method == "rollout":
        return logp_behav_BxL
    if method == "loglinear":
        alpha_BxL = loglinear_alpha(token_version_BxL, trainer_version).astype(logp_behav_BxL.dtype)
        return logp_behav_BxL + alpha_BxL * (jax.lax.stop_gradient(logp_BxL) - logp_behav_BxL)
    raise ValueError(f"prox_logp_method {method!r} is not an approximation; expected one of {APPROXIMATIONS}")


def prox_approximation_stats(
    logp_prox_BxL: jax.Array,
    logp_BxL: jax.Array,
    logp_behav_BxL: jax.Array,
    token_version_BxL: jax.Array,
    trainer_version: jax.Array | int,
    mask_BxL: jax.Array,
) -> dict[str, jax.Array]:
    """Mean |approximation - recomputed log pi_prox| over the loss tokens for each approximation
    (`prox/<method>_abs_err`, `prox/<method>_abs_err_max`), the mean loglinear weight, and `prox/n_tokens`."""
    dtype = logp_prox_BxL.dtype
    stats = {"prox/n_tokens": count_loss_tokens(mask_BxL).astype(dtype)}
    for method in APPROXIMATIONS:
        approx_BxL = approximate_prox_logp(method, logp_BxL, logp_behav_BxL, token_version_BxL, trainer_version)
        err_BxL = jax.lax.stop_gradient(jnp.abs(approx_BxL - logp_prox_BxL))
        stats[f"prox/{method}_abs_err"] = masked_mean(err_BxL, mask_BxL)
        stats[f"prox/{method}_abs_err_max"] = jnp.max(jnp.where(mask_BxL, err_BxL, 0.0))
    alpha_BxL = loglinear_alpha(token_version_BxL, trainer_version).astype(dtype)
    stats["prox/loglinear_alpha_mean"] = masked_mean(alpha_BxL, mask_BxL)
    return stats

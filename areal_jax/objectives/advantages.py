"""Outcome-reward advantages (gamma = lambda = 1, no critic): GRPO, Dr. GRPO, RLOO and batch normalisation.

Legend: N sequences, G groups (static), B rows of a packed micro-batch, L row length.
Per sequence i in group g(i), over the valid sequences only:
  r_i = clip((reward_i + bias) * scale, -c, c)
  baseline_i = mean of r over i's level (group / batch), or over the others at that level (leave-one-out;
               r_i itself when i is alone), or 0 (level none)
  std_i = population std (ddof 0) of r over i's std level, or (level none) no division
  A_i = (r_i - baseline_i) / (std_i + eps)
Every token of sequence i gets A_i. With `weight_N` (an agent episode trained as k sequences, each of weight
1/k, all with the episode's reward) the means, counts and stds are over episodes, not sequences: each episode
counts once, and every sequence of it gets the episode's advantage.
DAPO's overlong shaping (`overlong_penalty`, host-side) is added to reward_i before all of this.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.objectives.config import AdvantageConfig, NormLevel
from areal_jax.objectives.stats import safe_div


def shape_rewards(reward_N: jax.Array, config: AdvantageConfig) -> jax.Array:
    """(reward + bias) * scale, clipped to [-reward_clip, reward_clip] when set."""
    shaped_N = (reward_N + config.reward_bias) * config.reward_scale
    if config.reward_clip is not None:
        shaped_N = jnp.clip(shaped_N, -config.reward_clip, config.reward_clip)
    return shaped_N


def overlong_penalty(length_N: np.ndarray, max_length: int, buffer: int, penalty: float) -> np.ndarray:
    """DAPO's soft overlong punishment (Eq. 13) of responses of `length_N` tokens, capped at max_length:
    -penalty * min(max(0, len - (max_length - buffer)) / buffer, 1); all 0 when buffer is 0."""
    length_N = np.asarray(length_N, np.float64)
    if buffer == 0:
        return np.zeros(length_N.shape)
    excess_N = np.clip(length_N - (max_length - buffer), 0.0, buffer)
    return -penalty * excess_N / buffer


def _level_sum(x_N: jax.Array, level: NormLevel, group_id_N: jax.Array, num_groups: int) -> jax.Array:
    """For each sequence, the sum of x over its group (level group) or over the batch (level batch)."""
    if level == "group":
        return jax.ops.segment_sum(x_N, group_id_N, num_segments=num_groups)[group_id_N]
    return jnp.broadcast_to(jnp.sum(x_N), x_N.shape)


def sequence_advantages(
    reward_N: jax.Array,
    group_id_N: jax.Array,
    config: AdvantageConfig,
    num_groups: int,
    valid_N: jax.Array | None = None,
    weight_N: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-sequence advantages from outcome rewards (see the module docstring) and their statistics.

    `group_id_N` holds ids in [0, num_groups); groups may differ in size. `valid_N` marks real sequences
    (padding entries neither enter any mean or std nor get an advantage other than 0). `weight_N`: each
    sequence's share of its episode (1 / its episode's sequences; the shares of an episode sum to 1).
    """
    if reward_N.ndim != 1 or group_id_N.shape != reward_N.shape:
        raise ValueError(f"reward_N {reward_N.shape} and group_id_N {group_id_N.shape} must be equal 1-d shapes")
    if valid_N is not None and valid_N.shape != reward_N.shape:
        raise ValueError(f"valid_N has shape {valid_N.shape}; expected {reward_N.shape} like reward_N")
    dtype = jnp.promote_types(reward_N.dtype, jnp.float32)
    valid_N = jnp.ones(reward_N.shape, bool) if valid_N is None else valid_N.astype(bool)
    ones_N = valid_N.astype(dtype)
    share_N = ones_N if weight_N is None else ones_N * weight_N.astype(dtype)
    r_N = jnp.where(valid_N, shape_rewards(reward_N.astype(dtype), config), 0.0)

    def level_mean(level: NormLevel) -> tuple[jax.Array, jax.Array]:
        total_N = _level_sum(share_N * r_N, level, group_id_N, num_groups)
        count_N = _level_sum(share_N, level, group_id_N, num_groups)  # episodes
        return total_N, count_N

    if config.mean_level == "none":
        baseline_N = jnp.zeros_like(r_N)
    else:
        total_N, count_N = level_mean(config.mean_level)
        if config.leave_one_out:  # the others: all but this sequence's episode (its shares sum to 1)
            baseline_N = jnp.where(count_N > 1 + 1e-6, safe_div(total_N - r_N, count_N - 1), r_N)
        else:
            baseline_N = safe_div(total_N, count_N)
    centred_N = r_N - baseline_N

    if config.std_level == "none":
        adv_N = centred_N
    else:
        total_N, count_N = level_mean(config.std_level)
        dev_N = jnp.where(valid_N, r_N - safe_div(total_N, count_N), 0.0)
        var_N = safe_div(_level_sum(share_N * jnp.square(dev_N), config.std_level, group_id_N, num_groups), count_N)
        positive_N = var_N > 0
        std_N = jnp.where(positive_N, jnp.sqrt(jnp.where(positive_N, var_N, 1.0)), 0.0)
        adv_N = centred_N / (std_N + config.std_eps)
    adv_N = jnp.where(valid_N, adv_N, 0.0)
    return adv_N, _advantage_stats(r_N, adv_N, valid_N, group_id_N, num_groups)


def _advantage_stats(
    r_N: jax.Array, adv_N: jax.Array, valid_N: jax.Array, group_id_N: jax.Array, num_groups: int
) -> dict[str, jax.Array]:
    ones_N = valid_N.astype(r_N.dtype)
    n = jnp.sum(ones_N)
    reward_mean = safe_div(jnp.sum(r_N), n)
    reward_var = safe_div(jnp.sum(jnp.where(valid_N, jnp.square(r_N - reward_mean), 0.0)), n)
    group_count_G = jax.ops.segment_sum(ones_N, group_id_N, num_segments=num_groups)
    big = jnp.finfo(r_N.dtype).max
    group_max_G = jax.ops.segment_max(jnp.where(valid_N, r_N, -big), group_id_N, num_segments=num_groups)
    group_min_G = jax.ops.segment_min(jnp.where(valid_N, r_N, big), group_id_N, num_segments=num_groups)
    nonempty_G = group_count_G > 0
    constant_G = nonempty_G & (group_max_G == group_min_G)
    return {
        "adv/n_seqs": n,
        "adv/reward_mean": reward_mean,
        "adv/reward_std": jnp.sqrt(reward_var),
        "adv/adv_mean": safe_div(jnp.sum(adv_N), n),
        "adv/adv_abs_mean": safe_div(jnp.sum(jnp.abs(adv_N)), n),
        "adv/constant_group_frac": safe_div(jnp.sum(constant_G).astype(r_N.dtype), jnp.sum(nonempty_G)),
    }


def token_advantages(adv_N: jax.Array, seq_index_BxL: jax.Array) -> jax.Array:
    """Broadcast sequence advantages to packed tokens: adv_N[seq_index], 0 where seq_index < 0 (padding)."""
    return jnp.where(seq_index_BxL >= 0, adv_N[jnp.maximum(seq_index_BxL, 0)], 0.0)

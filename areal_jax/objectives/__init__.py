"""Pure, jittable RL objectives: decoupled PPO, advantages, KL estimators, statistics."""

from areal_jax.objectives.advantages import sequence_advantages, shape_rewards, token_advantages
from areal_jax.objectives.config import AdvantageConfig, PPOConfig
from areal_jax.objectives.kl import kl_estimate, kl_loss, kl_shaped_advantages
from areal_jax.objectives.ppo import ppo_loss
from areal_jax.objectives.stats import merge_stats

__all__ = [
    "AdvantageConfig",
    "PPOConfig",
    "kl_estimate",
    "kl_loss",
    "kl_shaped_advantages",
    "merge_stats",
    "ppo_loss",
    "sequence_advantages",
    "shape_rewards",
    "token_advantages",
]

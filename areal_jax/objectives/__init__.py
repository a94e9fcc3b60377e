"""Pure, jittable RL objectives: decoupled PPO and GSPO, rollout correction, advantages, KL estimators, statistics."""

from areal_jax.objectives.advantages import overlong_penalty, sequence_advantages, shape_rewards, token_advantages
from areal_jax.objectives.config import AdvantageConfig, PPOConfig
from areal_jax.objectives.correction import RolloutCorrectionConfig, correct_behav_weight, correction_stats
from areal_jax.objectives.kl import kl_estimate, kl_loss, kl_shaped_advantages
from areal_jax.objectives.ppo import PPOTerms, ppo_loss, ppo_stats, ppo_terms
from areal_jax.objectives.stats import count_loss_sequences, count_loss_tokens, loss_token_mean, merge_stats

__all__ = [
    "AdvantageConfig",
    "PPOConfig",
    "PPOTerms",
    "RolloutCorrectionConfig",
    "correct_behav_weight",
    "correction_stats",
    "count_loss_sequences",
    "count_loss_tokens",
    "kl_estimate",
    "kl_loss",
    "kl_shaped_advantages",
    "loss_token_mean",
    "merge_stats",
    "overlong_penalty",
    "ppo_loss",
    "ppo_stats",
    "ppo_terms",
    "sequence_advantages",
    "shape_rewards",
    "token_advantages",
]

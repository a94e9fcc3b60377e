"""Frozen, hashable settings of the RL objectives (PPO loss and advantage estimation); static args to jit."""

from __future__ import annotations

import dataclasses
from typing import Literal

from areal_jax.configuration import Config, ConfigError, option
from areal_jax.objectives.correction import RolloutCorrectionConfig
from areal_jax.objectives.prox import ProxLogpMethod

KLEstimator = Literal["k1", "k2", "k3"]
NormLevel = Literal["group", "batch", "none"]


@dataclasses.dataclass(frozen=True)
class PPOConfig(Config):
    """The policy loss: decoupled (AReaL Eq. 5) or plain PPO, token or sequence (GSPO) ratio, clipping, rollout
    correction of the behaviour weight, loss aggregation, KL loss term."""

    decoupled: bool = option(
        True,
        doc="decoupled PPO: clip the ratio against the proximal policy and weight each token by "
        "w = pi_prox / pi_behav (always applied); false: plain PPO with the ratio against the behaviour policy",
    )
    eps_clip_low: float = option(0.2, ge=0.0, doc="lower clip: the ratio is clipped below at 1 - eps_clip_low")
    eps_clip_high: float = option(0.2, ge=0.0, doc="upper clip: the ratio is clipped above at 1 + eps_clip_high")
    dual_clip: float | None = option(
        None, gt=1.0, doc="dual clip c: for negative advantages the clipped term is capped at c*|A|; null = off"
    )
    ratio_level: Literal["token", "sequence"] = option(
        "token",
        doc="token: the PPO ratio per token; sequence: GSPO's sequence ratio exp(mean over the sequence's loss "
        "tokens of logp - logp_old), per token sg(s_i) * pi / sg(pi) (set eps_clip_low/high small, e.g. 3e-4/4e-4)",
    )
    loss_agg: Literal["token_mean", "seq_mean_token_mean"] = option(
        "token_mean",
        doc="token_mean: sum over loss tokens / the global loss-token count; seq_mean_token_mean: each sequence's "
        "token mean, summed / the global count of sequences with a loss token (the KL loss term stays token_mean)",
    )
    rollout_correction: RolloutCorrectionConfig = option(
        default_factory=RolloutCorrectionConfig,
        doc="decoupled only: truncated / masked importance weights and rejection on w = pi_prox / pi_behav",
    )
    behav_weight_cap: float | None = option(
        None,
        gt=0.0,
        doc="short for a token-level rollout_correction (decoupled only): mask -> is_mode mask with "
        "[is_low, is_high] = [0, cap]; clamp -> is_mode truncate with is_high = cap; null = no cap",
    )
    behav_weight_cap_mode: Literal["mask", "clamp"] = option(
        "mask",
        doc="mask: tokens with w > cap contribute 0 to the sum but still count in the denominator; "
        "clamp: w is replaced by min(w, cap)",
    )
    kl_coef: float = option(0.0, ge=0.0, doc="coefficient of the KL-to-reference loss term; 0 = off")
    kl_estimator: Literal["k1", "k2", "k3"] = option(
        "k3", doc="estimator of the KL loss term (Schulman's k1, k2 or k3)"
    )
    num_staleness_buckets: int = option(
        4, ge=1, doc="K: off-policy statistics are broken down by staleness 0..K-1 and >=K"
    )
    prox_logp_method: ProxLogpMethod = option(
        "auto",
        doc="decoupled only: where log pi_prox comes from. auto (exact): the first mini-batch's update runs at the "
        "step's starting weights, so its own log-probs (stop-gradient) are log pi_prox and no pass runs for it "
        "(with ppo_minibatches 1, none at all); later mini-batches recompute, unless every loss token of the "
        "step was sampled by the starting weights (log pi_prox = log pi_behav; not with an active "
        "rollout_correction, nor on trainer.logprob_monitor_every's steps); recompute: a forward pass with the "
        "step's starting weights (exact); rollout: the behaviour log-probs (exact when every token is "
        "on-policy, e.g. eta = 0); loglinear: AReaL's version-weighted log-space interpolation between the "
        "behaviour and the update's log-probs; rollout and loglinear never run the proximal forward pass. "
        "metrics: recompute, and log the errors of the approximations (prox/*_abs_err)",
    )

    @property
    def needs_prox_pass(self) -> bool:
        """Whether a step may run the proximal forward pass (decoupled, with auto, recompute or metrics)."""
        return self.decoupled and self.prox_logp_method in ("auto", "recompute", "metrics")

    @property
    def skips_prox_pass_on_policy(self) -> bool:
        """Whether a step whose every loss token is on-policy skips the proximal pass (auto, no active
        correction: on-policy the correction's w is the sampler/trainer mismatch it is there to correct)."""
        return self.decoupled and self.prox_logp_method == "auto" and not self.correction.active

    @property
    def correction(self) -> RolloutCorrectionConfig:
        """The rollout correction in effect: `rollout_correction`, or the one `behav_weight_cap` is short for."""
        if self.behav_weight_cap is None:
            return self.rollout_correction
        if self.behav_weight_cap_mode == "mask":
            return RolloutCorrectionConfig(is_mode="mask", is_high=self.behav_weight_cap, is_low=0.0)
        return RolloutCorrectionConfig(is_mode="truncate", is_high=self.behav_weight_cap)

    @property
    def needs_segments(self) -> bool:
        """Whether the loss needs the packed segment ids (sequence-level ratio, aggregation or correction)."""
        sequence_level = self.ratio_level == "sequence" or self.loss_agg != "token_mean"
        return sequence_level or (self.decoupled and self.correction.needs_segments)

    def validate(self) -> None:
        if not self.decoupled and self.prox_logp_method not in ("auto", "recompute"):
            raise ConfigError(
                "prox_logp_method",
                f"is {self.prox_logp_method!r} but decoupled is false, so there is no proximal policy; "
                "set it to 'auto' or 'recompute' or enable decoupled",
            )
        if not self.decoupled and self.behav_weight_cap is not None:
            raise ConfigError(
                "behav_weight_cap",
                f"got {self.behav_weight_cap!r} but decoupled is false, so there is no behaviour weight to cap; "
                "set it to null or enable decoupled",
            )
        if not self.decoupled and self.rollout_correction.active:
            raise ConfigError(
                "rollout_correction",
                "is active but decoupled is false, so there is no behaviour weight pi_prox / pi_behav to "
                "correct; leave it at its defaults or enable decoupled",
            )
        if self.behav_weight_cap is not None and self.rollout_correction != RolloutCorrectionConfig():
            raise ConfigError(
                "behav_weight_cap",
                f"is {self.behav_weight_cap} and rollout_correction is set too; behav_weight_cap is short for a "
                "token-level rollout_correction (is_mode mask or truncate, is_high = cap): set only one",
            )


@dataclasses.dataclass(frozen=True)
class AdvantageConfig(Config):
    """Outcome-reward advantages (gamma = lambda = 1, no critic): overlong and reward shaping, baselines,
    normalisation."""

    reward_bias: float = option(0.0, doc="added to the raw reward first: r' = (r + bias) * scale")
    reward_scale: float = option(1.0, doc="multiplies the biased reward")
    reward_clip: float | None = option(None, gt=0.0, doc="clip the shaped reward to [-c, c]; null = off")
    mean_level: Literal["group", "batch", "none"] = option(
        "group", doc="subtract the reward mean of the sample's group, the batch, or none"
    )
    std_level: Literal["group", "batch", "none"] = option(
        "group", doc="divide by the reward std (ddof 0) of the group, the batch, or none"
    )
    leave_one_out: bool = option(
        False, doc="RLOO: the baseline is the mean of the *other* samples at mean_level (needs mean_level != none)"
    )
    std_eps: float = option(1e-5, gt=0.0, doc="added to the std before dividing")
    kl_reward_coef: float = option(
        0.0, ge=0.0, doc="reward shaping: per-token reward -coef*KL(policy || reference); 0 = off"
    )
    kl_estimator: Literal["k1", "k2", "k3"] = option(
        "k1", doc="estimator of the KL reward penalty (Schulman's k1, k2 or k3)"
    )
    overlong_buffer: int = option(
        0,
        ge=0,
        doc="DAPO overlong shaping: a response longer than max_new_tokens - overlong_buffer tokens gets "
        "-overlong_penalty * (length - (max_new_tokens - overlong_buffer)) / overlong_buffer added to its "
        "raw reward (before bias, scale and clip); 0 = off",
    )
    overlong_penalty: float = option(1.0, ge=0.0, doc="DAPO overlong shaping: the penalty at max_new_tokens")

    def validate(self) -> None:
        if self.leave_one_out and self.mean_level == "none":
            raise ConfigError("leave_one_out", "is true but mean_level is 'none'; choose 'group' or 'batch'")

    @classmethod
    def grpo(cls) -> AdvantageConfig:
        """GRPO: group mean and group std."""
        return cls(mean_level="group", std_level="group")

    @classmethod
    def dr_grpo(cls) -> AdvantageConfig:
        """Dr. GRPO: group mean only, no std division."""
        return cls(mean_level="group", std_level="none")

    @classmethod
    def rloo(cls) -> AdvantageConfig:
        """RLOO: leave-one-out group mean, no std division."""
        return cls(mean_level="group", std_level="none", leave_one_out=True)

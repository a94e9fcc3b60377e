"""Frozen, hashable settings of the RL objectives (PPO loss and advantage estimation); static args to jit."""

from __future__ import annotations

import dataclasses
from typing import Literal

from areal_jax.configuration import Config, ConfigError, option
from areal_jax.objectives.prox import ProxLogpMethod

KLEstimator = Literal["k1", "k2", "k3"]
NormLevel = Literal["group", "batch", "none"]


@dataclasses.dataclass(frozen=True)
class PPOConfig(Config):
    """The policy loss: decoupled (AReaL Eq. 5) or plain PPO, clipping, behaviour-weight cap, KL loss term."""

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
    behav_weight_cap: float | None = option(
        None, gt=0.0, doc="cap on the behaviour importance weight w (decoupled only); null = no cap"
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
        "recompute",
        doc="decoupled only: where log pi_prox comes from. recompute: a forward pass with the step's starting "
        "weights (exact); rollout: the behaviour log-probs (exact when every token is on-policy, e.g. eta = 0); "
        "loglinear: AReaL's version-weighted log-space interpolation between the behaviour and the update's "
        "log-probs; rollout and loglinear skip the proximal forward pass. metrics: recompute, and log the "
        "errors of the approximations (prox/*_abs_err)",
    )

    @property
    def needs_prox_pass(self) -> bool:
        """Whether a step runs the proximal forward pass (decoupled, with recompute or metrics)."""
        return self.decoupled and self.prox_logp_method in ("recompute", "metrics")

    def validate(self) -> None:
        if not self.decoupled and self.prox_logp_method != "recompute":
            raise ConfigError(
                "prox_logp_method",
                f"is {self.prox_logp_method!r} but decoupled is false, so there is no proximal policy; "
                "set it to 'recompute' or enable decoupled",
            )
        if not self.decoupled and self.behav_weight_cap is not None:
            raise ConfigError(
                "behav_weight_cap",
                f"got {self.behav_weight_cap!r} but decoupled is false, so there is no behaviour weight to cap; "
                "set it to null or enable decoupled",
            )


@dataclasses.dataclass(frozen=True)
class AdvantageConfig(Config):
    """Outcome-reward advantages (gamma = lambda = 1, no critic): reward shaping, baselines, normalisation."""

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

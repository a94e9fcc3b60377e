"""Settings of the trainer: optimizer, learning-rate schedule, PPO mini-batches, numerics, and the
objective and packing sub-sections.

Numerics ("fp32 master params + bf16 compute"): the trainer keeps its parameters and the Adam moments in
`ModelConfig.param_dtype`: float32 by default, whatever dtype the HF checkpoint stores (the master copy every
update is applied to; bfloat16 when the user sets it, with a warning that small updates are lost); the matmuls
run in `ModelConfig.compute_dtype`, because the decoder casts each weight to it where it is used, and the
gradient flows back through that cast into the fp32 master. `TrainerConfig.compute_dtype` overrides the
model's compute dtype for the trainer only (e.g. bf16 training of a model whose sampler computes in fp32).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from areal_jax.configuration import Config, ConfigError, option
from areal_jax.data.packing import PackingConfig
from areal_jax.objectives.config import AdvantageConfig, PPOConfig


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Config):
    """AdamW with global-norm gradient clipping and a warm-up + constant/cosine learning-rate schedule; an
    update whose gradient is not finite is skipped."""

    lr: float = option(1e-6, gt=0.0, doc="peak learning rate")
    beta1: float = option(0.9, ge=0.0, lt=1.0, doc="Adam first-moment decay")
    beta2: float = option(0.999, ge=0.0, lt=1.0, doc="Adam second-moment decay")
    eps: float = option(1e-8, gt=0.0, doc="Adam epsilon (added to the root of the second moment)")
    weight_decay: float = option(
        0.01,
        ge=0.0,
        doc="decoupled weight decay (times lr) of matmul kernels and embeddings (the parameters with the "
        "model-width axis 'embed'); biases and norm scales are not decayed",
    )
    grad_clip: float | None = option(1.0, gt=0.0, doc="clip gradients to this global L2 norm; null = no clipping")
    warmup_steps: int = option(
        0, ge=0, doc="linear warm-up: update k (from 0) uses lr * (k + 1) / warmup_steps while k < warmup_steps"
    )
    schedule: Literal["constant", "cosine"] = option(
        "constant", doc="after warm-up: constant lr, or cosine decay to min_lr_ratio * lr at total_steps"
    )
    total_steps: int | None = option(
        None, ge=1, doc="optimizer updates over which the cosine decays (warm-up included); cosine only"
    )
    min_lr_ratio: float = option(0.0, ge=0.0, le=1.0, doc="cosine: final lr as a fraction of lr")

    def validate(self) -> None:
        if self.schedule == "cosine":
            if self.total_steps is None:
                raise ConfigError("total_steps", "is null but schedule is 'cosine'; set the number of updates")
            if self.total_steps <= self.warmup_steps:
                raise ConfigError(
                    "total_steps",
                    f"value {self.total_steps} must exceed warmup_steps={self.warmup_steps} for the cosine schedule",
                )
        elif self.total_steps is not None:
            raise ConfigError("total_steps", f"is {self.total_steps} but schedule is 'constant'; set it to null")


@dataclasses.dataclass(frozen=True)
class TrainerMoEConfig(Config):
    """How the trainer routes a mixture of experts (`model.moe`; docs/moe.md)."""

    routing_replay: Literal["none", "rollout"] = option(
        "rollout",
        doc="rollout: route each trained token to the experts the sampler recorded for it (R3; every trajectory "
        "must carry routing), gate weights from the trainer's router at those experts; none: the trainer's own "
        "top-k (on benchmarks/moe.py's bf16 trainer, 3.6x the log-prob mismatch: docs/moe.md). Either way moe/* "
        "reports how often the trainer's own routing differs from the rollout's. A dense model has no routing: "
        "nothing to replay",
    )


@dataclasses.dataclass(frozen=True)
class TrainerConfig(Config):
    """The trainer: one step = advantages (with DAPO's overlong shaping when `advantage.overlong_buffer` > 0),
    the proximal log-prob pass (unless `ppo.prox_logp_method` approximates it, or with auto the step is
    on-policy) and, with a KL coefficient > 0, the reference one, then `ppo_minibatches` optimizer updates.
    A KL coefficient > 0 needs the `Trainer` to be given the reference policy's params, an overlong buffer
    the sampler's max_new_tokens."""

    optimizer: OptimizerConfig = option(default_factory=OptimizerConfig, doc="AdamW, clipping and lr schedule")
    ppo_minibatches: int = option(
        1,
        ge=1,
        doc="optimizer updates per step: the step's sequences are split into this many mini-batches of "
        "balanced token counts, each one update whose loss is normalised by its own loss-token count",
    )
    logprob_mismatch_warning: float = option(
        0.02,
        gt=0,
        doc="warn when tokens sampled by the trainer's current version score a mean |log p| difference "
        "above this between the sampler and the trainer (the same weights: a numerics mismatch)",
    )
    logprob_monitor_every: int = option(
        10,
        ge=1,
        doc="with ppo.prox_logp_method auto: every this many steps an on-policy step still runs the proximal pass "
        "(which auto otherwise skips there), so the sampler/trainer mismatch monitor (monitor/*) keeps measuring",
    )
    max_skipped_steps: int = option(
        20, ge=1, doc="stop the run after this many steps in a row whose every update was skipped (non-finite)"
    )
    compute_dtype: Literal["model", "float32", "bfloat16"] = option(
        "model",
        doc="matmul dtype of the trainer ('model' = ModelConfig.compute_dtype); params and Adam state stay float32",
    )
    ppo: PPOConfig = option(default_factory=PPOConfig, doc="the policy loss")
    advantage: AdvantageConfig = option(default_factory=AdvantageConfig, doc="outcome-reward advantages")
    packing: PackingConfig = option(
        default_factory=PackingConfig, doc="micro-batch buckets: each step the least-padding one under the token budget"
    )
    moe: TrainerMoEConfig = option(
        default_factory=TrainerMoEConfig, doc="mixture-of-experts routing in the trainer (model.moe only)"
    )

    @property
    def uses_reference(self) -> bool:
        """Whether a step reads the frozen reference policy (a KL coefficient is > 0): the run keeps the
        starting policy's params for it."""
        return self.ppo.kl_coef > 0 or self.advantage.kl_reward_coef > 0

"""Configuration of the rollout side: engine capacity, workflow, staleness, transport of results."""

from __future__ import annotations

import dataclasses

from areal_jax.configuration import Config, ConfigError, option
from areal_jax.data.rollout_log import RolloutLogConfig
from areal_jax.inference.engine import EngineConfig
from areal_jax.rollout.dynamic_sampling import DynamicSamplingConfig
from areal_jax.rollout.failures import FailureBudgetConfig
from areal_jax.rollout.staleness import StalenessConfig
from areal_jax.rollout.workflow import WorkflowConfig


@dataclasses.dataclass(frozen=True)
class RolloutConfig(Config):
    """Everything the rollout side needs besides the model."""

    engine: EngineConfig = option(default_factory=EngineConfig, doc="slots and cache length")
    workflow: WorkflowConfig = option(default_factory=WorkflowConfig, doc="samples per prompt, sampling, rewards")
    staleness: StalenessConfig = option(default_factory=StalenessConfig, doc="eta and batch size in prompts")
    log: RolloutLogConfig = option(default_factory=RolloutLogConfig, doc="durable rollout log shards")
    failures: FailureBudgetConfig = option(
        default_factory=FailureBudgetConfig, doc="how many failed rollouts stop the run"
    )
    dynamic_sampling: DynamicSamplingConfig = option(
        default_factory=DynamicSamplingConfig, doc="DAPO: groups whose rewards are all equal are replaced"
    )
    interrupt: bool = option(True, doc="interrupt in-flight generation on weight updates (else drain first)")
    inference_share: int = option(3, ge=1, doc="inference part of the inference:trainer device ratio")
    trainer_share: int = option(1, ge=1, doc="trainer part of the inference:trainer device ratio")

    def validate(self) -> None:
        if self.dynamic_sampling.enabled and self.workflow.n_samples < 2:
            raise ConfigError(
                "dynamic_sampling.enabled",
                f"is true but workflow.n_samples is {self.workflow.n_samples}: a group of one sample always has "
                "equal rewards, so every group would be dropped; use n_samples >= 2 or disable it",
            )

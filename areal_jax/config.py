"""The experiment config: every section of a run in one typed tree, loaded from YAML plus overrides."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

from areal_jax.configuration import Config, ConfigError, load, option
from areal_jax.models.config import ModelConfig
from areal_jax.profiling import ProfileConfig
from areal_jax.rollout.config import RolloutConfig
from areal_jax.sharding import MeshConfig
from areal_jax.trainer.checkpoint import CheckpointConfig
from areal_jax.trainer.config import TrainerConfig


@dataclasses.dataclass(frozen=True)
class GenerationConfig(Config):
    """Sampling settings of a generation run."""

    max_new_tokens: int = option(32, ge=1, doc="tokens generated per prompt at most")
    temperature: float = option(1.0, ge=0, doc="softmax temperature; 0 = greedy")
    num_prompts: int = option(8, ge=1, doc="prompts drawn from the task")
    samples_per_prompt: int = option(2, ge=1, doc="completions per prompt")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig(Config):
    """A whole run: where the model comes from, how devices are arranged, what to do."""

    name: str = option("demo", doc="run name; outputs go to <output_dir>/<name>")
    output_dir: str = option("runs", doc="root directory of run outputs")
    seed: int = option(0, ge=0, doc="seed of parameter init, data order and sampling")
    tokenizer: str = option("char", doc="'char' (synthetic tasks) or a directory with tokenizer.json")
    hf_checkpoint: str | None = option(None, doc="HF checkpoint directory to start from; null = random init")
    model: ModelConfig = option(default_factory=ModelConfig, doc="decoder architecture")
    mesh: MeshConfig = option(default_factory=MeshConfig, doc="device mesh (the demo's, and each side's shape)")
    generation: GenerationConfig = option(default_factory=GenerationConfig, doc="sampling of `demo`")
    train_steps: int = option(20, ge=1, doc="trainer steps of `train`")
    trainer: TrainerConfig = option(default_factory=TrainerConfig, doc="the PPO trainer")
    rollout: RolloutConfig = option(default_factory=RolloutConfig, doc="the rollout side")
    train_checkpoint: CheckpointConfig = option(default_factory=CheckpointConfig, doc="training checkpoints")
    profile: ProfileConfig = option(default_factory=ProfileConfig, doc="an XProf trace over some trainer steps")
    compilation_cache_dir: str | None = option(
        None, doc="persistent XLA compilation cache shared by runs (local or gs://); null = off"
    )

    def validate(self) -> None:
        sampler = self.rollout.workflow.sampling
        if sampler.temperature != self.trainer.temperature:
            raise ConfigError(
                "trainer.temperature",
                f"value {self.trainer.temperature} differs from rollout.workflow.sampling.temperature="
                f"{sampler.temperature}; behaviour and trainer log-probs must use the same temperature",
            )

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


def load_experiment(path: str | Path | None = None, overrides: Iterable[str] = ()) -> ExperimentConfig:
    """Read an experiment YAML (optional) and apply `section.key=value` overrides."""
    return load(ExperimentConfig, path, overrides)

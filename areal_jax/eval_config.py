"""The `eval` config section: which prompts are evaluated (`areal-jax eval`, the held-out split during training)
and how they are sampled. A leaf: `areal_jax.config` gathers it, `areal_jax.jobs.evaluate` runs it."""

from __future__ import annotations

import dataclasses

from areal_jax.configuration import Config, ConfigError, option
from areal_jax.data.datasets import DatasetConfig
from areal_jax.inference.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class EvalConfig(Config):
    """Evaluation: which prompts (`areal-jax eval`, and the held-out split during training) and how they are sampled."""

    every_steps: int = option(0, ge=0, doc="train: evaluate the held-out split every N trainer steps; 0 = off")
    samples_per_prompt: int = option(1, ge=1, doc="k: samples per prompt (pass@k, avg@k); > 1 needs temperature > 0")
    temperature: float = option(0.0, ge=0, doc="sampling temperature; 0 = greedy")
    top_k: int = option(0, ge=0, doc="keep the k most likely tokens; 0 = off")
    top_p: float = option(1.0, gt=0, le=1, doc="nucleus mass to keep; 1 = off")
    max_new_tokens: int | None = option(
        None, ge=1, doc="tokens generated per sample at most; null = rollout.workflow.sampling.max_new_tokens"
    )
    files: tuple[DatasetConfig, ...] = option(
        (), doc="datasets for `areal-jax eval`; empty = the run's held-out split of `dataset` (dataset.heldout)"
    )
    max_prompts: int = option(0, ge=0, doc="prompts per dataset at most (the first ones); 0 = all")

    def validate(self) -> None:
        if self.samples_per_prompt > 1 and self.temperature == 0:
            raise ConfigError(
                "samples_per_prompt",
                f"value {self.samples_per_prompt} with temperature=0 (greedy) draws {self.samples_per_prompt} "
                "identical samples; set temperature > 0 or samples_per_prompt=1",
            )

    def sampling(self, base: SamplingParams, seed: int) -> SamplingParams:
        """`base` (the workflow's sampling: stop ids and strings) with the evaluation's settings and `seed`."""
        return base.replace(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            max_new_tokens=self.max_new_tokens or base.max_new_tokens,
            seed=seed,
        )

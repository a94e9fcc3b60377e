"""Running prompts through a live generator and scoring them: `evaluate` (the held-out split during
training, on the rollout side; `areal-jax eval` in `areal_jax.jobs.evaluate`) and its `EvalReport`.

Every prompt goes through the same continuous-batching `Generator` and the run's workflow (its chat
template, reward function or environment), with the evaluation's own sampling: k = `samples_per_prompt`
samples per prompt at `temperature` / `top_k` / `top_p` (temperature 0 = greedy, then k must be 1), at most
`max_new_tokens` each. Truncated samples keep the reward of their text (the workflow's truncation rule is
a training choice and is not applied); how many there were is reported.

Metrics, per source (`PromptRecord.source`) and overall (over all prompts of all sources together):

    correct(sample) = components["correct"] >= 1 when the reward reports a `correct` component,
                      else reward >= 1
    pass@1          = fraction of prompts whose first sample (sample 0) is correct; with greedy decoding
                      this is the greedy accuracy
    avg@k           = mean correctness over all k samples of all prompts (the expected accuracy of one
                      sampled answer; equals pass@1 when k = 1)
    pass@k          = fraction of prompts with at least one correct sample among their k (with exactly k
                      samples drawn, the unbiased pass@k estimate)
    reward_mean     = mean reward over all samples
    response_length_mean = mean tokens after the prompt (multi-turn: environment replies included)
    truncated_fraction   = fraction of samples that ended on a length cap or an abort, not a stop condition

`EvalReport` holds the metrics and every sample (prompt, completion, reward, correctness), writes
`eval.json` and `eval.md` (one markdown table: a row per source and the overall row) and prints the same
table.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from areal_jax import storage
from areal_jax.configuration import to_dict
from areal_jax.data.datasets import PromptRecord
from areal_jax.data.trajectory import Trajectory
from areal_jax.eval_config import EvalConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.sampling import SamplingParams
from areal_jax.rollout.workflow import RolloutWorkflow

OVERALL = "overall"


# -- per-sample results and metrics -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EvalSample:
    """One sample of one prompt, scored."""

    prompt_index: int  # position of the prompt in the evaluated records
    prompt_id: str
    source: str
    sample_index: int  # 0..k-1
    prompt: str
    completion: str
    reward: float
    components: dict[str, float]
    correct: bool
    response_length: int
    finish_reason: str
    truncated: bool


def is_correct(reward: float, components: Mapping[str, float]) -> bool:
    """components["correct"] >= 1 when the reward reports it, else reward >= 1."""
    if "correct" in components:
        return components["correct"] >= 1.0
    return reward >= 1.0


@dataclasses.dataclass(frozen=True)
class EvalMetrics:
    """The metrics of one source (or of all); see the module docstring."""

    prompts: int
    samples: int
    k: int
    pass_at_1: float
    avg_at_k: float
    pass_at_k: float
    reward_mean: float
    response_length_mean: float
    truncated_fraction: float

    def as_dict(self) -> dict[str, float | int]:
        return {
            "prompts": self.prompts,
            "samples": self.samples,
            "k": self.k,
            "pass@1": self.pass_at_1,
            "avg@k": self.avg_at_k,
            "pass@k": self.pass_at_k,
            "reward_mean": self.reward_mean,
            "response_length_mean": self.response_length_mean,
            "truncated_fraction": self.truncated_fraction,
        }


def summarize(samples: Sequence[EvalSample]) -> EvalMetrics:
    """The metrics of `samples` (every prompt with the same number k of samples)."""
    by_prompt: dict[int, list[EvalSample]] = collections.defaultdict(list)
    for sample in samples:
        by_prompt[sample.prompt_index].append(sample)
    groups = [sorted(group, key=lambda s: s.sample_index) for group in by_prompt.values()]
    sizes = {len(group) for group in groups}
    if len(sizes) != 1:
        raise ValueError(f"every prompt needs the same number of samples; got sizes {sorted(sizes)}")
    n = len(samples)
    return EvalMetrics(
        prompts=len(groups),
        samples=n,
        k=sizes.pop(),
        pass_at_1=sum(group[0].correct for group in groups) / len(groups),
        avg_at_k=sum(s.correct for s in samples) / n,
        pass_at_k=sum(any(s.correct for s in group) for group in groups) / len(groups),
        reward_mean=sum(s.reward for s in samples) / n,
        response_length_mean=sum(s.response_length for s in samples) / n,
        truncated_fraction=sum(s.truncated for s in samples) / n,
    )


@dataclasses.dataclass(frozen=True)
class EvalReport:
    """The result of one evaluation: metrics per source and overall, and every scored sample."""

    by_source: dict[str, EvalMetrics]  # in order of first appearance
    overall: EvalMetrics
    samples: list[EvalSample]
    sampling: SamplingParams
    seconds: float
    policy_version: int
    checkpoint: str = ""

    @classmethod
    def from_samples(
        cls, samples: Sequence[EvalSample], sampling: SamplingParams, seconds: float, policy_version: int
    ) -> EvalReport:
        sources: dict[str, list[EvalSample]] = {}
        for sample in samples:
            sources.setdefault(sample.source, []).append(sample)
        by_source = {source: summarize(group) for source, group in sources.items()}
        return cls(by_source, summarize(samples), list(samples), sampling, seconds, policy_version)

    def scalars(self, prefix: str = "eval") -> dict[str, float]:
        """Flat metrics for a metrics log: `<prefix>/pass@1`, ..., and `<prefix>/<source>/pass@1`, ..."""
        flat = {f"{prefix}/{key}": float(value) for key, value in self.overall.as_dict().items()}
        for source, metrics in self.by_source.items():
            flat.update({f"{prefix}/{source}/{key}": float(value) for key, value in metrics.as_dict().items()})
        return flat

    def as_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "policy_version": self.policy_version,
            "sampling": to_dict(self.sampling),
            "seconds": self.seconds,
            "overall": self.overall.as_dict(),
            "by_source": {source: metrics.as_dict() for source, metrics in self.by_source.items()},
            "samples": [dataclasses.asdict(sample) for sample in self.samples],
        }

    def _rows(self) -> list[tuple[str, EvalMetrics]]:
        return [*self.by_source.items(), (OVERALL, self.overall)]

    def _columns(self) -> tuple[str, ...]:
        """The table's columns; avg@k and pass@k only when k > 1 (with k = 1 both equal pass@1)."""
        k = self.overall.k
        per_k = (f"avg@{k}", f"pass@{k}") if k > 1 else ()
        return ("source", "prompts", "samples", "pass@1", *per_k, "reward", "length", "truncated")

    @staticmethod
    def _cells(source: str, m: EvalMetrics) -> tuple[str, ...]:
        per_k = (f"{m.avg_at_k:.3f}", f"{m.pass_at_k:.3f}") if m.k > 1 else ()
        return (
            source,
            str(m.prompts),
            str(m.samples),
            f"{m.pass_at_1:.3f}",
            *per_k,
            f"{m.reward_mean:.3f}",
            f"{m.response_length_mean:.1f}",
            f"{m.truncated_fraction:.3f}",
        )

    def title(self) -> str:
        s = self.sampling
        decoding = "greedy" if s.temperature == 0 else f"temperature {s.temperature}, top_k {s.top_k}, top_p {s.top_p}"
        where = f"{self.checkpoint}, " if self.checkpoint else ""
        return (
            f"evaluation of {where}policy version {self.policy_version}: k={self.overall.k}, {decoding}, "
            f"max_new_tokens {s.max_new_tokens}, {self.seconds:.1f} s"
        )

    def markdown(self) -> str:
        columns = self._columns()
        lines = [
            f"# {self.title()}",
            "",
            "| " + " | ".join(columns) + " |",
            "|---" + "|---:" * (len(columns) - 1) + "|",
        ]
        for source, metrics in self._rows():
            lines.append("| " + " | ".join(self._cells(source, metrics)) + " |")
        return "\n".join(lines) + "\n"

    def table(self) -> Table:
        table = Table(title=self.title(), box=box.SIMPLE_HEAD)
        for index, column in enumerate(self._columns()):
            table.add_column(column, justify="left" if index == 0 else "right", no_wrap=True)
        for source, metrics in self._rows():
            table.add_row(*self._cells(source, metrics), style="bold" if source == OVERALL else None)
        return table

    def print(self, console: Console | None = None) -> None:
        """The table on `console` (default: stdout); into a pipe or a file it is printed at full width."""
        console = console or Console()
        table = self.table()
        if not console.is_terminal:
            unbounded = console.options.update(max_width=1 << 16)
            console.width = max(console.width, Measurement.get(console, unbounded, table).maximum)
        console.print(table)

    def write(self, directory: str | Path) -> tuple[str, str]:
        """Write `eval.json` and `eval.md` into `directory` (local, created, or gs://); returns their paths."""
        json_path, md_path = storage.join(directory, "eval.json"), storage.join(directory, "eval.md")
        storage.write_atomic(json_path, json.dumps(self.as_json(), indent=1) + "\n")
        storage.write_atomic(md_path, self.markdown())
        return json_path, md_path


# -- running prompts through a generator -------------------------------------------------------------


def sampled_workflow(workflow: RolloutWorkflow, n_samples: int, sampling: SamplingParams) -> RolloutWorkflow:
    """A copy of `workflow` (same tokenizer, reward function, environment or agent, and executor) that draws
    `n_samples` per prompt with `sampling` and keeps the reward of truncated samples as it is."""
    return workflow.resampled(workflow.config.replace(n_samples=n_samples, sampling=sampling, truncation="keep"))


async def run_prompts(
    generator: Generator, workflow: RolloutWorkflow, records: Sequence[PromptRecord]
) -> list[list[Trajectory]]:
    """Every record through `workflow` at once (group id = its position); the groups in record order."""
    return list(await asyncio.gather(*(workflow.run(generator, r, index) for index, r in enumerate(records))))


def _sample(workflow: RolloutWorkflow, index: int, record: PromptRecord, t: Trajectory) -> EvalSample:
    completion = workflow.tokenizer.decode(t.token_ids[t.prompt_length :].tolist(), skip_special_tokens=True)
    return EvalSample(
        prompt_index=index,
        prompt_id=record.id,
        source=record.source,
        sample_index=t.sample_index,
        prompt=record.prompt,
        completion=completion,
        reward=t.reward,
        components=dict(t.reward_components),
        correct=is_correct(t.reward, t.reward_components),
        response_length=t.length - t.prompt_length,
        finish_reason=str(t.metadata["finish_reason"]),
        truncated=bool(t.metadata["truncated"]),
    )


async def evaluate_async(
    generator: Generator,
    workflow: RolloutWorkflow,
    records: Sequence[PromptRecord],
    config: EvalConfig,
    seed: int = 0,
) -> EvalReport:
    """Evaluate the generator's current policy on `records` (see the module docstring). The generator may
    be serving other requests at the same time; `workflow` supplies the chat template and the reward."""
    if not records:
        raise ValueError("no prompt to evaluate")
    started = time.perf_counter()
    version = generator.version
    sampled = sampled_workflow(workflow, config.samples_per_prompt, config.sampling(workflow.config.sampling, seed))
    groups = await run_prompts(generator, sampled, records)
    samples = [
        _sample(workflow, index, record, t)
        for index, (record, group) in enumerate(zip(records, groups, strict=True))
        for t in group
    ]
    return EvalReport.from_samples(samples, sampled.sampling, time.perf_counter() - started, version)


def evaluate(
    generator: Generator,
    workflow: RolloutWorkflow,
    records: Sequence[PromptRecord],
    config: EvalConfig,
    seed: int = 0,
) -> EvalReport:
    """`evaluate_async` from synchronous code (a thread without a running event loop)."""
    return asyncio.run(evaluate_async(generator, workflow, records, config, seed))

"""Evaluation of a policy on prompt datasets: `evaluate` (any live generator, also inside training) and
`areal-jax eval` (`run_eval`: an HF checkpoint directory or a run's newest training checkpoint).

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
import atexit
import collections
import dataclasses
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orbax.checkpoint as ocp
from flax import nnx
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from areal_jax import storage
from areal_jax.configuration import ConfigError, to_dict
from areal_jax.data.datasets import PromptRecord, load_prompts
from areal_jax.data.tasks import drop_long_prompts
from areal_jax.data.trajectory import Trajectory
from areal_jax.eval_config import EvalConfig
from areal_jax.inference.engine import Engine
from areal_jax.inference.generator import Generator
from areal_jax.inference.sampling import SamplingParams
from areal_jax.models.tokenizer import CHAR_SPEC
from areal_jax.rollout.rewards import Reward
from areal_jax.rollout.workflow import MultiTurnWorkflow, RLVRWorkflow, RolloutWorkflow
from areal_jax.run_layout import CHECKPOINTS_DIR, CONFIG_FILE, EVAL_DIR, HF_FINAL_DIR
from areal_jax.trainer.checkpoint import TrainCheckpointer
from areal_jax.weights.base import abstract_target, checkpoint_location

if TYPE_CHECKING:
    from areal_jax.config import ExperimentConfig

logger = logging.getLogger(__name__)

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
    """A copy of `workflow` (same tokenizer, reward function or environment, and executor) that draws
    `n_samples` per prompt with `sampling` and keeps the reward of truncated samples as it is."""
    config = workflow.config.replace(n_samples=n_samples, sampling=sampling, truncation="keep")
    if isinstance(workflow, RLVRWorkflow):
        return RLVRWorkflow(config, workflow.tokenizer, workflow.reward_fn, workflow.executor)
    if isinstance(workflow, MultiTurnWorkflow):
        return MultiTurnWorkflow(config, workflow.tokenizer, workflow.env, workflow.executor)
    raise TypeError(f"cannot re-sample a {type(workflow).__name__}; expected RLVRWorkflow or MultiTurnWorkflow")


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


# -- `areal-jax eval`: checkpoints, prompts, the whole job ------------------------------------------------


class CheckpointSourceError(ValueError):
    """`--checkpoint` names nothing that can be evaluated."""


@dataclasses.dataclass(frozen=True)
class CheckpointSource:
    """What `areal-jax eval --checkpoint PATH` evaluates: an HF directory (`hf_dir`) or training checkpoint
    `step` of the run `run_dir`; `run_dir` is also set for a run's `hf_final/` (its config is the default)."""

    path: str | Path  # what was asked for (a gs:// URL stays one)
    hf_dir: Path | None  # local: an HF checkpoint on gs:// is evaluated from a downloaded copy
    run_dir: str | Path | None
    step: int | None

    @property
    def config_file(self) -> str | None:
        """The run's `config.yaml`, when the checkpoint belongs to a run."""
        return storage.join(self.run_dir, CONFIG_FILE) if self.run_dir is not None else None

    @property
    def default_output(self) -> str:
        return storage.join(self.path, EVAL_DIR)

    def describe(self) -> str:
        if self.hf_dir is not None:
            return str(self.hf_dir)
        return f"{self.run_dir} (training checkpoint {self.step})"


def resolve_checkpoint(path: str | Path) -> CheckpointSource:
    """An HF checkpoint directory (config.json), or a run directory (config.yaml, written by `areal-jax
    train`): its newest training checkpoint (an `hf_final/` may predate a resumed run's later steps), else
    its `hf_final/`. Either may be on gs://."""
    if storage.is_remote(path):
        return _resolve_remote_checkpoint(str(path))
    path = Path(path)
    if not path.is_dir():
        raise CheckpointSourceError(f"checkpoint {str(path)!r} does not exist or is not a directory")
    if (path / "config.json").is_file():
        run_dir = path.parent if (path.parent / CONFIG_FILE).is_file() else None
        return CheckpointSource(path, path, run_dir, None)
    if not (path / CONFIG_FILE).is_file():
        raise CheckpointSourceError(
            f"{str(path)!r} is neither an HF checkpoint directory (no config.json) nor a run directory (no config.yaml)"
        )
    step = TrainCheckpointer.latest_in(path / CHECKPOINTS_DIR)
    if step is not None:
        return CheckpointSource(path, None, path, step)
    if (path / HF_FINAL_DIR / "config.json").is_file():
        return CheckpointSource(path, path / HF_FINAL_DIR, path, None)
    raise CheckpointSourceError(f"run directory {str(path)!r} has neither a training checkpoint nor hf_final/")


def _resolve_remote_checkpoint(location: str) -> CheckpointSource:
    """`resolve_checkpoint` of a gs:// location; an HF checkpoint is copied to a local directory (the HF
    loader reads local files) that lives as long as this process."""

    def local_copy(hf_location: str) -> Path:
        local = Path(tempfile.mkdtemp(prefix="areal-jax-eval-"))
        atexit.register(shutil.rmtree, local, True)
        storage.download_tree(hf_location, local)
        return local

    if storage.exists(storage.join(location, "config.json")):
        parent = storage.parent_of(location)
        run_dir = parent if storage.exists(storage.join(parent, CONFIG_FILE)) else None
        return CheckpointSource(location, local_copy(location), run_dir, None)
    if not storage.exists(storage.join(location, CONFIG_FILE)):
        raise CheckpointSourceError(
            f"{location!r} is neither an HF checkpoint directory (no config.json) nor a run directory (no config.yaml)"
        )
    step = TrainCheckpointer.latest_in(storage.join(location, CHECKPOINTS_DIR))
    if step is not None:
        return CheckpointSource(location, None, location, step)
    if storage.exists(storage.join(location, HF_FINAL_DIR, "config.json")):
        return CheckpointSource(location, local_copy(storage.join(location, HF_FINAL_DIR)), location, None)
    raise CheckpointSourceError(f"run directory {location!r} has neither a training checkpoint nor hf_final/")


def restore_trained_params(directory: str | Path, params: nnx.State, step: int) -> tuple[nnx.State, dict[str, Any]]:
    """The `params` of training checkpoint `step` in `directory` (a run's checkpoints/), placed like `params`,
    and the checkpoint's metadata; the optimizer state is not read."""
    target = {"params": abstract_target(params)}
    manager = ocp.CheckpointManager(
        checkpoint_location(directory),
        item_names=(TrainCheckpointer.STATE, TrainCheckpointer.METADATA),
        options=ocp.CheckpointManagerOptions(read_only=True),
    )
    try:
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    TrainCheckpointer.STATE: ocp.args.PyTreeRestore(
                        item=target,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                        partial_restore=True,
                    ),
                    TrainCheckpointer.METADATA: ocp.args.JsonRestore(),
                }
            ),
        )
    finally:
        manager.close()
    return restored[TrainCheckpointer.STATE]["params"], dict(restored[TrainCheckpointer.METADATA])


def eval_experiment(cfg: ExperimentConfig, source: CheckpointSource) -> ExperimentConfig:
    """`cfg` pointed at the checkpoint: an HF directory becomes `hf_checkpoint`. The tokenizer is the
    config's `tokenizer` when set, else the directory's own tokenizer.json (a run's `hf_final/` carries
    the run's), else the run's `hf_checkpoint`, else 'char'."""
    if source.hf_dir is None:
        return cfg
    tokenizer = cfg.tokenizer
    if tokenizer is None:
        own = source.hf_dir / "tokenizer.json"
        tokenizer = str(source.hf_dir) if own.is_file() else (cfg.hf_checkpoint or CHAR_SPEC)
    return cfg.replace(tokenizer=tokenizer, hf_checkpoint=str(source.hf_dir))


def eval_records(cfg: ExperimentConfig, workflow: RolloutWorkflow) -> list[PromptRecord]:
    """The prompts of `cfg.eval.files` (each cut to `max_prompts` after dropping prompts longer than
    `dataset.max_prompt_tokens`), or the held-out split of the run's `dataset`."""
    from areal_jax.system.assembly import build_prompts, check_reward_fields  # see run_eval

    limit = cfg.eval.max_prompts or None
    if not cfg.eval.files:
        try:
            _, heldout = build_prompts(cfg, workflow)
        except ConfigError:
            raise
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError("dataset", str(err)) from None
        if not heldout:
            raise ConfigError(
                "eval.files", "is empty and dataset.heldout is 0: nothing to evaluate; list datasets under eval.files"
            )
        return heldout[:limit]
    records: list[PromptRecord] = []
    for index, dataset in enumerate(cfg.eval.files):
        key = f"eval.files[{index}]"
        try:
            loaded = list(load_prompts(dataset))
            check_reward_fields(loaded, cfg.reward)
            fitting = drop_long_prompts(loaded, lambda r: len(workflow.render_prompt(r)), cfg.dataset.max_prompt_tokens)
        except ConfigError:
            raise
        except (FileNotFoundError, ValueError) as err:  # a missing file, a malformed row, nothing left
            raise ConfigError(key, str(err)) from None
        records.extend(fitting[:limit])
    return records


def check_eval_length(cfg: ExperimentConfig) -> None:
    """Refuse eval samples that cannot fit an engine slot: max prompt + max new tokens > max_length."""
    max_new = cfg.eval.max_new_tokens or cfg.rollout.workflow.sampling.max_new_tokens
    longest = cfg.dataset.max_prompt_tokens + max_new
    if longest > cfg.rollout.engine.max_length:
        raise ConfigError(
            "eval.max_new_tokens",
            f"value {max_new} + dataset.max_prompt_tokens={cfg.dataset.max_prompt_tokens} exceeds "
            f"rollout.engine.max_length={cfg.rollout.engine.max_length}; lower one or raise the last",
        )


def run_eval(cfg: ExperimentConfig, source: CheckpointSource, output_dir: str | Path) -> tuple[EvalReport, str, str]:
    """`areal-jax eval`: load the checkpoint onto the inference mesh, evaluate it on `cfg.eval`'s prompts
    with `cfg`'s workflow and reward, and write the report into `output_dir`."""
    # imported here, not at the top: assembly imports areal_jax.config, which imports this module for EvalConfig
    from areal_jax.system.assembly import build_meshes, build_tokenizer, build_workflow
    from areal_jax.system.starting_policy import load_policy

    cfg = eval_experiment(cfg, source)
    check_eval_length(cfg)
    tokenizer = build_tokenizer(cfg)
    mesh, _ = build_meshes(cfg)
    model = load_policy(cfg, mesh, tokenizer)
    version = 0
    if source.step is not None:
        checkpoints = storage.join(source.path, CHECKPOINTS_DIR)
        params, metadata = restore_trained_params(checkpoints, nnx.state(model), source.step)
        nnx.update(model, params)
        version = int(metadata.get("version", source.step))
    logger.info("evaluating %s (policy version %d) on mesh %s", source.describe(), version, dict(mesh.shape))
    with Reward(cfg.reward) as reward, build_workflow(cfg.rollout.workflow, tokenizer, reward) as workflow:
        records = eval_records(cfg, workflow)
        logger.info("%d prompts from %s", len(records), ", ".join(dict.fromkeys(r.source for r in records)))
        engine = Engine(model, cfg.rollout.engine, mesh)
        params = engine.load_params(nnx.state(model), version)
        with Generator(engine, params, detokenize=tokenizer.decode, seed=cfg.seed) as generator:
            report = evaluate(generator, workflow, records, cfg.eval, cfg.seed)
    report = dataclasses.replace(report, checkpoint=source.describe())
    json_path, md_path = report.write(output_dir)
    return report, json_path, md_path

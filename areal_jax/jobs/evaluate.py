"""`areal-jax eval`: a policy (an HF checkpoint directory or a run's newest training checkpoint) evaluated on
prompt datasets (`run_eval`). The running and scoring of prompts, and the metrics, are
`areal_jax.rollout.evaluation` (a run's rollout side evaluates the held-out split with the same function:
`system/heldout_evaluator.py`).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orbax.checkpoint as ocp
from flax import nnx

from areal_jax import storage
from areal_jax.configuration import ConfigError
from areal_jax.data.datasets import PromptRecord, load_prompts
from areal_jax.data.tasks import drop_long_prompts
from areal_jax.inference.engine import Engine
from areal_jax.inference.generator import Generator
from areal_jax.jobs.starting_policy import load_policy
from areal_jax.models.lora import split_trainable
from areal_jax.models.peft_io import ADAPTER_CONFIG, load_peft_adapter, read_adapter_config
from areal_jax.models.tokenizer import CHAR_SPEC
from areal_jax.rollout.evaluation import EvalReport, evaluate
from areal_jax.rollout.rewards import Reward
from areal_jax.rollout.workflow import RolloutWorkflow
from areal_jax.run_layout import CHECKPOINTS_DIR, CONFIG_FILE, EVAL_DIR, HF_FINAL_DIR
from areal_jax.seeds import stream_seed
from areal_jax.system.assembly import build_meshes, build_prompts, build_tokenizer, build_workflow, check_reward_fields
from areal_jax.trainer.checkpoint import TrainCheckpointer
from areal_jax.weights.base import abstract_target, checkpoint_location, list_live_steps

if TYPE_CHECKING:
    from areal_jax.config import ExperimentConfig

logger = logging.getLogger(__name__)

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
    # a PEFT LoRA adapter directory applied over `hf_dir` (`--adapter`, or a LoRA run's hf_final/)
    adapter: Path | None = None

    @property
    def config_file(self) -> str | None:
        """The run's `config.yaml`, when the checkpoint belongs to a run."""
        return storage.join(self.run_dir, CONFIG_FILE) if self.run_dir is not None else None

    @property
    def default_output(self) -> str:
        return storage.join(self.path, EVAL_DIR)

    def describe(self) -> str:
        if self.hf_dir is not None:
            return str(self.hf_dir) + (f" + LoRA adapter {self.adapter}" if self.adapter is not None else "")
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
    if (path / HF_FINAL_DIR / ADAPTER_CONFIG).is_file():  # a LoRA run's: the adapter over its base
        return with_adapter(CheckpointSource(path, None, path, None), path / HF_FINAL_DIR)
    raise CheckpointSourceError(f"run directory {str(path)!r} has neither a training checkpoint nor hf_final/")


def with_adapter(source: CheckpointSource, adapter: str | Path) -> CheckpointSource:
    """`source` with the PEFT adapter directory `adapter` applied over it; without an HF directory of its own, over
    the adapter's `base_model_name_or_path`."""
    adapter = Path(adapter)
    if not (adapter / ADAPTER_CONFIG).is_file():
        raise CheckpointSourceError(f"adapter {str(adapter)!r} is not a PEFT adapter directory: no {ADAPTER_CONFIG}")
    if source.step is not None:
        raise CheckpointSourceError(
            f"--adapter applies over an HF checkpoint, not over training checkpoint {source.step}"
        )
    hf_dir = source.hf_dir
    if hf_dir is None:
        base = read_adapter_config(adapter).get("base_model_name_or_path")
        if not base or not (Path(base) / "config.json").is_file():
            raise CheckpointSourceError(
                f"adapter {str(adapter)!r}: its base_model_name_or_path {base!r} is no HF directory"
            )
        hf_dir = Path(base)
    return dataclasses.replace(source, hf_dir=hf_dir, adapter=adapter)


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
    manager = list_live_steps(lambda: TrainCheckpointer.reader(checkpoint_location(directory)), directory)
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
    if not cfg.rollout.engine.fits_sample(cfg.dataset.max_prompt_tokens, max_new):
        raise ConfigError(
            "eval.max_new_tokens",
            f"value {max_new} + dataset.max_prompt_tokens={cfg.dataset.max_prompt_tokens} exceeds "
            f"rollout.engine.max_length={cfg.rollout.engine.max_length}; lower one or raise the last",
        )


def run_eval(cfg: ExperimentConfig, source: CheckpointSource, output_dir: str | Path) -> tuple[EvalReport, str, str]:
    """`areal-jax eval`: load the checkpoint onto the inference mesh, evaluate it on `cfg.eval`'s prompts
    with `cfg`'s workflow and reward, and write the report into `output_dir`."""
    cfg = eval_experiment(cfg, source)
    if cfg.rollout.workflow.kind == "external":
        raise ConfigError(
            "rollout.workflow.kind",
            "is external: its episodes come from outside agents, so `eval` has none to run; evaluate the policy "
            "with rollout.workflow.kind=single_turn (or your agent, with kind agent)",
        )
    check_eval_length(cfg)
    tokenizer = build_tokenizer(cfg)
    mesh, _ = build_meshes(cfg)
    model = load_policy(cfg, mesh, tokenizer)
    if source.adapter is not None:
        model = load_peft_adapter(source.adapter, model)
    version = 0
    if source.step is not None:
        checkpoints = storage.join(source.path, CHECKPOINTS_DIR)
        trained = split_trainable(model.config, nnx.state(model))[0]  # LoRA: the checkpoint holds the adapters
        params, metadata = restore_trained_params(checkpoints, trained, source.step)
        nnx.update(model, params)
        version = int(metadata.get("version", source.step))
    logger.info("evaluating %s (policy version %d) on mesh %s", source.describe(), version, dict(mesh.shape))
    with Reward(cfg.reward) as reward, build_workflow(cfg.rollout.workflow, tokenizer, reward) as workflow:
        records = eval_records(cfg, workflow)
        logger.info("%d prompts from %s", len(records), ", ".join(dict.fromkeys(r.source for r in records)))
        engine = Engine(model, cfg.rollout.engine, mesh)
        served = engine.load_params(nnx.state(model), version)
        seed = stream_seed(cfg.seed, "eval")
        with Generator(engine, served, detokenize=tokenizer.decode, seed=seed) as generator:
            report = evaluate(generator, workflow, records, cfg.eval, seed)
    report = dataclasses.replace(report, checkpoint=source.describe())
    json_path, md_path = report.write(output_dir)
    return report, json_path, md_path

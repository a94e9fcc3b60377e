"""The pieces of a run, each built from the experiment config by one small function: tokenizer, meshes,
policy (an HF checkpoint or a random init), reward, workflow, prompts. `run_async`, `areal-jax eval` and
`areal-jax demo` assemble themselves from these, so a rule such as the HF load options or the padded
vocabulary is written here once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from areal_jax.config import ExperimentConfig
from areal_jax.configuration import Config, ConfigError
from areal_jax.data.datasets import MalformedRowError, PromptRecord
from areal_jax.data.tasks import TaskStream, drop_long_prompts, load_task_records, split_heldout
from areal_jax.inference.slot_cache import PAGED_REFUSAL, pages_nothing
from areal_jax.models.config import ModelConfig, MoEConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_config import model_config_from_hf
from areal_jax.models.hf_io import save_hf_checkpoint
from areal_jax.models.hybrid import new_decoder
from areal_jax.models.init import create_decoder
from areal_jax.models.lora import adapter_free, merged_state
from areal_jax.models.peft_io import save_peft_adapter
from areal_jax.models.tokenizer import CHAR_SPEC, Tokenizer, load_tokenizer
from areal_jax.rollout.rewards import Reward, RewardConfig
from areal_jax.rollout.workflow import MultiTurnWorkflow, RLVRWorkflow, RolloutWorkflow, WorkflowConfig
from areal_jax.seeds import stream_seed
from areal_jax.sharding import make_mesh, split_devices

logger = logging.getLogger(__name__)


def tokenizer_spec(cfg: ExperimentConfig) -> str:
    """What `cfg.tokenizer` names: itself when set, else the HF checkpoint's directory, else 'char'."""
    if cfg.tokenizer is not None:
        return cfg.tokenizer
    return cfg.hf_checkpoint if cfg.hf_checkpoint is not None else CHAR_SPEC


def build_tokenizer(cfg: ExperimentConfig) -> Tokenizer:
    spec = tokenizer_spec(cfg)
    try:
        return load_tokenizer(spec)
    except (OSError, ValueError) as err:
        raise ConfigError("tokenizer", f"cannot load a tokenizer from {spec!r}: {err}") from None


def build_meshes(cfg: ExperimentConfig) -> tuple[Mesh, Mesh]:
    """(inference mesh, trainer mesh): devices split inference_share:trainer_share, each side taking the
    configured mesh shape with its -1 axis absorbing that side's devices."""
    inference, trainer = split_devices(jax.devices(), cfg.rollout.inference_share, cfg.rollout.trainer_share)
    return make_mesh(cfg.mesh, inference), make_mesh(cfg.mesh, trainer)


# The fields of `model` that are run-time choices, not architecture: they apply over an HF checkpoint.
RUN_TIME_FIELDS = ("param_dtype", "compute_dtype", "remat", "scan_layers", "logprob_chunk", "attention_impl", "lora")
# The same for `model.moe`: how the experts compute (`models/moe.py`) and the load-balancing loss's weight (HF
# checkpoints carry one but apply it only with output_router_logits); they apply over a checkpoint's mixture.
MOE_RUN_TIME_FIELDS = ("grouped_matmul", "dispatch", "router_aux_loss_coef")
# Fields derived per run (the tokenizer's vocabulary) or given by the checkpoint unless the user sets them.
_DERIVED_FIELDS = ("vocab_limit", "export_dtype")


def hf_load_options(model: ModelConfig) -> dict[str, Any]:
    """The run-time choices of `model` that an HF checkpoint does not carry; every HF load passes these."""
    options: dict[str, Any] = {name: getattr(model, name) for name in RUN_TIME_FIELDS}
    if model.export_dtype is not None:
        options["export_dtype"] = model.export_dtype
    if model.moe is not None:
        options["moe_options"] = {name: getattr(model.moe, name) for name in MOE_RUN_TIME_FIELDS}
    return options


def check_architecture_overrides(model: ModelConfig, checkpoint: ModelConfig, source: str) -> None:
    """Refuse a `model.*` architecture value the user set (it differs from the default) that the HF checkpoint at
    `source` contradicts: the checkpoint fixes the architecture, only `RUN_TIME_FIELDS` and, in `model.moe`,
    `MOE_RUN_TIME_FIELDS` apply over it. A section both have (`moe`, `hybrid`) is compared key by key, each
    against the section's default, so the refusal names the key (`model.moe.num_experts`)."""
    _check_overrides(model, checkpoint, RUN_TIME_FIELDS + _DERIVED_FIELDS, "model.", source)


def _check_overrides(wanted: Config, given: Config, skip: tuple[str, ...], prefix: str, source: str) -> None:
    unset = type(wanted)()
    for field in dataclasses.fields(wanted):
        name = field.name
        value, fixed = getattr(wanted, name), getattr(given, name)
        if name in skip or value == getattr(unset, name) or value == fixed:
            continue
        if isinstance(value, Config) and isinstance(fixed, type(value)):
            inner_skip = MOE_RUN_TIME_FIELDS if isinstance(value, MoEConfig) else ()
            _check_overrides(value, fixed, inner_skip, f"{prefix}{name}.", source)
            continue
        run_time = [f"model.{n}" for n in (*RUN_TIME_FIELDS, "export_dtype")]
        run_time += [f"model.moe.{n}" for n in MOE_RUN_TIME_FIELDS]
        raise ConfigError(
            f"{prefix}{name}",
            f"value {value!r} contradicts the HF checkpoint {source!r}, whose {prefix.removeprefix('model.')}{name} "
            f"is {fixed!r}: the checkpoint fixes the architecture; remove the override (run-time choices that apply "
            f"over a checkpoint: {', '.join(run_time)})",
        )


def checkpoint_config(cfg: ExperimentConfig, source: str, tokenizer: Tokenizer) -> ModelConfig:
    """The architecture of the HF checkpoint at `source` with the run's `model.*` run-time choices over it."""
    hf = _hf_config(source)
    limit = _vocab_limit(int(hf["vocab_size"]), tokenizer, "hf_checkpoint")
    try:
        config = model_config_from_hf(hf, vocab_limit=limit, **hf_load_options(cfg.model))
    except ConfigError as err:  # a run-time choice the checkpoint's architecture cannot take
        raise err.under("model") from None
    check_architecture_overrides(cfg.model, config, source)
    return config


def _vocab_limit(model_vocab: int, tokenizer: Tokenizer, key: str) -> int | None:
    """Ids at or above the tokenizer's size are padding rows of the embedding: masked in sampling and
    scoring. A tokenizer larger than the embedding cannot work."""
    if tokenizer.vocab_size > model_vocab:
        raise ConfigError(key, f"value {model_vocab} is below the tokenizer's vocabulary size {tokenizer.vocab_size}")
    return tokenizer.vocab_size if tokenizer.vocab_size < model_vocab else None


def policy_config(cfg: ExperimentConfig, tokenizer: Tokenizer) -> ModelConfig:
    """The starting policy's architecture (`cfg.model`, or the HF checkpoint's), its vocabulary limited to the
    tokenizer's, without reading any weights."""
    if cfg.hf_checkpoint is None:
        config = cfg.model.replace(vocab_limit=_vocab_limit(cfg.model.vocab_size, tokenizer, "model.vocab_size"))
    else:
        config = checkpoint_config(cfg, cfg.hf_checkpoint, tokenizer)
    if pages_nothing(config) and cfg.rollout.engine.paged:  # refused before anything loads
        raise ConfigError("rollout.engine.kv_cache", f"value 'paged' with this qwen3_5 policy: {PAGED_REFUSAL}")
    return config


def abstract_policy(cfg: ExperimentConfig, tokenizer: Tokenizer) -> Decoder:
    """The policy with abstract arrays: the shape of what a rollout server loads from the weight store."""
    config = policy_config(cfg, tokenizer)
    return nnx.eval_shape(lambda: new_decoder(config, nnx.Rngs(stream_seed(cfg.seed, "init"))))


def _hf_config(source: str) -> dict[str, Any]:
    config_file = Path(source) / "config.json"
    if not config_file.is_file():
        raise ConfigError("hf_checkpoint", f"{source!r} is not an HF checkpoint directory: no config.json")
    return json.loads(config_file.read_text())


def random_policy(cfg: ExperimentConfig, mesh: Mesh | None, tokenizer: Tokenizer) -> Decoder:
    """A random init of `cfg.model` (the run's `init` seed) on `mesh`, its padded vocabulary masked to the
    tokenizer's."""
    limit = _vocab_limit(cfg.model.vocab_size, tokenizer, "model.vocab_size")
    return create_decoder(cfg.model.replace(vocab_limit=limit), stream_seed(cfg.seed, "init"), mesh)


def export_policy(cfg: ExperimentConfig, model: Decoder, directory: str | Path, base: str | Path | None = None) -> Path:
    """`model` as an HF checkpoint in `directory`, with the run's tokenizer files when it has some.

    A LoRA model is written as a PEFT adapter directory instead (`peft_io`), whose `base_model_name_or_path` is
    `base` (the HF checkpoint the run started from: its own or its warm start), else the base itself written
    to `directory/base` (a random init); with `model.lora.export_merged` also as merged full weights in
    `directory/merged`."""
    spec = tokenizer_spec(cfg)
    tokenizer_dir = Path(spec) if spec != CHAR_SPEC else None
    lora = model.config.lora
    if lora is None:
        return save_hf_checkpoint(model.config, model, directory, tokenizer_dir=tokenizer_dir)
    directory = Path(directory)
    plain = model.config.replace(lora=None)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(plain, nnx.Rngs(0))))
    source = None if base is None else str(base)
    state = nnx.state(model)
    save_peft_adapter(model.config, state, directory, str(source or directory.absolute() / "base"))
    if source is None:
        save_hf_checkpoint(
            plain, nnx.merge(graphdef, adapter_free(state)), directory / "base", tokenizer_dir=tokenizer_dir
        )
    if lora.export_merged:
        merged = nnx.merge(graphdef, jax.jit(lambda s: merged_state(model.config, s))(state))
        save_hf_checkpoint(plain, merged, directory / "merged", tokenizer_dir=tokenizer_dir)
    return directory


def build_workflow(config: WorkflowConfig, tokenizer: Tokenizer, reward: Reward) -> RolloutWorkflow:
    if config.kind == "multi_turn":
        return MultiTurnWorkflow(config, tokenizer, reward.environment())
    if config.kind == "agent":
        from areal_jax.agents.workflow import AgentWorkflow  # the openai client, only for agent runs

        return AgentWorkflow(config, tokenizer, reward.fn)
    if config.kind == "external":
        from areal_jax.agents.external import ExternalWorkflow

        return ExternalWorkflow(config, tokenizer, reward.fn)
    return RLVRWorkflow(config, tokenizer, reward.fn)


def check_reward_fields(records: list[PromptRecord], reward: RewardConfig) -> None:
    """Refuse prompts that lack what the reward reads (math: an answer; code: tests), naming the first."""
    field = reward.needs
    missing = [r for r in records if field and getattr(r, field) is None]
    if missing:
        first = missing[0]
        raise ConfigError(
            "reward.kind",
            f"{reward.kind!r} reads each prompt's {field!r}, but {len(missing)} of {len(records)} prompts have none "
            f"(first: {first.id} from {first.source}); choose a dataset mapping that provides it",
        )


def build_prompts(cfg: ExperimentConfig, workflow: RolloutWorkflow) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(training prompts, held-out prompts): the configured records that the reward can score and whose
    rendered prompt fits `dataset.max_prompt_tokens`, split with the run's `heldout` seed."""
    data = cfg.dataset
    try:
        records = load_task_records(data, stream_seed(cfg.seed, "tasks"))
    except MalformedRowError:
        raise  # names its file and line already
    except ValueError as err:
        raise ConfigError("dataset.files", str(err)) from None
    check_reward_fields(records, cfg.reward)
    try:
        records = drop_long_prompts(records, lambda r: len(workflow.render_prompt(r)), data.max_prompt_tokens)
    except ValueError as err:
        raise ConfigError("dataset.max_prompt_tokens", str(err)) from None
    if not data.heldout:
        return records, []
    try:
        return split_heldout(records, data.heldout, stream_seed(cfg.seed, "heldout"))
    except ValueError as err:
        raise ConfigError("dataset.heldout", str(err)) from None


def build_task_stream(cfg: ExperimentConfig, train_prompts: list[PromptRecord]) -> TaskStream:
    """The training stream: group g is prompt g of the shuffled (the run's `shuffle` seed), repeated prompts."""
    return TaskStream(train_prompts, stream_seed(cfg.seed, "shuffle"), cfg.dataset.shuffle, cfg.dataset.epochs)

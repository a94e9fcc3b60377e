"""The policy's shapes for a plan or an ahead-of-time compile: no weights and no tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from areal_jax.config import ExperimentConfig
from areal_jax.configuration import ConfigError
from areal_jax.models.config import ModelConfig

# real config.json files of the checkpoints the recipes name, each in a directory of the checkpoint's name
SIZING = Path(__file__).resolve().parents[2] / "configs" / "sizing"


def config_json(cfg: ExperimentConfig) -> Path | None:
    """The file the shapes come from: the checkpoint's config.json or, when the checkpoint is not on this
    machine, the copy of its config.json in configs/sizing/<its directory's name>/ (a recipe is planned and
    compiled before its checkpoint is downloaded); None without `hf_checkpoint`."""
    if cfg.hf_checkpoint is None:
        return None
    config_file = Path(cfg.hf_checkpoint) / "config.json"
    kept = SIZING / Path(cfg.hf_checkpoint).name / "config.json"
    if not config_file.is_file() and not Path(cfg.hf_checkpoint).exists() and kept.is_file():
        return kept
    return config_file


def architecture(cfg: ExperimentConfig) -> ModelConfig:
    """`model`, or the HF checkpoint's config.json (`config_json`) with the run's `model.*` choices over it. The
    tokenizer's vocabulary limit (`assembly.policy_config`) masks logits and changes no shape, so it is left
    out."""
    config_file = config_json(cfg)
    if config_file is None:
        return cfg.model
    from areal_jax.models.hf_config import model_config_from_hf
    from areal_jax.system.assembly import check_architecture_overrides, hf_load_options

    if not config_file.is_file():
        raise ConfigError(
            "hf_checkpoint",
            f"{config_file} not found: only the checkpoint's config.json is read (put it there, or set "
            "hf_checkpoint=null and the model.* shapes)",
        )
    try:
        checkpoint = model_config_from_hf(json.loads(config_file.read_text()), **hf_load_options(cfg.model))
    except ConfigError as err:
        raise err.under("model") from None
    check_architecture_overrides(cfg.model, checkpoint, str(config_file.parent))  # as the run itself would
    return checkpoint


def on_platform(model: ModelConfig, platform: str) -> ModelConfig:
    """`model` with its `auto` choices made for devices of `platform`, not for this machine's backend (an
    ahead-of-time compile for TPU runs on a CPU host)."""
    return model.replace(compute_dtype=model.compute_dtype_on(platform), scan_layers=model.scans_layers(platform))

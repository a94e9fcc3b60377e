"""The policy a run starts from: an HF checkpoint, the run's supervised warm start (trained on first use), or a
random init. Above `assembly` and `sft`: the warm start is itself a job that assembles its prompts."""

from __future__ import annotations

from jax.sharding import Mesh

from areal_jax.config import ExperimentConfig
from areal_jax.jobs.sft import warm_start_checkpoint
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_io import load_hf_checkpoint
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.system.assembly import checkpoint_config, random_policy


def load_policy(
    cfg: ExperimentConfig, mesh: Mesh | None, tokenizer: Tokenizer, checkpoint: str | None = None
) -> Decoder:
    """The starting policy: the HF checkpoint `checkpoint` (default `cfg.hf_checkpoint`), else the run's
    supervised warm start when `warm_start.steps` > 0 (cached in the run directory, trained on first use;
    see `areal_jax.jobs.sft`), else a random init of `cfg.model` with `cfg.seed`; placed on `mesh`, its padded
    vocabulary masked to the tokenizer's."""
    source = checkpoint if checkpoint is not None else cfg.hf_checkpoint
    if source is None and cfg.warm_start.steps:
        source = str(warm_start_checkpoint(cfg, tokenizer))
    if source is None:
        return random_policy(cfg, mesh, tokenizer)
    config = checkpoint_config(cfg, source, tokenizer)
    _, model = load_hf_checkpoint(source, mesh=mesh, config=config)
    return model

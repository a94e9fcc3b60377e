"""`areal-jax demo`: a smoke test of a checkpoint, no training. Assembled like a run
(`areal_jax.system.assembly`): the policy (an HF checkpoint, or a random init round-tripped through an HF
checkpoint), the configured reward and workflow, and the first `generation.num_prompts` prompts of the
configured dataset. Generates `generation.samples_per_prompt` samples per prompt with the rollout engine
and generator, scores them, and checks the behaviour log-probs against the trainer's scoring path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from rich.console import Console
from rich.table import Table

from areal_jax.config import ExperimentConfig
from areal_jax.data.datasets import PromptRecord
from areal_jax.data.trajectory import Trajectory
from areal_jax.inference.engine import Engine
from areal_jax.inference.generator import Generator
from areal_jax.jobs.starting_policy import load_policy
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_io import save_hf_checkpoint
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.rollout.evaluation import is_correct, run_prompts, sampled_workflow
from areal_jax.rollout.rewards import Reward
from areal_jax.seeds import stream_seed
from areal_jax.sharding import make_mesh
from areal_jax.system.assembly import build_prompts, build_tokenizer, build_workflow

logger = logging.getLogger(__name__)


def _max_logprob_gap(model: Decoder, trajectories: list[Trajectory], temperature: float) -> float:
    """Largest |generation log-prob - scoring-path log-prob| over all sampled tokens."""
    width = max(t.length for t in trajectories)
    ids = np.zeros((len(trajectories), width), np.int32)
    for row, t in enumerate(trajectories):
        ids[row, : t.length] = t.token_ids
    lengths = np.array([t.length for t in trajectories])
    segments = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int32)
    positions = np.broadcast_to(np.arange(width), ids.shape)
    targets = np.roll(ids, -1, axis=1)
    scoring_temperature = temperature if temperature > 0 else 1.0
    logp_device, _ = model.token_logprobs(
        jnp.asarray(ids), jnp.asarray(targets), jnp.asarray(segments), jnp.asarray(positions), scoring_temperature
    )
    logp = np.asarray(logp_device)
    gap = 0.0
    for row, t in enumerate(trajectories):
        sampled = np.flatnonzero(t.versions >= 0)  # tokens the policy drew; the logit at p - 1 predicts p
        if sampled.size:
            gap = max(gap, float(np.abs(logp[row, sampled - 1] - t.behav_logprobs[sampled]).max()))
    return gap


def _policy(cfg: ExperimentConfig, mesh: Mesh, tokenizer: Tokenizer, run_dir: Path) -> tuple[Decoder, str]:
    """The configured HF checkpoint, or a random init saved as an HF checkpoint and loaded back."""
    if cfg.hf_checkpoint is not None:
        return load_policy(cfg, mesh, tokenizer), cfg.hf_checkpoint
    fresh = load_policy(cfg, mesh, tokenizer)
    hf_dir = save_hf_checkpoint(fresh.config, fresh, run_dir / "hf_init")
    source = f"random init (seed {cfg.seed}), saved to and reloaded from {hf_dir}"
    return load_policy(cfg, mesh, tokenizer, checkpoint=str(hf_dir)), source


def run_demo(cfg: ExperimentConfig) -> dict[str, Any]:
    """Run the demo described by `cfg` and return a summary; results go to `cfg.run_dir`."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    gen = cfg.generation
    tokenizer = build_tokenizer(cfg)
    mesh = make_mesh(cfg.mesh)
    model, source = _policy(cfg, mesh, tokenizer, run_dir)
    logger.info("model: %s, %s parameters, mesh %s", source, f"{model.config.num_params():,}", dict(mesh.shape))

    sampling = cfg.rollout.workflow.sampling.replace(
        temperature=gen.temperature, max_new_tokens=gen.max_new_tokens, seed=stream_seed(cfg.seed, "generator")
    )
    with Reward(cfg.reward) as reward, build_workflow(cfg.rollout.workflow, tokenizer, reward) as workflow:
        records = build_prompts(cfg, workflow)[0][: gen.num_prompts]
        engine = Engine(model, cfg.rollout.engine, mesh)
        with Generator(engine, engine.load_params(nnx.state(model), 0), detokenize=tokenizer.decode) as generator:
            started = time.perf_counter()
            demo_workflow = sampled_workflow(workflow, gen.samples_per_prompt, sampling)
            groups = asyncio.run(run_prompts(generator, demo_workflow, records))
            seconds = time.perf_counter() - started
    trajectories = [t for group in groups for t in group]
    texts = [tokenizer.decode(t.token_ids[t.prompt_length :].tolist(), skip_special_tokens=True) for t in trajectories]
    gap = _max_logprob_gap(model, trajectories, gen.temperature)

    per_prompt = gen.samples_per_prompt
    with (run_dir / "demo_completions.jsonl").open("w") as out:
        for index, (t, text) in enumerate(zip(trajectories, texts, strict=True)):
            out.write(json.dumps(_completion_record(records[index // per_prompt], t, text)) + "\n")
    _print_table(records, trajectories, texts, per_prompt)
    generated = sum(int(np.count_nonzero(t.versions >= 0)) for t in trajectories)
    return {
        "model_parameters": model.config.num_params(),
        "devices": len(mesh.devices.flat),
        "prompts": len(records),
        "samples": len(trajectories),
        "generated_tokens": generated,
        "generation_tokens_per_second_incl_compile": round(generated / seconds, 1),
        "mean_reward": float(np.mean([t.reward for t in trajectories])),
        "correct_rate": float(np.mean([is_correct(t.reward, t.reward_components) for t in trajectories])),
        "max_logprob_gap_generation_vs_scoring": gap,
        "params_state_bytes": int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))),
        "outputs": str(run_dir),
    }


def _completion_record(record: PromptRecord, t: Trajectory, text: str) -> dict[str, Any]:
    response = slice(t.prompt_length, None)
    return {
        "prompt_id": record.id,
        "source": record.source,
        "prompt": record.prompt,
        "answer": record.answer,
        "completion": text,
        "reward": t.reward,
        "components": t.reward_components,
        "finish_reason": t.metadata["finish_reason"],
        "output_ids": t.token_ids[response].tolist(),
        "logprobs": t.behav_logprobs[response].tolist(),
    }


def _print_table(
    records: list[PromptRecord], trajectories: list[Trajectory], texts: list[str], per_prompt: int
) -> None:
    table = Table(title=f"{', '.join(dict.fromkeys(r.source for r in records))}: sampled completions")
    for column in ("prompt", "answer", "completion", "reward"):
        table.add_column(column)
    for index, (t, text) in enumerate(zip(trajectories[:12], texts[:12], strict=False)):
        record = records[index // per_prompt]
        table.add_row(record.prompt, record.answer or "", repr(text), f"{t.reward:.2f}")
    Console(stderr=True).print(table)

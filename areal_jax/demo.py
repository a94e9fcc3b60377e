"""`areal-jax demo`: build (or load) a model, round-trip it through an HF checkpoint, generate on the
embedded arithmetic task with the rollout engine and generator, score the answers and check the
behaviour log-probs against the trainer's scoring path. A smoke test of a checkpoint, no training.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich.console import Console
from rich.table import Table

from areal_jax.config import ExperimentConfig
from areal_jax.configuration import ConfigError
from areal_jax.inference.engine import Engine
from areal_jax.inference.generator import GenerationResult, Generator
from areal_jax.inference.sampling import SamplingParams
from areal_jax.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
from areal_jax.models.init import create_decoder
from areal_jax.models.tokenizer import load_tokenizer
from areal_jax.rewards.synthetic import ArithmeticTaskConfig, arithmetic_reward, make_problems
from areal_jax.sharding import make_mesh

logger = logging.getLogger(__name__)


def _max_logprob_gap(model: Any, completions: list[GenerationResult], temperature: float) -> float:
    """Largest |generation log-prob - scoring-path log-prob| over all sampled tokens."""
    tokens = [list(c.prompt_ids) + list(c.output_ids) for c in completions]
    width = max(len(t) for t in tokens)
    ids = np.zeros((len(tokens), width), np.int32)
    for row, seq in enumerate(tokens):
        ids[row, : len(seq)] = seq
    segments = (np.arange(width)[None, :] < np.array([len(t) for t in tokens])[:, None]).astype(np.int32)
    positions = np.broadcast_to(np.arange(width), ids.shape)
    targets = np.roll(ids, -1, axis=1)
    scoring_temperature = temperature if temperature > 0 else 1.0
    logp, _ = model.token_logprobs(
        jnp.asarray(ids), jnp.asarray(targets), jnp.asarray(segments), jnp.asarray(positions), scoring_temperature
    )
    logp = np.asarray(logp)
    gap = 0.0
    for row, c in enumerate(completions):
        start = len(c.prompt_ids) - 1  # the logit at position p predicts token p + 1
        scored = logp[row, start : start + len(c.output_ids)]
        gap = max(gap, float(np.abs(scored - np.asarray(c.output_logprobs)).max()))
    return gap


def run_demo(cfg: ExperimentConfig) -> dict[str, Any]:
    """Run the demo described by `cfg` and return a summary; results go to `cfg.run_dir`."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(cfg.tokenizer)
    mesh = make_mesh(cfg.mesh)
    if cfg.hf_checkpoint is not None:
        model_cfg, model = load_hf_checkpoint(cfg.hf_checkpoint, mesh=mesh)
        source = cfg.hf_checkpoint
    else:
        if tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                "model.vocab_size",
                f"value {cfg.model.vocab_size} is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size})",
            )
        fresh = create_decoder(cfg.model, cfg.seed, mesh)
        hf_dir = save_hf_checkpoint(cfg.model, fresh, run_dir / "hf_init")
        model_cfg, model = load_hf_checkpoint(hf_dir, mesh=mesh, **_numeric_overrides(cfg))
        source = f"random init (seed {cfg.seed}), saved to and reloaded from {hf_dir}"
    logger.info("model: %s, %s parameters, mesh %s", source, f"{model_cfg.num_params():,}", dict(mesh.shape))

    gen = cfg.generation
    problems = make_problems(ArithmeticTaskConfig(), gen.num_prompts, cfg.seed)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p.question}], add_generation_prompt=True)
        for p in problems
    ]
    engine = Engine(model, cfg.rollout.engine, mesh)
    with Generator(engine, engine.load_params(nnx.state(model), 0), detokenize=tokenizer.decode) as generator:
        started = time.perf_counter()
        futures = [
            generator.submit(
                prompt,
                SamplingParams(
                    temperature=gen.temperature,
                    max_new_tokens=gen.max_new_tokens,
                    stop_token_ids=tuple(tokenizer.stop_token_ids),
                    seed=cfg.seed * len(prompts) + index,
                ),
                n=gen.samples_per_prompt,
            )
            for index, prompt in enumerate(prompts)
        ]
        completions = [result for future in futures for result in future.result()]
        seconds = time.perf_counter() - started
    answers = [p.answer for p in problems for _ in range(gen.samples_per_prompt)]
    texts = [tokenizer.decode(list(c.output_ids), skip_special_tokens=True) for c in completions]
    rewards = [arithmetic_reward(t, a) for t, a in zip(texts, answers, strict=True)]
    gap = _max_logprob_gap(model, completions, gen.temperature)

    with (run_dir / "demo_completions.jsonl").open("w") as out:
        for problem_index, (c, text, reward) in enumerate(zip(completions, texts, rewards, strict=True)):
            problem = problems[problem_index // gen.samples_per_prompt]
            record = {
                "question": problem.question,
                "answer": problem.answer,
                "completion": text,
                "reward": reward,
                "finish_reason": c.finish_reason,
                "output_ids": list(c.output_ids),
                "logprobs": list(c.output_logprobs),
            }
            out.write(json.dumps(record) + "\n")
    _print_table(problems, texts, rewards, gen.samples_per_prompt)
    generated = sum(len(c.output_ids) for c in completions)
    return {
        "model_parameters": model_cfg.num_params(),
        "devices": len(mesh.devices.flat),
        "samples": len(completions),
        "generated_tokens": generated,
        "generation_tokens_per_second_incl_compile": round(generated / seconds, 1),
        "mean_reward": float(np.mean(rewards)),
        "max_logprob_gap_generation_vs_scoring": gap,
        "params_state_bytes": int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))),
        "outputs": str(run_dir),
    }


def _numeric_overrides(cfg: ExperimentConfig) -> dict[str, Any]:
    """Our own ModelConfig fields that an HF config.json does not carry."""
    m = cfg.model
    return {
        "compute_dtype": m.compute_dtype,
        "remat": m.remat,
        "logprob_chunk": m.logprob_chunk,
        "attention_impl": m.attention_impl,
    }


def _print_table(problems: list[Any], texts: list[str], rewards: list[float], per_prompt: int) -> None:
    table = Table(title="arithmetic task: sampled completions")
    for column in ("question", "answer", "completion", "reward"):
        table.add_column(column)
    for index, (text, reward) in enumerate(zip(texts[:12], rewards[:12], strict=False)):
        problem = problems[index // per_prompt]
        table.add_row(problem.question, problem.answer, repr(text), f"{reward:.0f}")
    Console(stderr=True).print(table)

"""The supervised warm start (`warm_start` section, `areal-jax sft`): a short cross-entropy fit of a random
init to the task's answers (the worked chains of `chain_sums`) on the training prompts, before RL.

It is cached in the run directory as `<run_dir>/warm_start/` (an HF checkpoint in `hf/` and `summary.json`
with the settings it was trained with and its held-out scores). `load_policy` uses the cache when its
settings match the config (a resumed run, or `train` after `areal-jax sft`) and trains it otherwise; the
held-out prompts are never trained on.

The held-out scores are teacher-forced on the exact answer, so they need no generation: `greedy_exact`
(every answer token is the argmax given the correct prefix, which is exactly when greedy decoding
produces the answer) and `sampled_exact` (the probability of sampling the answer at temperature 1).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from areal_jax import storage
from areal_jax.configuration import ConfigError, to_dict
from areal_jax.data.datasets import PromptRecord
from areal_jax.models.decoder import Decoder
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.seeds import stream_seed
from areal_jax.sft_config import CHECKPOINT_DIR, SUMMARY_FILE, WARM_START_DIR, WarmStartConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Examples:
    """Prompt + answer rows, right-padded: tokens, targets (the next token), the answer mask, segment ids
    and positions, all [N, T]."""

    tokens: np.ndarray
    targets: np.ndarray
    mask: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray

    def rows(self, index: np.ndarray) -> tuple[np.ndarray, ...]:
        return tuple(a[index] for a in (self.tokens, self.targets, self.mask, self.segment_ids, self.positions))

    def __len__(self) -> int:
        return len(self.tokens)

    def answer_length_weights(self) -> np.ndarray:
        """Per-example draw probabilities that make each answer length (mask tokens) equally likely."""
        lengths = self.mask.sum(axis=1).astype(np.int64)
        counts = np.bincount(lengths)
        weights = 1.0 / counts[lengths]
        return weights / weights.sum()


def _answer(record: PromptRecord) -> str:
    assert record.answer is not None  # `run_warm_start` refuses records without one
    return record.answer


def encode_examples(
    records: list[PromptRecord], render_prompt: Any, tokenizer: Tokenizer, length: int | None = None
) -> Examples:
    """Each record's rendered prompt followed by its answer and the stop token; the mask covers the answer
    tokens and the stop token (what the policy must produce)."""
    stop = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.stop_token_ids[0]
    rows = []
    for record in records:
        prompt = list(render_prompt(record))
        rows.append((prompt, [*tokenizer.encode(_answer(record)), stop]))
    width = length or max(len(p) + len(a) for p, a in rows)
    n = len(rows)
    tokens = np.full((n, width), tokenizer.pad_id, np.int32)
    targets = np.zeros((n, width), np.int32)
    mask = np.zeros((n, width), np.float32)
    segment_ids = np.zeros((n, width), np.int32)
    for i, (prompt, answer) in enumerate(rows):
        ids = prompt + answer
        if len(ids) > width:
            raise ValueError(f"prompt and answer of {records[i].id} are {len(ids)} tokens, more than {width}")
        tokens[i, : len(ids)] = ids
        targets[i, : len(ids) - 1] = ids[1:]
        mask[i, len(prompt) - 1 : len(ids) - 1] = 1.0  # the positions whose next token is the answer's
        segment_ids[i, : len(ids)] = 1
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (n, width)).copy()
    return Examples(tokens, targets, mask, segment_ids, positions)


def _answer_logprobs(model: Decoder, tokens, targets, mask, segment_ids, positions) -> jax.Array:
    logp, _ = model.token_logprobs(tokens, targets, segment_ids, positions)
    return logp * mask


@nnx.jit
def _scores(model: Decoder, tokens, targets, mask, segment_ids, positions) -> tuple[jax.Array, jax.Array]:
    """(greedy exact, probability of the exact answer) per row."""
    logits = model.logits(tokens, segment_ids, positions)
    hit = (jnp.argmax(logits, axis=-1) == targets) | (mask == 0)
    logp = _answer_logprobs(model, tokens, targets, mask, segment_ids, positions)
    return hit.all(axis=-1), jnp.exp(logp.sum(axis=-1))


def heldout_scores(model: Decoder, examples: Examples) -> dict[str, float]:
    """`greedy_exact` and `sampled_exact` (see the module docstring), averaged over the examples."""
    if not len(examples):
        return {}
    greedy, sampled = _scores(model, *examples.rows(np.arange(len(examples))))
    return {"greedy_exact": float(np.mean(greedy)), "sampled_exact": float(np.mean(sampled))}


@nnx.jit
def _sft_step(model: Decoder, optimizer: nnx.Optimizer, tokens, targets, mask, segment_ids, positions) -> jax.Array:
    """One AdamW step on the mean cross-entropy of the answer tokens; returns the loss."""

    def loss_fn(model: Decoder) -> jax.Array:
        logp = _answer_logprobs(model, tokens, targets, mask, segment_ids, positions)
        return -logp.sum() / jnp.maximum(mask.sum(), 1.0)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def train_warm_start(model: Decoder, config: WarmStartConfig, examples: Examples, seed: int) -> list[float]:
    """`config.steps` AdamW steps of mean cross-entropy over the answer tokens, on batches drawn with `seed`;
    `model` is updated in place. Returns the loss of each step."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.lr, config.warmup_steps, max(config.steps, config.warmup_steps + 1), config.lr / 10
    )
    optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.0), wrt=nnx.Param)
    rng = np.random.default_rng(seed)
    weights = examples.answer_length_weights() if config.balance_answer_lengths else None
    losses = []
    for _ in range(config.steps):
        if weights is None:
            index = rng.integers(0, len(examples), config.batch_size)
        else:
            index = rng.choice(len(examples), size=config.batch_size, p=weights)
        losses.append(_sft_step(model, optimizer, *examples.rows(index)))
    return [float(loss) for loss in losses]


def settings(cfg: Any) -> dict[str, Any]:
    """What a warm start depends on: a cached one is reused only when these are the same."""
    full = to_dict(cfg)
    # The warm start fits the model without adapters (LoRA RL adapts it), so `model.lora` does not change it.
    model = {key: value for key, value in full["model"].items() if key != "lora"}
    return {
        "warm_start": full["warm_start"],
        "model": model,
        "seed": full["seed"],
        "tokenizer": full["tokenizer"],
        "dataset": full["dataset"],
        "system_prompt": full["rollout"]["workflow"]["system_prompt"],
    }


def cached_warm_start(cfg: Any) -> Path | None:
    """The HF checkpoint of the run's warm start when one with the config's settings is cached, else None.
    On a gs:// run the cache is on the bucket: its checkpoint is copied into the local copy first."""
    location = cfg.layout.warm_start
    try:
        summary = json.loads(storage.read_text(storage.join(location, SUMMARY_FILE)))
    except (OSError, ValueError):
        return None
    if summary.get("settings") != json.loads(json.dumps(settings(cfg))):
        logger.warning("the warm start in %s was trained with other settings; training it again", location)
        return None
    local = cfg.run_dir / WARM_START_DIR / CHECKPOINT_DIR
    if storage.is_remote(location):
        storage.download_tree(storage.join(location, CHECKPOINT_DIR), local)
    return local


def run_warm_start(cfg: Any, tokenizer: Tokenizer) -> dict[str, Any]:
    """Train the warm start of `cfg` from its random init on the training prompts and cache it (an HF
    checkpoint and summary.json in <run_dir>/warm_start); returns the summary (losses and held-out scores)."""
    from areal_jax.rollout.rewards import Reward
    from areal_jax.system.assembly import build_prompts, build_workflow, export_policy, random_policy

    warm = cfg.warm_start
    if cfg.hf_checkpoint is not None:
        raise ConfigError("warm_start.steps", "a warm start fits a random init; hf_checkpoint is set")
    started = time.perf_counter()
    with Reward(cfg.reward) as reward, build_workflow(cfg.rollout.workflow, tokenizer, reward) as workflow:
        train, heldout = build_prompts(cfg, workflow)
        missing = [r.id for r in train + heldout if not isinstance(r.answer, str)]
        if missing:
            raise ConfigError("warm_start.steps", f"the warm start fits answers, but {missing[0]} has none")
        length = max(len(workflow.render_prompt(r)) + len(tokenizer.encode(_answer(r))) + 1 for r in train + heldout)
        examples = encode_examples(train, workflow.render_prompt, tokenizer, length)
        scored = encode_examples(heldout[: warm.heldout_examples], workflow.render_prompt, tokenizer, length)
    model = random_policy(cfg.replace(model=cfg.model.replace(lora=None)), None, tokenizer)  # LoRA RL adapts it
    before = heldout_scores(model, scored)
    losses = train_warm_start(model, warm, examples, stream_seed(cfg.seed, "warm_start"))
    after = heldout_scores(model, scored)
    directory = cfg.run_dir / WARM_START_DIR
    export_policy(cfg, model, directory / CHECKPOINT_DIR)
    summary = {
        "settings": settings(cfg),
        "steps": warm.steps,
        "seconds": round(time.perf_counter() - started, 2),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "heldout_prompts": len(scored),
        "heldout_before": before,
        "heldout_after": after,
    }
    (directory / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    if storage.is_remote(cfg.run_location):  # the summary last: it marks the cached warm start complete
        location = cfg.layout.warm_start
        storage.upload_tree(directory / CHECKPOINT_DIR, storage.join(location, CHECKPOINT_DIR))
        storage.upload(directory / SUMMARY_FILE, storage.join(location, SUMMARY_FILE))
    logger.info(
        "warm start: %d steps in %.1f s, loss %.3f -> %.3f; held-out greedy exact %.3f -> %.3f, sampled exact "
        "%.3f -> %.3f (%d prompts)",
        warm.steps,
        summary["seconds"],
        summary["loss_first"] or 0.0,
        summary["loss_last"] or 0.0,
        before.get("greedy_exact", float("nan")),
        after.get("greedy_exact", float("nan")),
        before.get("sampled_exact", float("nan")),
        after.get("sampled_exact", float("nan")),
        len(scored),
    )
    return summary


def warm_start_checkpoint(cfg: Any, tokenizer: Tokenizer) -> Path:
    """The run's warm start as an HF checkpoint: the cached one, else a new one trained now."""
    cached = cached_warm_start(cfg)
    if cached is not None:
        logger.info("warm start: using the cached %s", cached)
        return cached
    run_warm_start(cfg, tokenizer)
    return cfg.run_dir / WARM_START_DIR / CHECKPOINT_DIR

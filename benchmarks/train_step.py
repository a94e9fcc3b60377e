"""The train step of issue 14's workload (benchmarks/e2e.py's model and batch: 64 samples of 76 tokens), two
comparisons measured side by side in one run:

1. `mlp_grad_by_hand_vs_autodiff`: the gated MLP's forward + backward with its gradient written by hand
   (`models.layers.gated_projection`) against JAX's autodiff of the same fused formula, at a micro-batch
   of 640 tokens (what the planner makes under e2e's 1k-token cap) and, in the full run, 5120.
2. `cache_sized_vs_one_microbatch`: the whole train step (Trainer.step) with micro-batches capped at 1024
   tokens (the planner makes 8 of [8, 80]) against one [64, 80] micro-batch of 5120 tokens (cap 8192),
   whose per-layer activations outgrow a CPU's last-level cache.

Prints `name: value unit` lines (best of the timed repeats, each side alternately); the headline last:
`ratio cache_sized_vs_one_microbatch: X.XX` (the one-micro-batch step's time over the capped one's).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from e2e import CONFIG, WORKLOAD
from flax import nnx

from areal_jax.config import load_experiment
from areal_jax.data.trajectory import Trajectory
from areal_jax.models.decoder import Decoder
from areal_jax.models.layers import gated_projection
from areal_jax.sharding import make_mesh
from areal_jax.trainer.trainer import Trainer

SAMPLES, LENGTH, PROMPT = 64, 76, 12


def best_of(repeats: int, fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - started)
    return best


def mlp_comparison(tokens: int, repeats: int) -> float:
    """Seconds of autodiff's fwd+bwd over the hand-written gradient's, for one [tokens, 256] input."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((tokens // 80, 80, 256)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((256, 2, 688)) * 0.05, jnp.float32)
    down = jnp.asarray(rng.standard_normal((688, 256)) * 0.05, jnp.float32)
    weights = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

    def autodiff_form(x: jax.Array, kernel: jax.Array) -> jax.Array:
        gate_up = jnp.einsum("btd,dcf->btcf", x, kernel)
        return jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]

    def grads(form: Callable[[jax.Array, jax.Array], jax.Array]) -> Callable[[], object]:
        loss = jax.jit(jax.grad(lambda x, k, d: jnp.sum((form(x, k) @ d) * weights), argnums=(0, 1, 2)))
        loss(x, kernel, down)  # compile
        return lambda: loss(x, kernel, down)

    sides = {"autodiff": grads(autodiff_form), "by_hand": grads(gated_projection)}
    seconds = {name: float("inf") for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            seconds[name] = min(seconds[name], best_of(10, fn))
    for name, value in seconds.items():
        print(f"mlp_{tokens}_tokens_{name}: {value * 1e3:.2f} ms")
    return seconds["autodiff"] / seconds["by_hand"]


def batch(seed: int, vocab: int) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    mask = np.arange(LENGTH) >= PROMPT
    return [
        Trajectory(
            token_ids=rng.integers(0, vocab, LENGTH).astype(np.int32),
            behav_logprobs=np.where(mask, -rng.random(LENGTH), 0.0).astype(np.float32),
            versions=np.where(mask, 0, -1).astype(np.int32),
            loss_mask=mask,
            prompt_length=PROMPT,
            reward=float(i % 2),
            prompt_id=f"p{i // 8}",
            group_id=i // 8,
            sample_index=i % 8,
        )
        for i in range(SAMPLES)
    ]


def train_step_comparison(repeats: int) -> float:
    """Seconds of a train step with one 5120-token micro-batch over one with 1k-token micro-batches."""
    trainers, microbatches, vocab = {}, {}, 0
    for name, budget in (("one_microbatch", 8192), ("cache_sized", 1024)):
        cfg = load_experiment(CONFIG, [*WORKLOAD, f"trainer.packing.token_budget={budget}"])
        vocab = cfg.model.vocab_size
        model = Decoder(cfg.model, nnx.Rngs(0))
        trainers[name] = Trainer(model, cfg.trainer, make_mesh(cfg.mesh), temperature=1.0)
        for seed in range(2):  # compile, then one warm step
            stats = trainers[name].step(batch(seed, vocab))
        microbatches[name] = int(stats["batch/microbatches"])
    seconds = {name: float("inf") for name in trainers}
    for repeat in range(repeats):
        for name, trainer in trainers.items():
            trajectories = batch(100 + repeat, vocab)
            started = time.perf_counter()
            trainer.step(trajectories)
            seconds[name] = min(seconds[name], time.perf_counter() - started)
    for name, value in seconds.items():
        print(f"train_step_{name}: {value:.3f} s ({microbatches[name]} micro-batches)")
    return seconds["one_microbatch"] / seconds["cache_sized"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, 640 tokens only (< 60 s on 2 cores)")
    args = parser.parse_args()
    logging.getLogger("areal_jax").setLevel(logging.WARNING)
    repeats = 5 if args.quick else 10
    print(f"backend: {jax.default_backend()}")
    ratio = mlp_comparison(640, repeats)
    print(f"ratio mlp_grad_by_hand_vs_autodiff: {ratio:.2f}")
    if not args.quick:
        print(f"mlp_grad_by_hand_vs_autodiff_5120_tokens: {mlp_comparison(5120, repeats):.2f} x")
    print(f"ratio cache_sized_vs_one_microbatch: {train_step_comparison(repeats):.2f}")


if __name__ == "__main__":
    main()

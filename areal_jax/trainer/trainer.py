"""The training loop: batches of trajectories in, PPO updates, versioned weights out to a publisher.

One step: pack the trajectories (shift, group advantages, `ppo_minibatches` mini-batches), run the
proximal log-prob pass on every mini-batch with the weights at the start of the step, then one optimizer
update per mini-batch, then bump the policy version and hand the new params to `publish(params, version)`.
The version counts published steps; a step whose updates were all skipped (non-finite loss or gradient)
still publishes its unchanged weights under a new version, so admission control on the rollout side
moves on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from areal_jax.data.trajectory import Trajectory
from areal_jax.models.decoder import Decoder
from areal_jax.objectives.stats import merge_stats
from areal_jax.trainer.batching import Planner, build_batch
from areal_jax.trainer.config import TrainerConfig
from areal_jax.trainer.train_step import TrainStep

logger = logging.getLogger(__name__)

Publisher = Callable[[nnx.State, int], None]


def merge_minibatch_stats(stats_P: Sequence[dict[str, np.ndarray]]) -> dict[str, float]:
    """Statistics of a step's P updates: token statistics merged as over one batch (`merge_stats`), losses,
    gradient norms and loss parts averaged over the updates, the lr of the last update, skips summed."""
    stacked = {key: np.stack([np.asarray(s[key]) for s in stats_P]) for key in stats_P[0]}
    token_keys = {key: value for key, value in stacked.items() if not key.startswith("train/")}
    if len(stats_P) == 1:
        merged = {key: float(value[0]) for key, value in token_keys.items()}
    else:
        merged = {key: float(value) for key, value in merge_stats(token_keys).items()}
    for key in merged:
        if key.endswith("_loss"):
            merged[key] /= len(stats_P)
    merged["train/loss"] = float(np.mean(stacked["train/loss"]))
    merged["train/grad_norm"] = float(np.mean(stacked["train/grad_norm"]))
    merged["train/lr"] = float(stacked["train/lr"][-1])
    merged["train/skipped_updates"] = float(np.sum(stacked["train/skipped"]))
    merged["train/loss_tokens"] = float(np.sum(stacked["train/loss_tokens"]))
    return merged


class Trainer:
    """Owns the trainer-side params and optimizer state of one decoder on one mesh and runs PPO steps.

    `publish(params, version)` is called after every step with the new params (an `nnx.State` on the
    trainer mesh). Those arrays are donated to the next update, so a publisher that keeps them beyond
    its call must copy them (e.g. `jax.device_put` onto its own shardings) before returning. `planner`
    replaces token-budget packing (e.g. the fixed-count baseline in the benchmark).
    """

    def __init__(
        self,
        model: Decoder,
        config: TrainerConfig,
        mesh: Mesh,
        publish: Publisher | None = None,
        *,
        version: int = 0,
        planner: Planner | None = None,
        temperature: float,
    ):
        graphdef, state = nnx.split(model)
        self.config = config
        self.train_step = TrainStep(graphdef, state, config, mesh, temperature=temperature)
        if planner is None and config.packing.rows % self.train_step.batch_shards:
            raise ValueError(
                f"packing.rows is {config.packing.rows}, not a multiple of the data*fsdp shards "
                f"({self.train_step.batch_shards}) of mesh {dict(mesh.shape)}"
            )
        self.params, self.opt_state = self.train_step.init(state)
        self.publish = publish
        self.planner = planner
        self.version = version
        self.skipped_updates = 0

    @property
    def graphdef(self) -> nnx.GraphDef:
        return self.train_step.graphdef

    def step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One training step on one batch of trajectories; returns its statistics (host floats)."""
        started = time.perf_counter()
        batch = build_batch(trajectories, self.config, self.planner)
        minibatches = [self.train_step.put_batch(mb) for mb in batch.minibatches]
        if self.config.ppo.decoupled:
            prox = [self.train_step.proximal_logprobs(self.params, mb) for mb in minibatches]
        else:
            prox = [None] * len(minibatches)
        stats_P = []
        for mb, logp_prox in zip(minibatches, prox, strict=True):
            self.params, self.opt_state, stats = self.train_step.update(
                self.params, self.opt_state, mb, logp_prox, self.version
            )
            stats_P.append(stats)
        stats = merge_minibatch_stats(jax.device_get(stats_P))
        elapsed = time.perf_counter() - started
        self.skipped_updates += int(stats["train/skipped_updates"])
        self.version += 1
        stats.update(batch.stats)
        stats.update(
            {
                "train/version": float(self.version),
                "train/skipped_updates_total": float(self.skipped_updates),
                "train/step_time": elapsed,
                "train/throughput": stats["train/loss_tokens"] / elapsed,
            }
        )
        if self.publish is not None:
            self.publish(self.params, self.version)
        logger.info(
            "step %d: loss %.4g grad_norm %.3g lr %.3g loss_tokens %d %.1f tok/s skipped %d",
            self.version,
            stats["train/loss"],
            stats["train/grad_norm"],
            stats["train/lr"],
            stats["train/loss_tokens"],
            stats["train/throughput"],
            stats["train/skipped_updates"],
        )
        return stats

    def run(self, batches: Iterable[Sequence[Trajectory]], num_steps: int | None = None) -> Iterator[dict[str, float]]:
        """Train on batches from any iterable (at most `num_steps`), yielding each step's statistics."""
        for index, trajectories in enumerate(batches):
            if num_steps is not None and index >= num_steps:
                return
            yield self.step(trajectories)

    def learning_rate(self) -> float:
        """The lr the next applied update will use."""
        return float(self.train_step.schedule(self.opt_state[-1].count))

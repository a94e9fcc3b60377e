"""The trainer's numerics: a batch of trajectories in, PPO updates, a new policy version out.

One step: pack the trajectories (shift, DAPO overlong shaping, group advantages, `ppo_minibatches`
mini-batches), run the proximal log-prob pass on every mini-batch with the weights at the start of the step
(unless `ppo.prox_logp_method` approximates it inside the update: rollout, loglinear; with auto, on every
mini-batch but the first, whose update runs at those weights and so computes log pi_prox itself, and on none
when every loss token was sampled by those weights and the behaviour log-probs are log pi_prox), the
reference pass with the frozen reference params when a KL coefficient is > 0, then one optimizer update per
mini-batch, then bump the policy version. The version counts steps; a step whose updates were all
skipped (non-finite loss or gradient) still makes a new version of its unchanged weights, so admission
control on the rollout side moves on once the trainer loop (`system/training_loop.py`) publishes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from areal_jax.configuration import ConfigError
from areal_jax.data.trajectory import Trajectory
from areal_jax.models.decoder import Decoder
from areal_jax.models.lora import split_trainable
from areal_jax.objectives.stats import merge_stats
from areal_jax.seeds import stream_seed
from areal_jax.trainer.batching import PackedBatch, Planner, build_batch
from areal_jax.trainer.config import TrainerConfig
from areal_jax.trainer.train_step import TrainStep

logger = logging.getLogger(__name__)


def merge_minibatch_stats(stats_P: Sequence[dict[str, np.ndarray]]) -> dict[str, float]:
    """Statistics of a step's P updates as host floats, merged by the key rule of `merge_stats`."""
    stacked = {key: np.stack([np.asarray(s[key]) for s in stats_P]) for key in stats_P[0]}
    return {key: float(value) for key, value in merge_stats(stacked, over="updates").items()}


def _check_reference(reference_params: nnx.State, params: nnx.State) -> None:
    """Refuse reference params that are not params of the same model (structure, shapes, dtypes)."""
    expected = jax.tree_util.tree_flatten_with_path(params)[0]
    got = jax.tree_util.tree_flatten_with_path(reference_params)[0]
    if jax.tree.structure(reference_params) != jax.tree.structure(params):  # type: ignore[operator]  # no PyTreeDef stubs
        paths = sorted({jax.tree_util.keystr(p) for p, _ in expected} ^ {jax.tree_util.keystr(p) for p, _ in got})
        raise ValueError(
            "reference_params do not have the structure of the model's params"
            + (f"; differing entries: {paths[:5]}" if paths else " (same entries, other metadata)")
        )
    for (path, want), (_, have) in zip(expected, got, strict=True):
        if (have.shape, have.dtype) != (want.shape, want.dtype):
            raise ValueError(
                f"reference_params{jax.tree_util.keystr(path)} has shape {have.shape} {have.dtype}; "
                f"expected {want.shape} {want.dtype} like the model's"
            )


def on_policy(minibatch: PackedBatch[np.ndarray], version: int) -> bool:
    """Whether every loss token of a host mini-batch was sampled by policy `version` (staleness 0)."""
    return bool(np.all(minibatch.versions[minibatch.loss_mask] == version))


def _check_overlong(config: TrainerConfig, max_new_tokens: int | None) -> None:
    buffer = config.advantage.overlong_buffer
    if buffer == 0:
        return
    if max_new_tokens is None:
        raise ConfigError(
            "advantage.overlong_buffer",
            f"is {buffer} but the Trainer was built without max_new_tokens; the run must pass "
            "rollout.workflow.sampling.max_new_tokens or set it to 0",
        )
    if buffer > max_new_tokens:
        raise ConfigError(
            "advantage.overlong_buffer",
            f"value {buffer} exceeds max_new_tokens={max_new_tokens}; allowed: 0 <= overlong_buffer <= max_new_tokens",
        )


class Trainer:
    """Owns the trainer-side params and optimizer state of one decoder on one mesh and runs PPO steps.

    `params` (an `nnx.State` on the trainer mesh) are donated to the next update, so whoever keeps them
    beyond a step (a weight publisher) must copy them (e.g. onto its own shardings) first. With `model.lora` they
    are the adapters alone (what a version publishes and a checkpoint saves); the base is `frozen`. `planner`
    replaces the bucketed packing (e.g. the fixed-count baseline in the benchmark).

    `reference_params` (an `nnx.State` of the same model, e.g. a copy of the initial params) is the frozen
    reference policy of the KL terms; it is required when `ppo.kl_coef` or `advantage.kl_reward_coef` is
    > 0, and otherwise not kept. A copy is placed on the trainer mesh with the params' shardings
    (`reference_params` attribute); it is never updated and is not in the optimizer.

    `max_new_tokens` is the sampler's cap on a response (rollout.workflow.sampling.max_new_tokens), required
    when `advantage.overlong_buffer` > 0 (DAPO's overlong shaping measures a response against it).

    `seed` is the run seed: with `model.lora.dropout` > 0 each update's dropout masks come from its `lora_dropout`
    stream at (policy version, mini-batch), so a resumed run draws the masks the uninterrupted one would.
    """

    def __init__(
        self,
        model: Decoder,
        config: TrainerConfig,
        mesh: Mesh,
        *,
        version: int = 0,
        planner: Planner | None = None,
        temperature: float,
        reference_params: nnx.State | None = None,
        max_new_tokens: int | None = None,
        seed: int = 0,
    ):
        _check_overlong(config, max_new_tokens)
        if reference_params is None and config.uses_reference:
            for key, coef in (
                ("ppo.kl_coef", config.ppo.kl_coef),
                ("advantage.kl_reward_coef", config.advantage.kl_reward_coef),
            ):
                if coef > 0:
                    raise ConfigError(
                        key,
                        f"is {coef} but the Trainer was built without reference_params; the run must pass the "
                        "reference policy's params (e.g. a copy of the initial checkpoint's) or set it to 0",
                    )
        graphdef, state = nnx.split(model)
        state, frozen = split_trainable(model.config, state)
        self.train_step = TrainStep(graphdef, state, config, mesh, temperature=temperature, frozen=frozen)
        del frozen  # the train step holds the placed copy
        shards = self.train_step.batch_shards
        if config.packing.token_budget == "auto":  # a run resolves it for its longest sample (packing_on) first
            config = config.replace(packing=config.packing.resolved(mesh.devices.flat[0].platform))
        if config.packing.min_rows is None:  # as few rows as a batch needs, split evenly over the shards
            config = config.replace(packing=config.packing.replace(min_rows=min(shards, config.packing.rows)))
        self.config = config
        for key in ("rows", "min_rows"):
            value = getattr(config.packing, key)
            if planner is None and value % shards:
                raise ValueError(
                    f"packing.{key} is {value}, not a multiple of the data*fsdp shards ({shards}) of mesh "
                    f"{dict(mesh.shape)}"
                )
        self.reference_params: nnx.State | None = None
        if reference_params is not None:
            reference_params = split_trainable(model.config, reference_params)[0]  # LoRA: the same frozen base
            _check_reference(reference_params, state)
            if self.train_step.uses_reference:
                self.reference_params = self.train_step.place(reference_params)
            else:
                logger.info("reference_params not kept: ppo.kl_coef and advantage.kl_reward_coef are 0")
        self.params, self.opt_state = self.train_step.init(state)
        self.planner = planner
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.version = version
        self.skipped_updates = 0
        self._shapes_seen: set[tuple[int, ...]] = set()

    @property
    def graphdef(self) -> nnx.GraphDef:
        return self.train_step.graphdef

    @property
    def frozen(self) -> nnx.State:
        """The parameters the trainer does not update: the base under LoRA adapters (empty without LoRA)."""
        return self.train_step.frozen

    def policy_state(self) -> nnx.State:
        """The whole policy's parameters: `params`, with the frozen base under LoRA (its arrays, not copies)."""
        return nnx.merge_state(self.frozen, self.params) if self.frozen else self.params

    def step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One training step on one batch of trajectories; returns its statistics (host floats)."""
        started = time.perf_counter()
        replay = self.train_step.program.scorer.routing_replay  # a mixture under trainer.moe.routing_replay: rollout
        batch = build_batch(trajectories, self.config, self.planner, self.max_new_tokens, replay)
        minibatches = [self.train_step.put_batch(mb) for mb in batch.minibatches]
        new_shapes = sorted({tuple(mb.tokens.shape) for mb in batch.minibatches} - self._shapes_seen)
        if new_shapes:
            logger.info("trainer: compiling the step for mini-batch shape %s [M, B, L] (once per shape)", new_shapes)
            self._shapes_seen.update(new_shapes)

        def logprobs(params: nnx.State | None, first: int = 0) -> list[jax.Array | None]:
            if params is None:
                return [None] * len(minibatches)
            return [None] * first + [self.train_step.logprobs(params, mb) for mb in minibatches[first:]]

        # auto: the first update runs at the step's starting weights, so its own log-probs are log pi_prox and
        # only later mini-batches need the pass, which an on-policy step skips but on the monitor's steps
        auto = self.config.ppo.decoupled and self.config.ppo.prox_logp_method == "auto"
        monitored = self.version % self.config.logprob_monitor_every == 0  # the mismatch monitor's steps
        skip_prox = (
            self.config.ppo.skips_prox_pass_on_policy
            and len(minibatches) > 1
            and not monitored
            and all(on_policy(mb, self.version) for mb in batch.minibatches)
        )
        prox = logprobs(self.params if self.train_step.needs_prox_pass and not skip_prox else None, first=int(auto))
        ref = logprobs(self.reference_params)
        stats_P: list[dict[str, jax.Array]] = []
        dropout = self.train_step.uses_dropout
        for k, (mb, logp_prox, logp_ref) in enumerate(zip(minibatches, prox, ref, strict=True)):
            self.params, self.opt_state, update_stats = self.train_step.update(
                self.params,
                self.opt_state,
                mb,
                logp_prox,
                self.version,
                logp_ref,
                prox_is_current=auto and k == 0,
                dropout_seed=stream_seed(self.seed, "lora_dropout", self.version, k) if dropout else None,
            )
            stats_P.append(update_stats)
        stats = merge_minibatch_stats(jax.device_get(stats_P))
        elapsed = time.perf_counter() - started
        if new_shapes:
            logger.info("trainer: the step of the new shape compiled and ran in %.1f s", elapsed)
        self.skipped_updates += int(stats["train/skipped_updates"])
        self.version += 1
        stats.update(batch.stats)
        if self.config.ppo.decoupled:
            # skipped: the behaviour log-probs stood in for the trainer's on some mini-batch (no monitor then)
            stats["prox/skipped"] = float(skip_prox or not self.train_step.needs_prox_pass)
            stats["prox/pass_minibatches"] = float(sum(p is not None for p in prox))
        stats.update(
            {
                "train/version": float(self.version),
                "train/skipped_updates_total": float(self.skipped_updates),
                "train/step_time": elapsed,
                "train/throughput": stats["train/loss_tokens"] / elapsed,
            }
        )
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

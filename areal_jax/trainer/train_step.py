"""The jitted, sharded train step: the log-prob passes (proximal, reference) and one PPO update per mini-batch.

Parameters and the optimizer state live on the trainer mesh, sharded by the logical rules (FSDP on `fsdp`,
tensor parallel on `tensor`; every Adam moment exactly like its parameter); batches `[M, B, L]` are split
on B over `data` + `fsdp`. An update's gradient is one `jax.jit` per batch shape: a `lax.scan` over the M
micro-batches accumulates the gradient of the decoupled PPO loss (normalised by the mini-batch's loss-token
count, so the sum over micro-batches is the mini-batch loss; with the KL-to-reference loss term and the KL
reward shaping when their coefficients are > 0); a second program applies the optimizer of `make_optimizer`
(`optimizer.py`). An update whose gradient is not finite (a non-finite loss gives one) is skipped with
`optax.apply_if_finite`'s semantics and state: params and AdamW state stay as they were (the schedule does not
advance), the optimizer state counts the skip, and the update reports `train/skipped_updates = 1`.

An update is two programs: the gradient (clipped, with its finiteness), then, only when it is finite, AdamW
with params and optimizer state donated. In one program the skip's select between the new and the
old AdamW state keeps a second gradient-sized buffer alive (`apply_if_finite` and `lax.cond` alike: XLA
cannot update the moments in place while the old ones may still be chosen): 1.84 GiB at Qwen2.5-0.5B.

LoRA dropout (`model.lora.dropout` > 0) runs in the update's forward alone: the update takes a seed (`Trainer`
derives it from the run seed, the step and the mini-batch: `seeds.py`'s `lora_dropout` stream) and folds in each
micro-batch's index; the log-prob passes, and log pi_prox of a step's first update, are forwards without it. At
dropout 0 no seed is passed, so the programs are those of a run without dropout.

The traced functions are module-level and take everything static as one hashable `_Program`, so two
`TrainStep`s of the same model, config and mesh share their compiled programs.

Legend: M micro-batches, B rows, L row length.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.activation_sharding import activations_on
from areal_jax.models.hybrid import new_decoder
from areal_jax.models.moe import RouterOutput
from areal_jax.objectives.config import KLEstimator, PPOConfig
from areal_jax.objectives.kl import kl_shaped_advantages
from areal_jax.objectives.ppo import ppo_loss
from areal_jax.objectives.prox import APPROXIMATIONS, approximate_prox_logp, prox_approximation_stats
from areal_jax.objectives.stats import count_loss_sequences, count_loss_tokens, merge_stats
from areal_jax.sharding import logical_to_spec, state_shardings
from areal_jax.trainer.batching import PackedBatch
from areal_jax.trainer.config import OptimizerConfig, TrainerConfig
from areal_jax.trainer.moe_terms import moe_terms
from areal_jax.trainer.optimizer import (
    learning_rate,
    learning_rate_schedule,
    make_optimizer,
    opt_state_shardings,
    optimizer_parts,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Scorer:
    """The static part of a forward pass (hashable, so equal scorers share compiled code). With `routing_replay`
    a mixture of experts routes each token to its recorded experts (`PackedBatch.routing`)."""

    graphdef: nnx.GraphDef
    temperature: float
    routing_replay: bool = False

    def token_logprobs(
        self, params: nnx.State, frozen: nnx.State, mb: PackedBatch[jax.Array], dropout_key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        logp_BxL, entropy_BxL, _ = self.token_logprobs_routed(params, frozen, mb, dropout_key)
        return logp_BxL, entropy_BxL

    def token_logprobs_routed(
        self, params: nnx.State, frozen: nnx.State, mb: PackedBatch[jax.Array], dropout_key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, RouterOutput | None]:
        """`token_logprobs` and the sparse layers' routers (None when dense)."""
        model = nnx.merge(self.graphdef, params, frozen)
        args = (mb.tokens, mb.targets, mb.segment_ids, mb.positions, self.temperature, dropout_key)
        if model.config.moe is None:
            return (*model.token_logprobs(*args), None)
        return model.token_logprobs_routed(*args, mb.routing if self.routing_replay else None)


@dataclasses.dataclass(frozen=True)
class _Program:
    """Everything static about the update (hashable, so equal programs share compiled code)."""

    scorer: _Scorer
    optimizer_config: OptimizerConfig
    ppo: PPOConfig
    kl_reward_coef: float
    kl_reward_estimator: KLEstimator
    params_def: Any  # the PyTreeDef of the parameter state
    param_sharding_leaves: tuple[NamedSharding, ...]
    # the update's params are the step's starting weights (its first mini-batch): log pi_prox is the update's
    # own log-probs under stop-gradient, exactly, with no proximal pass (prox_logp_method auto; under LoRA dropout
    # a second forward of the update, without dropout)
    prox_is_current: bool = False
    router_aux_loss_coef: float = 0.0  # model.moe's

    @property
    def param_shardings(self) -> Any:
        return jax.tree.unflatten(self.params_def, self.param_sharding_leaves)

    @property
    def mesh(self) -> Mesh:
        mesh = self.param_sharding_leaves[0].mesh
        assert isinstance(mesh, Mesh)  # the trainer's shardings are on its concrete mesh
        return mesh

    def optimizer(self) -> optax.GradientTransformation:
        return make_optimizer(self.optimizer_config, self._placeholders())

    def optimizer_parts(self) -> tuple[optax.GradientTransformation | None, optax.GradientTransformation]:
        return optimizer_parts(self.optimizer_config, self._placeholders())

    def _placeholders(self) -> Any:
        return jax.tree.unflatten(self.params_def, [0] * len(self.param_sharding_leaves))


def _logprobs_fn(
    scorer: _Scorer, mesh: Mesh, params: nnx.State, frozen: nnx.State, batch: PackedBatch[jax.Array]
) -> jax.Array:
    with activations_on(mesh):
        logp_MxBxL = jax.lax.map(lambda mb: scorer.token_logprobs(params, frozen, mb)[0], batch)
    return jax.lax.stop_gradient(logp_MxBxL)


def _microbatch_loss(
    program: _Program,
    params: nnx.State,
    frozen: nnx.State,
    mb: PackedBatch[jax.Array],
    logp_prox_BxL: jax.Array | None,
    logp_ref_BxL: jax.Array | None,
    num_loss_tokens: jax.Array,
    num_loss_sequences: jax.Array | None,
    version: jax.Array,
    dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    logp_BxL, entropy_BxL, router = program.scorer.token_logprobs_routed(params, frozen, mb, dropout_key)
    method, prox_stats = program.ppo.prox_logp_method, {}
    if program.ppo.decoupled and method == "auto" and program.prox_is_current:
        # the params are the step's starting weights; under dropout their log-probs are another forward, without it
        current_BxL = logp_BxL if dropout_key is None else program.scorer.token_logprobs(params, frozen, mb)[0]
        logp_prox_BxL = jax.lax.stop_gradient(current_BxL)
    elif program.ppo.decoupled and method == "auto" and logp_prox_BxL is None:
        # the trainer skipped the proximal pass: every loss token was sampled by the step's starting weights
        logp_prox_BxL = mb.logp_behav
    elif program.ppo.decoupled and method in APPROXIMATIONS:
        logp_prox_BxL = approximate_prox_logp(method, logp_BxL, mb.logp_behav, mb.versions, version)
    elif method == "metrics":
        assert logp_prox_BxL is not None  # metrics is decoupled (PPOConfig), so the update takes the pass's log-probs
        prox_stats = prox_approximation_stats(
            logp_prox_BxL, logp_BxL, mb.logp_behav, mb.versions, version, mb.loss_mask.astype(bool)
        )
    adv_BxL = mb.advantages
    kl_reward_stats: dict[str, jax.Array] = {}
    if program.kl_reward_coef > 0:
        # the penalised policy is the one the update starts from: the proximal (decoupled) or the behaviour one
        logp_old_BxL = logp_prox_BxL if program.ppo.decoupled else mb.logp_behav
        assert logp_old_BxL is not None and logp_ref_BxL is not None  # decoupled: set above; a KL reward: required
        adv_BxL, kl_reward_stats = kl_shaped_advantages(
            adv_BxL,
            logp_old_BxL,
            logp_ref_BxL,
            mb.segment_ids,
            mb.loss_mask,
            program.kl_reward_coef,
            program.kl_reward_estimator,
        )
    loss, stats = ppo_loss(
        logp_BxL,
        mb.logp_behav,
        adv_BxL,
        mb.loss_mask,
        num_loss_tokens,
        program.ppo,
        logp_prox_BxL=logp_prox_BxL,
        logp_ref_BxL=logp_ref_BxL,
        entropy_BxL=entropy_BxL,
        token_version_BxL=mb.versions,
        trainer_version=version,
        segment_ids_BxL=mb.segment_ids,
        num_loss_sequences_global=num_loss_sequences,
    )
    if router is not None:
        share = count_loss_tokens(mb.loss_mask) / jnp.maximum(num_loss_tokens, 1)
        aux_loss, moe_stats = moe_terms(
            router, mb.routing, mb.loss_mask, mb.segment_ids, share, program.router_aux_loss_coef
        )
        loss, stats = loss + aux_loss, stats | moe_stats
    return loss, stats | kl_reward_stats | prox_stats


def _gradients_fn(
    program: _Program,
    params: nnx.State,
    frozen: nnx.State,
    batch: PackedBatch[jax.Array],
    logp_prox_MxBxL: jax.Array | None,
    logp_ref_MxBxL: jax.Array | None,
    version: jax.Array,
    dropout_seed: jax.Array | None = None,
) -> tuple[jax.Array, nnx.State, dict[str, jax.Array]]:
    """Sum over micro-batches of loss and gradient (each normalised by the whole mini-batch's loss tokens, or
    with `loss_agg: seq_mean_token_mean` its sequences), with respect to `params` only (`frozen`, the base under
    LoRA adapters, gets none). With `dropout_seed`, LoRA dropout in each micro-batch's forward (its key: the
    seed's with the micro-batch's index folded in)."""
    num_loss_tokens = count_loss_tokens(batch.loss_mask)
    num_loss_sequences = None
    if program.ppo.loss_agg == "seq_mean_token_mean":
        num_loss_sequences = count_loss_sequences(batch.segment_ids, batch.loss_mask)
    grad_fn = jax.value_and_grad(partial(_microbatch_loss, program), has_aux=True)
    key = None if dropout_seed is None else jax.random.key(dropout_seed)
    if batch.tokens.shape[0] == 1:  # one micro-batch: its gradient is the sum, no accumulator beside it
        first = partial(jax.tree.map, lambda x: x[0])
        prox, ref = (None if x is None else x[0] for x in (logp_prox_MxBxL, logp_ref_MxBxL))
        mb_key = None if key is None else jax.random.fold_in(key, 0)
        (loss, stats), grads = grad_fn(
            params, frozen, first(batch), prox, ref, num_loss_tokens, num_loss_sequences, version, mb_key
        )
        grads = jax.lax.with_sharding_constraint(grads, program.param_shardings)
        return loss, grads, merge_stats(jax.tree.map(lambda x: x[None], stats))

    def body(
        grads: nnx.State, xs: tuple[PackedBatch[jax.Array], jax.Array | None, jax.Array | None, jax.Array | None]
    ) -> tuple[nnx.State, tuple[jax.Array, dict[str, jax.Array]]]:
        mb, logp_prox_BxL, logp_ref_BxL, index = xs
        mb_key = None
        if key is not None:
            assert index is not None  # the indices are scanned over whenever there is a key
            mb_key = jax.random.fold_in(key, index)
        (loss, stats), mb_grads = grad_fn(
            params, frozen, mb, logp_prox_BxL, logp_ref_BxL, num_loss_tokens, num_loss_sequences, version, mb_key
        )
        grads = jax.lax.with_sharding_constraint(jax.tree.map(jnp.add, grads, mb_grads), program.param_shardings)
        return grads, (loss, stats)

    zeros = jax.tree.map(jnp.zeros_like, params)
    indices_M = None if key is None else jnp.arange(batch.tokens.shape[0])
    grads, (loss_M, stats_M) = jax.lax.scan(body, zeros, (batch, logp_prox_MxBxL, logp_ref_MxBxL, indices_M))
    return jnp.sum(loss_M), grads, merge_stats(stats_M)


def _update_gradients_fn(
    program: _Program,
    params: nnx.State,
    frozen: nnx.State,
    batch: PackedBatch[jax.Array],
    logp_prox_MxBxL: jax.Array | None,
    logp_ref_MxBxL: jax.Array | None,
    version: jax.Array,
    dropout_seed: jax.Array | None = None,
) -> tuple[nnx.State, jax.Array, dict[str, jax.Array]]:
    """The update's first program: (clipped gradient, whether the gradient is finite, statistics)."""
    with activations_on(program.mesh):
        loss, grads, stats = _gradients_fn(
            program, params, frozen, batch, logp_prox_MxBxL, logp_ref_MxBxL, version, dropout_seed
        )
    finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))  # apply_if_finite's
    stats |= {
        "train/loss": loss,
        "train/grad_norm": optax.tree.norm(grads),
        "train/loss_tokens": count_loss_tokens(batch.loss_mask).astype(jnp.float32),
    }
    clip, _ = program.optimizer_parts()
    if clip is not None:
        grads, _ = clip.update(grads, clip.init(grads))
    return grads, finite, stats


def _apply_fn(
    program: _Program, params: nnx.State, opt_state: optax.ApplyIfFiniteState, grads: nnx.State
) -> tuple[nnx.State, optax.ApplyIfFiniteState, dict[str, jax.Array]]:
    """The update's second program, for a finite (clipped) gradient: AdamW, and the counters of
    `optax.apply_if_finite` as it sets them for a finite update."""
    _, adamw = program.optimizer_parts()
    updates, adamw_state = adamw.update(grads, opt_state.inner_state[-1], params)
    opt_state = opt_state._replace(
        notfinite_count=jnp.zeros_like(opt_state.notfinite_count),
        last_finite=jnp.array(True),
        inner_state=(*opt_state.inner_state[:-1], adamw_state),
    )
    return optax.apply_updates(params, updates), opt_state, _applied_stats(opt_state)


def _skip_fn(opt_state: optax.ApplyIfFiniteState) -> tuple[optax.ApplyIfFiniteState, dict[str, jax.Array]]:
    """A non-finite gradient's update: params and AdamW state unchanged, the skip counted as
    `optax.apply_if_finite` counts it."""
    opt_state = opt_state._replace(
        notfinite_count=optax.safe_increment(opt_state.notfinite_count),
        last_finite=jnp.array(False),
        total_notfinite=optax.safe_increment(opt_state.total_notfinite),
    )
    return opt_state, _applied_stats(opt_state)


def _applied_stats(opt_state: optax.ApplyIfFiniteState) -> dict[str, jax.Array]:
    return {
        "train/lr": learning_rate(opt_state),  # this update's, or on a skip the last applied one's
        "train/skipped_updates": jnp.logical_not(opt_state.last_finite).astype(jnp.float32),
    }


def _init_fn(program: _Program, params: nnx.State) -> optax.OptState:
    return program.optimizer().init(params)


def _copy_fn(params: nnx.State) -> nnx.State:
    return jax.tree.map(jnp.copy, params)


class TrainStep:
    """Sharded, jitted log-prob passes and PPO update of one decoder on one mesh.

    Log-probs are taken at `temperature`, which must be the sampler's (the run passes
    rollout.workflow.sampling.temperature, the one setting of it). Built from the decoder's graphdef and
    (abstract or concrete) parameter state; `init` places a copy of the parameters on the mesh and creates
    the optimizer state there, `place` places a copy of other params of the same model (the reference
    policy's). Each jitted function compiles once per batch shape (shared with every other `TrainStep` of
    the same model, settings and mesh).

    With LoRA (`model.lora`) `params` are the adapters alone and `frozen` the base (`lora.split_trainable`): the
    base is placed once (`frozen` attribute) and passed to every pass, with no gradient, optimizer state or
    update of its own.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        params: nnx.State,
        config: TrainerConfig,
        mesh: Mesh,
        *,
        temperature: float,
        frozen: nnx.State | None = None,
    ):
        frozen = nnx.State({}) if frozen is None else frozen
        given_config = nnx.merge(graphdef, params, frozen).config
        # every `auto` for the mesh's devices, which need not be JAX's default backend (a TPU topology compiled on CPU)
        model_config = given_config.for_platform(mesh.devices.flat[0].platform)
        if model_config.param_dtype != "float32":
            logger.warning(
                "model.param_dtype is %r: the trainer updates %s weights directly (no float32 master copy); an "
                "update below a weight's resolution in that dtype (~0.4%% of it for bfloat16) is lost",
                model_config.param_dtype,
                model_config.param_dtype,
            )
        if config.compute_dtype != "model":
            model_config = model_config.replace(compute_dtype=config.compute_dtype)
        if model_config != given_config:
            graphdef = nnx.graphdef(nnx.eval_shape(lambda: new_decoder(model_config, nnx.Rngs(0))))
        self.graphdef = graphdef
        self.model_config = model_config
        self.config = config
        self.mesh = mesh
        self.schedule = learning_rate_schedule(config.optimizer)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        self.param_shardings = state_shardings(abstract, mesh)
        frozen_shardings = state_shardings(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), frozen), mesh)
        self.frozen_shardings = frozen_shardings
        self.program = _Program(
            _Scorer(graphdef, temperature, config.moe.routing_replay == "rollout" and model_config.moe is not None),
            config.optimizer,
            config.ppo,
            config.advantage.kl_reward_coef,
            config.advantage.kl_estimator,
            jax.tree.structure(abstract),
            tuple(jax.tree.leaves(self.param_shardings)),
            router_aux_loss_coef=model_config.moe.router_aux_loss_coef if model_config.moe is not None else 0.0,
        )
        self.opt_shardings = opt_state_shardings(
            jax.eval_shape(partial(_init_fn, self.program), abstract), self.param_shardings, abstract, mesh
        )
        self.batch_sharding = NamedSharding(mesh, logical_to_spec((None, "batch", None), mesh=mesh))
        self.batch_shards = math.prod(mesh.shape[axis] for axis in ("data", "fsdp") if axis in mesh.shape)

        params_sh, opt_sh, batch_sh = self.param_shardings, self.opt_shardings, self.batch_sharding
        replicated = NamedSharding(mesh, PartitionSpec())
        self._copy = jax.jit(_copy_fn, in_shardings=(params_sh,), out_shardings=params_sh)
        # the frozen base (LoRA): placed on first use (nothing runs here: an ahead-of-time compile builds a step
        # for devices that exist only as a topology), an argument of every pass, never differentiated nor updated
        self._frozen_source: nnx.State | None = frozen
        self._frozen: nnx.State | None = None
        self._init = jax.jit(_init_fn, static_argnums=0, in_shardings=(params_sh,), out_shardings=opt_sh)
        self._logprobs = jax.jit(
            _logprobs_fn,
            static_argnums=(0, 1),
            in_shardings=(params_sh, frozen_shardings, batch_sh),
            out_shardings=batch_sh,
        )
        self._update_gradients = jax.jit(
            _update_gradients_fn,
            static_argnums=0,
            in_shardings=(params_sh, frozen_shardings, batch_sh, batch_sh, batch_sh, replicated, replicated),
            out_shardings=(params_sh, replicated, replicated),
        )
        self._apply = jax.jit(
            _apply_fn,
            static_argnums=0,
            in_shardings=(params_sh, opt_sh, params_sh),
            out_shardings=(params_sh, opt_sh, replicated),
            donate_argnums=(1, 2),  # params and state, updated in place (the gradient has no output to alias)
        )
        self._skip = jax.jit(_skip_fn, in_shardings=(opt_sh,), out_shardings=(opt_sh, replicated), donate_argnums=0)

    @property
    def frozen(self) -> nnx.State:
        """The frozen base on the trainer shardings (an empty state without LoRA), placed on first use."""
        if self._frozen is None:
            assert self._frozen_source is not None
            shardings = self.frozen_shardings
            self._frozen = jax.jit(_copy_fn, in_shardings=(shardings,), out_shardings=shardings)(
                jax.device_put(self._frozen_source, shardings)
            )
            self._frozen_source = None
        return self._frozen

    @property
    def uses_dropout(self) -> bool:
        """Whether updates run LoRA dropout (`model.lora.dropout` > 0) and so need a `dropout_seed`."""
        lora = self.model_config.lora
        return lora is not None and lora.dropout > 0

    @property
    def uses_reference(self) -> bool:
        """Whether updates need the reference policy's log-probs (`ppo.kl_coef` or
        `advantage.kl_reward_coef` > 0: `TrainerConfig.uses_reference`)."""
        return self.config.uses_reference

    def place(self, params: nnx.State) -> nnx.State:
        """A copy of `params` (of this step's model) on the trainer shardings; the caller's arrays stay valid."""
        # device_put alone may alias a replicated result's first shard to the source buffer (even with
        # may_alias=False), and donation would then delete the caller's array; the jitted copy cannot alias
        return self._copy(jax.device_put(params, self.param_shardings))

    def init(self, params: nnx.State) -> tuple[nnx.State, optax.OptState]:
        """A copy of `params` on the trainer shardings (`place`) and a fresh optimizer state sharded like it."""
        params = self.place(params)
        return params, self._init(self.program, params)

    def put_batch(self, batch: PackedBatch[np.ndarray]) -> PackedBatch[jax.Array]:
        """Move a host mini-batch onto the mesh, rows split over data + fsdp."""
        rows = batch.tokens.shape[1]
        if rows % self.batch_shards:
            raise ValueError(
                f"mini-batch has {rows} rows, not divisible by the data*fsdp shards ({self.batch_shards}) "
                f"of mesh {dict(self.mesh.shape)}; choose packing.rows as a multiple"
            )
        if self.batch_sharding.is_fully_addressable:
            return jax.device_put(batch, self.batch_sharding)
        # Several trainer processes, each holding the whole (identical) host batch: every process places
        # the rows of its own devices (`device_put` would first all-gather the batch to check it is equal).
        return jax.tree.map(
            lambda x: jax.make_array_from_callback(x.shape, self.batch_sharding, lambda index: x[index]), batch
        )

    def logprobs(self, params: nnx.State, batch: PackedBatch[jax.Array]) -> jax.Array:
        """log pi(target) [M, B, L] of every position under `params`, at the trainer's temperature: the
        proximal log-probs with the step's params, the reference log-probs with the reference params."""
        return self._logprobs(self.program.scorer, self.mesh, params, self.frozen, batch)

    def update(
        self,
        params: nnx.State,
        opt_state: optax.OptState,
        batch: PackedBatch[jax.Array],
        logp_prox: jax.Array | None,
        version: int,
        logp_ref: jax.Array | None = None,
        prox_is_current: bool = False,
        dropout_seed: int | None = None,
    ) -> tuple[nnx.State, optax.OptState, dict[str, jax.Array]]:
        """One optimizer update on one mini-batch; `params` and `opt_state` are donated (invalid afterwards).

        `logp_prox` is required when `needs_prox_pass` and ignored (pass None) otherwise, except with
        `prox_logp_method: auto`: there `prox_is_current` says `params` are the step's starting weights (its
        first update), whose own log-probs under stop-gradient are log pi_prox exactly, and else None means the
        step skipped the pass because every loss token is on-policy (the update then uses the behaviour
        log-probs); each case is its own program, compiled once. `logp_ref` (the reference policy's `logprobs`)
        is required when `uses_reference` and ignored otherwise; `version` is the trainer's policy version,
        against which token staleness is measured. `dropout_seed` (an int in [0, 2**31)) seeds this update's LoRA
        dropout masks; required when `uses_dropout` and ignored otherwise.
        """
        program = self.program
        if prox_is_current and self.config.ppo.prox_logp_method == "auto":
            program, logp_prox = dataclasses.replace(program, prox_is_current=True), None
        elif prox_is_current:
            raise ValueError("prox_is_current needs ppo.prox_logp_method auto")
        prox = None if program.prox_is_current else self._prox_arg(logp_prox)
        ref = self._ref_arg(logp_ref)
        seed = self._dropout_arg(dropout_seed)
        grads, finite, stats = self._update_gradients(
            program, params, self.frozen, batch, prox, ref, jnp.int32(version), seed
        )
        if bool(finite.addressable_data(0)):  # waits for the gradient: the next program depends on it
            params, opt_state, applied = self._apply(self.program, params, opt_state, grads)
        else:
            del grads
            opt_state, applied = self._skip(opt_state)
        return params, opt_state, stats | applied

    @property
    def needs_prox_pass(self) -> bool:
        """Whether updates may need the proximal log-probs (`logprobs(params, batch)` at the step's start):
        decoupled PPO with `ppo.prox_logp_method` auto (unless the step is on-policy), recompute or metrics;
        rollout and loglinear approximate them in the update."""
        return self.config.ppo.needs_prox_pass

    def _prox_arg(self, logp_prox: jax.Array | None) -> jax.Array | None:
        if not self.needs_prox_pass:
            return None
        if logp_prox is None and not self.config.ppo.skips_prox_pass_on_policy:
            raise ValueError(
                f"logp_prox is None but ppo.decoupled is true with prox_logp_method "
                f"{self.config.ppo.prox_logp_method!r}; pass logprobs(params, batch)"
            )
        return logp_prox

    def _dropout_arg(self, dropout_seed: int | None) -> jax.Array | None:
        if not self.uses_dropout:
            return None
        if dropout_seed is None:
            raise ValueError("dropout_seed is None but model.lora.dropout is > 0; pass the update's seed")
        return jnp.int32(dropout_seed)

    def _ref_arg(self, logp_ref: jax.Array | None) -> jax.Array | None:
        if not self.uses_reference:
            return None
        if logp_ref is None:
            raise ValueError(
                "logp_ref is None but a KL coefficient (ppo.kl_coef or advantage.kl_reward_coef) is > 0; "
                "pass logprobs(reference_params, batch)"
            )
        return logp_ref

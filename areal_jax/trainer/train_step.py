"""The jitted, sharded train step: the proximal log-prob pass and one PPO optimizer update per mini-batch.

Parameters and the AdamW state live on the trainer mesh, sharded by the logical rules (FSDP on `fsdp`,
tensor parallel on `tensor`; every Adam moment exactly like its parameter); batches `[M, B, L]` are split
on B over `data` + `fsdp`. An update is one `jax.jit` per batch shape: a `lax.scan` over the M micro-batches
accumulates the gradient of the decoupled PPO loss (normalised by the mini-batch's loss-token count, so the
sum over micro-batches is the mini-batch loss), then AdamW with global-norm clipping and the lr schedule is
applied; params and optimizer state are donated. A non-finite loss or gradient norm keeps the old params and
optimizer state (the schedule does not advance) and reports `train/skipped = 1`.

The traced functions are module-level and take everything static as one hashable `_Program`, so two
`TrainStep`s of the same model, config and mesh share their compiled programs.

Legend: M micro-batches, B rows, L row length.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.models.decoder import Decoder
from areal_jax.objectives.config import PPOConfig
from areal_jax.objectives.ppo import ppo_loss
from areal_jax.objectives.stats import merge_stats
from areal_jax.sharding import logical_to_spec, state_shardings
from areal_jax.trainer.batching import PackedBatch
from areal_jax.trainer.config import OptimizerConfig, TrainerConfig

_NO_DECAY = ("bias", "norm")


def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
    """lr of update `count` (0-based, applied updates only): linear warm-up, then constant or cosine."""

    def schedule(count: jax.Array) -> jax.Array:
        step = jnp.asarray(count, jnp.float32)
        factor = jnp.float32(1.0)
        if config.warmup_steps:
            factor = jnp.minimum((step + 1.0) / config.warmup_steps, 1.0)
        if config.schedule == "cosine":
            span = config.total_steps - config.warmup_steps
            progress = jnp.clip((step - config.warmup_steps) / span, 0.0, 1.0)
            cosine = 0.5 * (1.0 + jnp.cos(math.pi * progress))
            factor = factor * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)
        return config.lr * factor

    return schedule


def make_optimizer(config: OptimizerConfig, params: nnx.State) -> optax.GradientTransformation:
    """AdamW (decay on every weight except biases and norm scales) after global-norm clipping."""
    decay_mask = jax.tree_util.tree_map_with_path(
        lambda path, _: not any(word in jax.tree_util.keystr(path) for word in _NO_DECAY), params
    )
    parts = [] if config.grad_clip is None else [optax.clip_by_global_norm(config.grad_clip)]
    parts += [
        optax.scale_by_adam(b1=config.beta1, b2=config.beta2, eps=config.eps),
        optax.add_decayed_weights(config.weight_decay, mask=decay_mask),
        optax.scale_by_learning_rate(learning_rate_schedule(config)),
    ]
    return optax.chain(*parts)


def _opt_state_shardings(abstract_opt_state: Any, params_shardings: Any, abstract_params: Any, mesh: Mesh) -> Any:
    """Shardings of an optax state: every subtree shaped like the params gets the params' shardings, every
    other leaf (step counts) is replicated."""
    params_def = jax.tree.structure(abstract_params)
    replicated = NamedSharding(mesh, PartitionSpec())

    def like_params(node: Any) -> bool:
        return jax.tree.structure(node) == params_def

    def one(node: Any) -> Any:
        return params_shardings if like_params(node) else jax.tree.map(lambda _: replicated, node)

    return jax.tree.map(one, abstract_opt_state, is_leaf=like_params)


@dataclasses.dataclass(frozen=True)
class _Scorer:
    """The static part of a forward pass (hashable, so equal scorers share compiled code)."""

    graphdef: nnx.GraphDef
    temperature: float

    def token_logprobs(self, params: nnx.State, mb: PackedBatch) -> tuple[jax.Array, jax.Array]:
        model = nnx.merge(self.graphdef, params)
        return model.token_logprobs(mb.tokens, mb.targets, mb.segment_ids, mb.positions, self.temperature)


@dataclasses.dataclass(frozen=True)
class _Program:
    """Everything static about the update (hashable, so equal programs share compiled code)."""

    scorer: _Scorer
    optimizer_config: OptimizerConfig
    ppo: PPOConfig
    params_def: Any  # the PyTreeDef of the parameter state
    param_sharding_leaves: tuple[NamedSharding, ...]

    @property
    def param_shardings(self) -> Any:
        return jax.tree.unflatten(self.params_def, self.param_sharding_leaves)

    def optimizer(self) -> optax.GradientTransformation:
        placeholders = jax.tree.unflatten(self.params_def, [0] * len(self.param_sharding_leaves))
        return make_optimizer(self.optimizer_config, placeholders)


def _prox_fn(scorer: _Scorer, params: nnx.State, batch: PackedBatch) -> jax.Array:
    logp_MxBxL = jax.lax.map(lambda mb: scorer.token_logprobs(params, mb)[0], batch)
    return jax.lax.stop_gradient(logp_MxBxL)


def _microbatch_loss(
    program: _Program,
    params: nnx.State,
    mb: PackedBatch,
    logp_prox_BxL: jax.Array | None,
    num_loss_tokens: jax.Array,
    version: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    logp_BxL, entropy_BxL = program.scorer.token_logprobs(params, mb)
    return ppo_loss(
        logp_BxL,
        mb.logp_behav,
        mb.advantages,
        mb.loss_mask,
        num_loss_tokens,
        program.ppo,
        logp_prox_BxL=logp_prox_BxL,
        entropy_BxL=entropy_BxL,
        token_version_BxL=mb.versions,
        trainer_version=version,
    )


def _gradients_fn(
    program: _Program, params: nnx.State, batch: PackedBatch, logp_prox_MxBxL: jax.Array | None, version: jax.Array
) -> tuple[jax.Array, nnx.State, dict[str, jax.Array]]:
    """Sum over micro-batches of loss and gradient (each normalised by the whole mini-batch's loss tokens)."""
    num_loss_tokens = jnp.sum(batch.loss_mask)
    grad_fn = jax.value_and_grad(partial(_microbatch_loss, program), has_aux=True)

    def body(
        grads: nnx.State, xs: tuple[PackedBatch, jax.Array | None]
    ) -> tuple[nnx.State, tuple[jax.Array, dict[str, jax.Array]]]:
        mb, logp_prox_BxL = xs
        (loss, stats), mb_grads = grad_fn(params, mb, logp_prox_BxL, num_loss_tokens, version)
        grads = jax.lax.with_sharding_constraint(jax.tree.map(jnp.add, grads, mb_grads), program.param_shardings)
        return grads, (loss, stats)

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, (loss_M, stats_M) = jax.lax.scan(body, zeros, (batch, logp_prox_MxBxL))
    return jnp.sum(loss_M), grads, merge_stats(stats_M)


def _update_fn(
    program: _Program,
    params: nnx.State,
    opt_state: optax.OptState,
    batch: PackedBatch,
    logp_prox_MxBxL: jax.Array | None,
    version: jax.Array,
) -> tuple[nnx.State, optax.OptState, dict[str, jax.Array]]:
    loss, grads, stats = _gradients_fn(program, params, batch, logp_prox_MxBxL, version)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    lr = learning_rate_schedule(program.optimizer_config)(opt_state[-1].count)
    updates, new_opt_state = program.optimizer().update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)

    def keep_if_finite(new: jax.Array, old: jax.Array) -> jax.Array:
        return jnp.where(finite, new, old)

    stats.update(
        {
            "train/loss": loss,
            "train/grad_norm": grad_norm,
            "train/lr": lr,
            "train/skipped": jnp.logical_not(finite).astype(jnp.float32),
            "train/loss_tokens": jnp.sum(batch.loss_mask).astype(jnp.float32),
        }
    )
    return (
        jax.tree.map(keep_if_finite, new_params, params),
        jax.tree.map(keep_if_finite, new_opt_state, opt_state),
        stats,
    )


def _init_fn(program: _Program, params: nnx.State) -> optax.OptState:
    return program.optimizer().init(params)


def _copy_fn(params: nnx.State) -> nnx.State:
    return jax.tree.map(jnp.copy, params)


class TrainStep:
    """Sharded, jitted proximal pass and PPO update of one decoder on one mesh.

    Log-probs are taken at `temperature`, which must be the sampler's (the run passes
    rollout.workflow.sampling.temperature, the one setting of it). Built from the decoder's graphdef and
    (abstract or concrete) parameter state; `init` places a copy of
    the parameters on the mesh and creates the optimizer state there. Each jitted function compiles once
    per batch shape (shared with every other `TrainStep` of the same model, settings and mesh).
    """

    def __init__(
        self, graphdef: nnx.GraphDef, params: nnx.State, config: TrainerConfig, mesh: Mesh, *, temperature: float
    ):
        model_config = nnx.merge(graphdef, params).config
        if model_config.param_dtype != "float32":
            raise ValueError(
                f"model param_dtype is {model_config.param_dtype!r}; the trainer keeps float32 master params "
                "(use param_dtype='float32' with compute_dtype='bfloat16' for bf16 compute)"
            )
        if config.compute_dtype not in ("model", model_config.compute_dtype):
            model_config = model_config.replace(compute_dtype=config.compute_dtype)
            graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(model_config, nnx.Rngs(0))))
        self.graphdef = graphdef
        self.model_config = model_config
        self.config = config
        self.mesh = mesh
        self.schedule = learning_rate_schedule(config.optimizer)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        self.param_shardings = state_shardings(abstract, mesh)
        self.program = _Program(
            _Scorer(graphdef, temperature),
            config.optimizer,
            config.ppo,
            jax.tree.structure(abstract),
            tuple(jax.tree.leaves(self.param_shardings)),
        )
        self.opt_shardings = _opt_state_shardings(
            jax.eval_shape(partial(_init_fn, self.program), abstract), self.param_shardings, abstract, mesh
        )
        self.batch_sharding = NamedSharding(mesh, logical_to_spec((None, "batch", None), mesh=mesh))
        self.batch_shards = math.prod(mesh.shape[axis] for axis in ("data", "fsdp") if axis in mesh.shape)

        params_sh, opt_sh, batch_sh = self.param_shardings, self.opt_shardings, self.batch_sharding
        replicated = NamedSharding(mesh, PartitionSpec())
        self._copy = jax.jit(_copy_fn, in_shardings=(params_sh,), out_shardings=params_sh)
        self._init = jax.jit(_init_fn, static_argnums=0, in_shardings=(params_sh,), out_shardings=opt_sh)
        self._prox = jax.jit(_prox_fn, static_argnums=0, in_shardings=(params_sh, batch_sh), out_shardings=batch_sh)
        self._gradients = jax.jit(
            _gradients_fn,
            static_argnums=0,
            in_shardings=(params_sh, batch_sh, batch_sh, replicated),
            out_shardings=(replicated, params_sh, replicated),
        )
        self._update = jax.jit(
            _update_fn,
            static_argnums=0,
            in_shardings=(params_sh, opt_sh, batch_sh, batch_sh, replicated),
            out_shardings=(params_sh, opt_sh, replicated),
            donate_argnums=(1, 2),
        )

    def init(self, params: nnx.State) -> tuple[nnx.State, optax.OptState]:
        """A copy of `params` on the trainer shardings (the caller's arrays stay valid) and a fresh
        optimizer state sharded like it."""
        # device_put alone may alias a replicated result's first shard to the source buffer (even with
        # may_alias=False), and donation would then delete the caller's array; the jitted copy cannot alias
        params = self._copy(jax.device_put(params, self.param_shardings))
        return params, self._init(self.program, params)

    def put_batch(self, batch: PackedBatch) -> PackedBatch:
        """Move a host mini-batch onto the mesh, rows split over data + fsdp."""
        rows = batch.tokens.shape[1]
        if rows % self.batch_shards:
            raise ValueError(
                f"mini-batch has {rows} rows, not divisible by the data*fsdp shards ({self.batch_shards}) "
                f"of mesh {dict(self.mesh.shape)}; choose packing.rows as a multiple"
            )
        return jax.device_put(batch, self.batch_sharding)

    def proximal_logprobs(self, params: nnx.State, batch: PackedBatch) -> jax.Array:
        """log pi_prox(target) [M, B, L] of every position under `params`, at the trainer's temperature."""
        return self._prox(self.program.scorer, params, batch)

    def gradients(
        self, params: nnx.State, batch: PackedBatch, logp_prox: jax.Array | None, version: int
    ) -> tuple[jax.Array, nnx.State, dict[str, jax.Array]]:
        """(loss, gradient, statistics) of one mini-batch without updating: the update's own accumulation."""
        return self._gradients(self.program, params, batch, self._prox_arg(logp_prox), jnp.int32(version))

    def update(
        self,
        params: nnx.State,
        opt_state: optax.OptState,
        batch: PackedBatch,
        logp_prox: jax.Array | None,
        version: int,
    ) -> tuple[nnx.State, optax.OptState, dict[str, jax.Array]]:
        """One optimizer update on one mini-batch; `params` and `opt_state` are donated (invalid afterwards).

        `logp_prox` is required for decoupled PPO and ignored (pass None) otherwise; `version` is the
        trainer's policy version, against which token staleness is measured.
        """
        return self._update(self.program, params, opt_state, batch, self._prox_arg(logp_prox), jnp.int32(version))

    def _prox_arg(self, logp_prox: jax.Array | None) -> jax.Array | None:
        if not self.config.ppo.decoupled:
            return None
        if logp_prox is None:
            raise ValueError("logp_prox is None but ppo.decoupled is true; run proximal_logprobs first")
        return logp_prox

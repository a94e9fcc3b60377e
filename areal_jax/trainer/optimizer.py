"""The trainer's optimizer, built from `OptimizerConfig`: the lr schedule, weight decay by parameter kind,
global-norm clipping and AdamW, with non-finite updates skipped; the values read back from its state, and its
shardings (`opt_state_shardings`: every Adam moment exactly like its parameter).

`make_optimizer` is the whole optimizer (its state is the trainer's optimizer state); `optimizer_parts` gives
its clipping and AdamW apart, for the train step that applies them in two programs (`train_step.py`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.models.lora import LoRAParam
from areal_jax.trainer.config import OptimizerConfig

# apply_if_finite gives up and applies a non-finite update after this many in a row; the trainer never does
# (a run whose every update is skipped stops itself after trainer.max_skipped_steps steps)
_NEVER = int(jnp.iinfo(jnp.int32).max)


def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
    """lr of update `count` (0-based, applied updates only): lr * (count + 1) / warmup_steps while count <
    warmup_steps, then constant lr or a cosine from lr down to min_lr_ratio * lr at total_steps."""
    lr, warmup = config.lr, config.warmup_steps
    if config.schedule == "cosine":
        assert config.total_steps is not None  # OptimizerConfig requires it for the cosine schedule
        after = optax.cosine_decay_schedule(lr, decay_steps=config.total_steps - warmup, alpha=config.min_lr_ratio)
    else:
        after = optax.constant_schedule(lr)
    if warmup == 0:
        return after
    # from lr / warmup at update 0 to lr at update warmup - 1 (optax's warm-up schedules reach lr one update
    # later); a ramp of warmup - 1 = 0 steps holds lr / 1
    ramp = optax.linear_schedule(lr / warmup, lr, transition_steps=warmup - 1)
    return optax.join_schedules([ramp, after], boundaries=[warmup])


def decay_mask(params: nnx.State) -> nnx.State:
    """True for the parameters weight decay applies to: matmul kernels and embeddings, told by their logical
    axes (the variables' sharding metadata), and LoRA adapters (decay pulls them toward the base). Each kernel
    has the model-width axis `embed`; no bias ([heads, head_dim]) or norm scale ([norm] or [head_dim]) has it."""

    def decays(path: tuple[Any, ...], variable: Any) -> Any:
        names = variable.get_metadata().get("out_sharding") if isinstance(variable, nnx.Variable) else None
        if names is None:
            raise ValueError(
                f"parameter {jax.tree_util.keystr(path)} has no logical axis names (out_sharding metadata); "
                "the weight-decay mask is read from them"
            )
        return variable.replace(isinstance(variable, LoRAParam) or "embed" in names)

    return jax.tree_util.tree_map_with_path(decays, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def optimizer_parts(
    config: OptimizerConfig, params: nnx.State
) -> tuple[optax.GradientTransformation | None, optax.GradientTransformation]:
    """(global-norm clipping or None, AdamW) of `make_optimizer`."""
    adamw = optax.inject_hyperparams(optax.adamw)(
        learning_rate=learning_rate_schedule(config),
        b1=config.beta1,
        b2=config.beta2,
        eps=config.eps,
        weight_decay=config.weight_decay,
        mask=decay_mask(params),
    )
    return (None if config.grad_clip is None else optax.clip_by_global_norm(config.grad_clip)), adamw


def make_optimizer(config: OptimizerConfig, params: nnx.State) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with the lr schedule injected (the named value `learning_rate` of
    its state is the lr of the newest update) and weight decay on `decay_mask(params)`; an update whose
    gradient is not finite is skipped (`optax.apply_if_finite`, which here never gives up). Its state is the
    trainer's optimizer state; the train step applies its parts in two programs (`train_step.py`)."""
    clip, adamw = optimizer_parts(config, params)
    return optax.apply_if_finite(optax.chain(*([] if clip is None else [clip]), adamw), max_consecutive_errors=_NEVER)


def learning_rate(opt_state: optax.OptState) -> jax.Array:
    """The lr of the newest applied update held in a `make_optimizer` state (before any update: the first's)."""
    return optax.tree_utils.tree_get(opt_state, "hyperparams")["learning_rate"]


def applied_updates(opt_state: optax.OptState) -> jax.Array:
    """The number of updates a `make_optimizer` state has applied (skipped ones not counted): the schedule's count."""
    return optax.tree_utils.tree_get(opt_state, optax.InjectStatefulHyperparamsState.__name__).count


def opt_state_shardings(abstract_opt_state: Any, params_shardings: Any, abstract_params: Any, mesh: Mesh) -> Any:
    """Shardings of an optax state: every subtree shaped like the params gets the params' shardings, every
    other leaf (step counts, hyperparameters) is replicated."""
    params_def = jax.tree.structure(abstract_params)
    replicated = NamedSharding(mesh, PartitionSpec())

    def like_params(node: Any) -> bool:
        return jax.tree.structure(node) == params_def  # type: ignore[operator]  # jaxlib ships no PyTreeDef stubs

    def one(node: Any) -> Any:
        return params_shardings if like_params(node) else jax.tree.map(lambda _: replicated, node)

    return jax.tree.map(one, abstract_opt_state, is_leaf=like_params)

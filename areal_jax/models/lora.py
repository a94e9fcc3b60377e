"""LoRA adapters of the decoder's projections (`model.lora`): their NNX parameters, the split of a model's state into
adapters and frozen base, and the merge of adapters into base weights.

An adapter of projection W (input width I, output O) is a [I, r] and b [r, O] held in the projection's own layout
(q's output is [K, G, H] like the fused q/k/v kernel's query part, o's input [N, H] like its kernel), so that
delta W = a @ b * alpha / r is a reshape away from W's slice, and PEFT's lora_A [r, I] / lora_B [O, r] are a
transpose away from a and b (`peft_io.py`). Every parameter is a `LoRAParam`, which is how the trainer, the
weight paths and the engine tell adapters from base (`adapter_filter`).

Dropout (`lora.dropout`, PEFT's lora_dropout) zeroes entries of the adapter's input x (the rest scaled by 1 / (1 - p))
when a call is given a key: only the policy update's forward passes one (`train_step.py`), so every other pass is
the deterministic program it is without dropout.

Legend: D model width, N query heads, K key/value heads, G = N / K, H head dim, F MLP width, r rank, Y layers.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.lora_config import TARGETS


class LoRAParam(nnx.Param):
    """A trainable adapter parameter; every other `nnx.Param` of a LoRA model is frozen base."""


def target_layout(
    cfg: ModelConfig, target: str
) -> tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
    """(input shape, its logical axes, output shape, its logical axes) of projection `target` in our layout."""
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.resolved_head_dim
    k, g = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    embed = ((d,), ("embed",))
    layouts = {
        "q": (*embed, (k, g, h), ("kv_heads", "qkv", "head_dim")),
        "k": (*embed, (k, h), ("kv_heads", "head_dim")),
        "v": (*embed, (k, h), ("kv_heads", "head_dim")),
        "o": ((cfg.num_heads, h), ("heads", "head_dim"), *embed),
        "gate": (*embed, (f,), ("mlp",)),
        "up": (*embed, (f,), ("mlp",)),
        "down": ((f,), ("mlp",), *embed),
    }
    return layouts[target]


def dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
    """Inverted dropout: each entry of `x` zeroed with probability `rate`, the others divided by 1 - rate."""
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


class LoRA(nnx.Module):
    """The adapter of one projection: `__call__(x)` is x @ a @ b * alpha / r over x's trailing input axes; with a
    `dropout_key` (and `lora.dropout` > 0) x is first dropped out, with a mask of this target's own."""

    def __init__(self, cfg: ModelConfig, target: str, rngs: nnx.Rngs):
        lora = cfg.lora
        assert lora is not None
        in_shape, in_axes, out_shape, out_axes = target_layout(cfg, target)
        fan_in = math.prod(in_shape)
        if lora.init == "kaiming":  # torch's kaiming_uniform_(a=sqrt(5)) on lora_A [r, fan_in]: +-1/sqrt(fan_in)
            bound = 1.0 / math.sqrt(fan_in)
            a = jax.random.uniform(rngs.lora(), (*in_shape, lora.rank), jnp.float32, -bound, bound)
        else:
            a = jax.random.normal(rngs.lora(), (*in_shape, lora.rank), jnp.float32) / lora.rank
        self.a = LoRAParam(a.astype(cfg.param_jnp_dtype), out_sharding=(*in_axes, "lora_rank"))
        self.b = LoRAParam(
            jnp.zeros((lora.rank, *out_shape), cfg.param_jnp_dtype), out_sharding=("lora_rank", *out_axes)
        )
        self.scale = lora.scale
        self.dropout = lora.dropout
        self.stream = TARGETS.index(target)  # the key a layer's targets fold in: q, k and v get different masks
        self.compute_dtype = cfg.compute_jnp_dtype
        self.in_ndim = len(in_shape)

    def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        if dropout_key is not None and self.dropout > 0:
            x = dropout(x, self.dropout, jax.random.fold_in(dropout_key, self.stream))
        a, b = self.a[...].astype(self.compute_dtype), self.b[...].astype(self.compute_dtype)
        r = a.shape[-1]
        lead = x.shape[: x.ndim - self.in_ndim]
        x_MxI = x.reshape(-1, math.prod(x.shape[len(lead) :]))
        down_MxR = x_MxI @ a.reshape(-1, r)
        out = (down_MxR @ b.reshape(r, -1)) * jnp.asarray(self.scale, self.compute_dtype)
        return out.reshape(*lead, *b.shape[1:])


def adapter(cfg: ModelConfig, target: str, rngs: nnx.Rngs | None) -> LoRA | None:
    """The adapter of `target` when `cfg.lora` targets it, else None."""
    if cfg.lora is None or target not in cfg.lora.targets or rngs is None:
        return None
    return LoRA(cfg, target, rngs)


def lora_rngs(cfg: ModelConfig) -> nnx.Rngs | None:
    """The adapters' own stream (`lora.seed`), so the base's init draws the same numbers with or without them."""
    return None if cfg.lora is None else nnx.Rngs(lora=cfg.lora.seed)


# -- adapters and base in a state --------------------------------------------------------------------

adapter_filter = LoRAParam
base_filter = nnx.All(nnx.Param, nnx.Not(LoRAParam))


def trainable_filter(cfg: ModelConfig) -> Any:
    """What the trainer updates: the adapters with `lora`, else every parameter."""
    return adapter_filter if cfg.lora is not None else nnx.Param


def split_trainable(cfg: ModelConfig, state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(trainable, frozen) parts of a model's state (`trainable_filter`); frozen is empty without `lora`."""
    if cfg.lora is None:
        return state, nnx.State({})
    trainable, frozen = nnx.split_state(state, adapter_filter, ...)
    return trainable, frozen


def adapter_state(state: nnx.State) -> nnx.State:
    """The adapter parameters of a full state (or of a tree of the same structure, e.g. its shardings)."""
    return nnx.split_state(state, adapter_filter, ...)[0]


def adapter_free(state: nnx.State) -> nnx.State:
    """`state` without its adapter parameters."""
    return nnx.split_state(state, base_filter, ...)[0]


def layer_slices(adapters: nnx.State, num_layers: int) -> tuple[nnx.State, ...]:
    """Each layer's part of an adapter state's stacked `layers` entry, as `Decoder.layer_states` cuts the base."""
    return tuple(jax.tree.map(lambda stack, y=y: stack[y], adapters["layers"]) for y in range(num_layers))


def is_adapter_only(state: nnx.State) -> bool:
    """Whether every variable of `state` is an adapter (a LoRA weight version)."""
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return bool(leaves) and all(isinstance(v, LoRAParam) for v in leaves)


# Where each target's adapter sits in the layer state, and the base weight (and slice of it) its delta adds to.
ADAPTER_PATHS = {
    "q": (("qkv", "lora_q"), ("qkv", "kernel")),
    "k": (("qkv", "lora_k"), ("qkv", "kernel")),
    "v": (("qkv", "lora_v"), ("qkv", "kernel")),
    "o": (("lora_o",), ("o",)),
    "gate": (("mlp", "lora_gate"), ("mlp", "gate_up")),
    "up": (("mlp", "lora_up"), ("mlp", "gate_up")),
    "down": (("mlp", "lora_down"), ("mlp", "down")),
}


def _slot(cfg: ModelConfig, target: str) -> tuple[Any, ...]:
    """The index of a stacked [Y, ...] base weight that `target`'s delta covers."""
    g = cfg.num_heads // cfg.num_kv_heads
    every = slice(None)
    return {
        "q": (every, every, every, slice(0, g)),
        "k": (every, every, every, g),
        "v": (every, every, every, g + 1),
        "o": (),
        "gate": (every, every, 0),
        "up": (every, every, 1),
        "down": (),
    }[target]


def delta(cfg: ModelConfig, a_YxIxR: jax.Array, b_YxRxO: jax.Array) -> jax.Array:
    """alpha / r * a @ b per layer, [Y, *input, *output] in float32."""
    y, r = a_YxIxR.shape[0], a_YxIxR.shape[-1]
    a = a_YxIxR.astype(jnp.float32).reshape(y, -1, r)
    b = b_YxRxO.astype(jnp.float32).reshape(y, r, -1)
    assert cfg.lora is not None
    product = jnp.einsum("yir,yro->yio", a, b) * cfg.lora.scale
    return product.reshape(y, *a_YxIxR.shape[1:-1], *b_YxRxO.shape[2:])


def merged_state(cfg: ModelConfig, state: nnx.State) -> nnx.State:
    """The base part of a LoRA model's full state with every adapter merged in (W + a b alpha / r, in W's dtype):
    the parameters of the same decoder without `lora` (jittable)."""
    flat = dict(nnx.to_flat_state(adapter_free(state)))
    adapters = dict(nnx.to_flat_state(adapter_state(state)))
    assert cfg.lora is not None
    for target in cfg.lora.targets:
        where, weight = ADAPTER_PATHS[target]
        a = adapters[("layers", *where, "a")].get_value()
        b = adapters[("layers", *where, "b")].get_value()
        path = ("layers", *weight)
        base = flat[path].get_value()
        update = delta(cfg, a, b)
        index = _slot(cfg, target)
        merged = base.at[index].add(update.astype(base.dtype)) if index else base + update.astype(base.dtype)
        flat[path] = flat[path].replace(merged)
    return nnx.from_flat_state(flat)

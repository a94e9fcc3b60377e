"""Prefill and decode for a `HybridDecoder` (Qwen3.5): the state a slot carries beside the KV cache.

Each slot holds, per linear-attention layer, its recurrent state [L, E, V] (fp32) and its convolution window
[W-1, A*J]; the full-attention layers keep keys and values in a `KVCache` of their own (its layer index is the
full-attention stack's). `prefill` builds both from right-padded prompts (the delta rule chunk by chunk);
`decode_step` moves them on one token per slot. `HybridDecoder.prefill` / `decode_step` are these, so the
engine's dense path serves a hybrid model like any other (`inference/slot_cache.py`: what an insert, an abort
and a re-prefill after new weights do to each part); a `qwen3_5_moe` one through `prefill_routed` /
`decode_step_routed`, which also return each fed token's experts of every layer. The paged path
(`inference/paged_hybrid.py`) prefills through `prefill_entries` (the full layers' keys and values as they come,
for the page pool) and decodes through `decode_step_paged`: the full layers read and write pages as the
`Decoder`'s do (`paged_decode.PagedDecodeStep`), the states and windows stay per slot. Both decode steps are one
loop over the layers (`_decode_layers`) with the full layers' cache access passed in.

Legend as in `hybrid.py`; S cache length, Y layers of one kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models.attention import get_attention
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import KVCache, mask_padded_vocab
from areal_jax.models.moe import RouterOutput, routing_dtype
from areal_jax.models.page_pool import PagePool
from areal_jax.models.paged_decode import PagedDecodeStep
from areal_jax.models.rope import inverse_frequencies, rope_tables


class HybridModel(Protocol):
    """What these functions read of a `hybrid.HybridDecoder` (which imports this module for its serving methods)."""

    config: ModelConfig
    linear_layers: Any  # each kind's layer stack, None when the pattern has no layer of that kind
    full_layers: Any
    final_norm: Any

    def _embed(self, tokens_BxT: jax.Array) -> jax.Array: ...

    def head_kernel(self) -> jax.Array: ...


@flax.struct.dataclass
class HybridCache:
    """What decoding continues from: the full-attention layers' `KVCache` (None without such layers) and, per
    linear-attention layer, the recurrent state [B, L, E, V] and the convolution window [B, W-1, A*J].

    A slot's row is replaced whole by `put_rows` (an insert): a fresh prefill's state and window, and its keys
    and values up to the prefix length. So a slot freed by an abort needs nothing cleared, and a sample
    re-prefilled under new weights starts from a state made by them alone."""

    kv: KVCache | None
    state: tuple[jax.Array, ...]
    window: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, first_segment: int | None = None) -> HybridCache:
        """An empty cache of `batch` rows, the KV cache `length` long in segments from `first_segment`."""
        hy = cfg.hybrid
        assert hy is not None  # a qwen3_5 config
        full = hy.count("full_attention")
        kv = None
        if full:
            every = KVCache.zeros(cfg, batch, length, first_segment)  # one per layer; the full layers' kept
            kv = KVCache(k=every.k[:full], v=every.v[:full])
        return dataclasses.replace(cls.recurrent_zeros(cfg, batch), kv=kv)

    @classmethod
    def recurrent_zeros(cls, cfg: ModelConfig, batch: int) -> HybridCache:
        """The recurrent part alone (kv None) of an empty cache of `batch` rows: zero states and windows."""
        hy = cfg.hybrid
        assert hy is not None  # a qwen3_5 config
        lv, e, v = hy.linear_num_value_heads, hy.linear_key_head_dim, hy.linear_value_head_dim
        window = (batch, hy.conv_kernel - 1, hy.linear_num_key_heads * hy.group_width)
        linear = hy.count("linear_attention")
        return cls(
            kv=None,
            state=tuple(jnp.zeros((batch, lv, e, v), jnp.float32) for _ in range(linear)),
            window=tuple(jnp.zeros(window, cfg.compute_jnp_dtype) for _ in range(linear)),
        )

    @property
    def batch(self) -> int:
        return (self.state or self.window or self.kv.k[0])[0].shape[0]  # type: ignore[union-attr]

    @property
    def length(self) -> int:
        """The KV cache's length (0 without full-attention layers: nothing grows with the context)."""
        return 0 if self.kv is None else self.kv.length

    def put_rows(self, prefix: HybridCache, rows_B: jax.Array) -> HybridCache:
        """This cache with `prefix` row b as row rows_B[b]: its state and window, and its keys and values at
        positions [0, prefix.length); rows out of range are dropped."""

        def put(target: jax.Array, values: jax.Array) -> jax.Array:
            return target.at[rows_B].set(values.astype(target.dtype), mode="drop")

        assert (self.kv is None) == (prefix.kv is None)  # caches of one model
        return HybridCache(
            kv=None if self.kv is None or prefix.kv is None else self.kv.put_rows(prefix.kv, rows_B),
            state=tuple(map(put, self.state, prefix.state)),
            window=tuple(map(put, self.window, prefix.window)),
        )


def layer_states(model: HybridModel) -> tuple[nnx.State, ...]:
    """Each layer's weights as its own arrays (sliced out of its kind's stack), in `layer_types` order."""
    hy = model.config.hybrid
    assert hy is not None
    stacks = {"linear_attention": model.linear_layers, "full_attention": model.full_layers}
    seen = dict.fromkeys(stacks, 0)
    states = []
    for kind in hy.layer_types:
        _, stacked = nnx.split(stacks[kind])
        states.append(jax.tree.map(lambda w, i=seen[kind]: w[i], stacked))
        seen[kind] += 1
    return tuple(states)


def _layers(model: HybridModel, states: Sequence[nnx.State] | None) -> list[Any]:
    """Each layer as its own module, in `layer_types` order (from `states`, else sliced from the stacks)."""
    hy = model.config.hybrid
    assert hy is not None
    graphdefs = {
        kind: nnx.graphdef(stack)
        for kind, stack in (("linear_attention", model.linear_layers), ("full_attention", model.full_layers))
        if stack is not None
    }
    states = layer_states(model) if states is None else states
    return [nnx.merge(graphdefs[kind], state) for kind, state in zip(hy.layer_types, states, strict=True)]


def _rope(model: HybridModel, positions_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    cfg = model.config
    assert cfg.hybrid is not None
    rotary = int(cfg.resolved_head_dim * cfg.hybrid.partial_rotary_factor)
    return rope_tables(positions_BxT, inverse_frequencies(rotary, cfg.rope_theta, cfg.rope_scaling))


def _logits(model: HybridModel, x_BxD: jax.Array) -> jax.Array:
    logits_BxV = jnp.einsum(
        "bd,dv->bv", model.final_norm(x_BxD), model.head_kernel(), preferred_element_type=jnp.float32
    )
    return mask_padded_vocab(logits_BxV, model.config.usable_vocab)


def _experts(cfg: ModelConfig, routers: list[RouterOutput | None]) -> jax.Array | None:
    """Each position's experts of every layer (all sparse), [B, T, Y, K] in `routing_dtype`; None when dense."""
    if cfg.moe is None:
        return None
    return jnp.stack([router.experts for router in routers if router is not None], axis=2).astype(routing_dtype(cfg))


def prefill(
    model: HybridModel, tokens_BxT: jax.Array, lengths_B: jax.Array, first_segment: int | None = None
) -> tuple[jax.Array, HybridCache]:
    """Right-padded prompts: fp32 logits [B, V] at each last real token and the cache decoding continues from
    (a KV cache of length T cut into segments from `first_segment`; entries past a prompt are garbage, masked)."""
    return prefill_routed(model, tokens_BxT, lengths_B, first_segment)[:2]


def prefill_routed(
    model: HybridModel, tokens_BxT: jax.Array, lengths_B: jax.Array, first_segment: int | None = None
) -> tuple[jax.Array, HybridCache, jax.Array | None]:
    """`prefill` and each position's experts [B, T, Y, K] (`routing_dtype`; None when dense)."""
    logits_BxV, k, v, recurrent, experts = prefill_entries(model, tokens_BxT, lengths_B)
    kv = None if k is None or v is None else KVCache.from_entries(k, v, first_segment)
    return logits_BxV, dataclasses.replace(recurrent, kv=kv), experts


def prefill_entries(
    model: HybridModel, tokens_BxT: jax.Array, lengths_B: jax.Array
) -> tuple[jax.Array, jax.Array | None, jax.Array | None, HybridCache, jax.Array | None]:
    """`prefill_routed` with the full layers' keys and values as they come, [Y, B, T, K, H] each (None without
    full layers: what a paged cache is filled from), beside a `HybridCache` of the recurrent part alone (kv None)."""
    cfg = model.config
    assert cfg.hybrid is not None
    b, t = tokens_BxT.shape
    positions_BxT = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
    segment_ids_BxT = (positions_BxT < lengths_B[:, None]).astype(jnp.int32)
    sin, cos = _rope(model, positions_BxT)
    attend = get_attention(cfg.attention_impl)
    x_BxTxD = model._embed(tokens_BxT)
    states: list[jax.Array] = []
    windows: list[jax.Array] = []
    keys: list[jax.Array] = []
    values: list[jax.Array] = []
    routers: list[RouterOutput | None] = []
    for kind, layer in zip(cfg.hybrid.layer_types, _layers(model, None), strict=True):
        if kind == "linear_attention":
            mixed_BxTxD, state, window = layer.mixer.prefill(layer.input_norm(x_BxTxD), lengths_B)
            states.append(state)
            windows.append(window)
            x_BxTxD = x_BxTxD + mixed_BxTxD
        else:
            q, gate, k, v = layer.attn.inputs(layer.input_norm(x_BxTxD), sin, cos)
            keys.append(k)
            values.append(v)
            out = attend(q, k, v, segment_ids=segment_ids_BxT, positions=positions_BxT)
            x_BxTxD = x_BxTxD + layer.attn.output(out, gate)
        out_BxTxD, router = layer.feed_forward(x_BxTxD)
        x_BxTxD = x_BxTxD + out_BxTxD
        routers.append(router)
    last_BxD = jnp.take_along_axis(x_BxTxD, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    k_YxBxTxKxH, v_YxBxTxKxH = (jnp.stack(keys), jnp.stack(values)) if keys else (None, None)
    recurrent = HybridCache(kv=None, state=tuple(states), window=tuple(windows))
    return _logits(model, last_BxD), k_YxBxTxKxH, v_YxBxTxKxH, recurrent, _experts(cfg, routers)


# A full-attention layer's decode: (its index among the full layers, q [B, 1, N, H], k and v [B, 1, K, H]) -> the
# attention output [B, 1, N, H], the layer's cache written by the callee (dense segments or pages).
FullAttention = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


def _decode_layers(
    model: HybridModel,
    tokens_B: jax.Array,
    positions_B: jax.Array,
    recurrent: HybridCache,
    layer_states: Sequence[nnx.State] | None,
    full_attention: FullAttention,
) -> tuple[jax.Array, HybridCache, jax.Array | None]:
    """One token per slot through every layer: the linear ones move the slot's state and window on, the full ones
    go through `full_attention`. Returns fp32 logits [B, V], the recurrent part (kv None) and each fed token's
    experts [B, Y, K] (None when dense)."""
    cfg = model.config
    assert cfg.hybrid is not None
    sin, cos = _rope(model, positions_B[:, None])
    x_Bx1xD = model._embed(tokens_B[:, None])
    states: list[jax.Array] = []
    windows: list[jax.Array] = []
    full = 0
    routers: list[RouterOutput | None] = []
    for kind, layer in zip(cfg.hybrid.layer_types, _layers(model, layer_states), strict=True):
        if kind == "linear_attention":
            y = len(states)
            mixed, state, window = layer.mixer.decode(
                layer.input_norm(x_Bx1xD), recurrent.state[y], recurrent.window[y]
            )
            states.append(state)
            windows.append(window)
            x_Bx1xD = x_Bx1xD + mixed
        else:
            q, gate, k, v = layer.attn.inputs(layer.input_norm(x_Bx1xD), sin, cos)
            x_Bx1xD = x_Bx1xD + layer.attn.output(full_attention(full, q, k, v), gate)
            full += 1
        out_Bx1xD, router = layer.feed_forward(x_Bx1xD)
        x_Bx1xD = x_Bx1xD + out_Bx1xD
        routers.append(router)
    experts_Bx1xYxK = _experts(cfg, routers)
    experts_BxYxK = None if experts_Bx1xYxK is None else experts_Bx1xYxK[:, 0]
    moved = HybridCache(kv=None, state=tuple(states), window=tuple(windows))
    return _logits(model, x_Bx1xD[:, 0]), moved, experts_BxYxK


def decode_step(
    model: HybridModel,
    tokens_B: jax.Array,
    positions_B: jax.Array,
    cache: HybridCache,
    attend_length: int | None = None,
    layer_states: Sequence[nnx.State] | None = None,
) -> tuple[jax.Array, HybridCache]:
    """Feed one token per slot at `positions_B`: the full-attention layers write its key/value at that position
    and attend to the cache up to it (only the segments covering `attend_length`, static and > every position,
    when given), the linear ones update the slot's state and window. `layer_states` (`layer_states()`): each
    layer's weights, read in place. Returns fp32 logits [B, V] and the cache."""
    return decode_step_routed(model, tokens_B, positions_B, cache, attend_length, layer_states)[:2]


def decode_step_routed(
    model: HybridModel,
    tokens_B: jax.Array,
    positions_B: jax.Array,
    cache: HybridCache,
    attend_length: int | None = None,
    layer_states: Sequence[nnx.State] | None = None,
) -> tuple[jax.Array, HybridCache, jax.Array | None]:
    """`decode_step` and each fed token's experts [B, Y, K] (`routing_dtype`; None when dense)."""
    attend = get_attention(model.config.attention_impl, decode=True)
    rows_B = jnp.arange(tokens_B.shape[0])
    keys: list[tuple[jax.Array, ...]] = []
    values: list[tuple[jax.Array, ...]] = []
    kv = cache.kv
    if kv is not None:
        s = kv.length if attend_length is None else attend_length
        valid_BxS = jnp.arange(s)[None, :] <= positions_B[:, None]
        # as in `Decoder.decode_step`: the segments holding [0, s), each slot's entry in the one holding its position
        spans = [(a, min(b, s)) for a, b in zip((0, *kv.ends[:-1]), kv.ends, strict=True) if a < s]
        index_B = [jnp.where((positions_B >= a) & (positions_B < b), positions_B - a, kv.length) for a, b in spans]

    def dense_attention(y: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        assert kv is not None  # a full-attention layer's prefill made it
        k_segments, v_segments = list(kv.k[y]), list(kv.v[y])
        read_k, read_v = [], []
        for j, ((a, b), index) in enumerate(zip(spans, index_B, strict=True)):
            k_segments[j] = k_segments[j].at[rows_B, :, :, index].set(k[:, 0].astype(k_segments[j].dtype), mode="drop")
            v_segments[j] = v_segments[j].at[rows_B, :, index].set(v[:, 0].astype(v_segments[j].dtype), mode="drop")
            read_k.append(k_segments[j][..., : b - a])
            read_v.append(v_segments[j][:, :, : b - a])
        keys.append(tuple(k_segments))
        values.append(tuple(v_segments))
        return attend(q, read_k, read_v, valid_BxS=valid_BxS)

    logits_BxV, recurrent, experts = _decode_layers(model, tokens_B, positions_B, cache, layer_states, dense_attention)
    kv = KVCache(k=tuple(keys), v=tuple(values)) if keys else None
    return logits_BxV, dataclasses.replace(recurrent, kv=kv), experts


def decode_step_paged(
    model: HybridModel,
    tokens_B: jax.Array,
    positions_B: jax.Array,
    pools: Sequence[PagePool],
    page_table_BxM: jax.Array,
    attend_pages: int,
    recurrent: HybridCache,
    layer_states: Sequence[nnx.State] | None = None,
) -> tuple[jax.Array, tuple[PagePool, ...], HybridCache, jax.Array | None]:
    """`decode_step_routed` with the full layers' keys and values in pages (the `Decoder`'s paged step for each:
    `PagedDecodeStep`; a pool per full layer, the page table [B, M], `attend_pages` static and covering every
    position) and each slot's state and window in `recurrent` (kv None). Returns fp32 logits [B, V], the pools,
    the recurrent part moved on and each fed token's experts [B, Y, K] (None when dense)."""
    step = PagedDecodeStep.plan(page_table_BxM, positions_B, pools[0].num_pages, pools[0].page_size, attend_pages)
    written = list(pools)

    def paged_attention(y: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        out, written[y] = step.write_and_attend(q, k, v, written[y])
        return out

    logits_BxV, moved, experts = _decode_layers(model, tokens_B, positions_B, recurrent, layer_states, paged_attention)
    return logits_BxV, tuple(written), moved, experts

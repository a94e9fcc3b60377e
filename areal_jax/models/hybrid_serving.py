"""Prefill and decode for a `HybridDecoder` (Qwen3.5), model level: the state a slot carries beside the KV cache.

Each slot holds, per linear-attention layer, its recurrent state [L, E, V] (fp32) and its convolution window
[W-1, A*J]; the full-attention layers keep keys and values in a `KVCache` of their own (its layer index is the
full-attention stack's). `prefill` builds both from right-padded prompts (the delta rule chunk by chunk);
`decode_step` moves them on one token per slot. The engine does not use these yet (issue 37): see the
report's serving notes for what its insert, abort, prefix sharing and interruption need.

Legend as in `hybrid.py`; S cache length, Y layers of one kind.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models.attention import get_attention
from areal_jax.models.decoder import KVCache, mask_padded_vocab
from areal_jax.models.hybrid import FullAttentionLayer, HybridDecoder, LinearAttentionLayer
from areal_jax.models.rope import inverse_frequencies, rope_tables


@flax.struct.dataclass
class HybridCache:
    """What decoding continues from: the full-attention layers' `KVCache` (None without such layers) and, per
    linear-attention layer, the recurrent state [B, L, E, V] and the convolution window [B, W-1, A*J]."""

    kv: KVCache | None
    state: tuple[jax.Array, ...]
    window: tuple[jax.Array, ...]


def _unstack(stack: nnx.Module | None) -> list[Any]:
    """Each layer of a stack as its own module (weights sliced out of the stack); [] for no stack."""
    if stack is None:
        return []
    graphdef, state = nnx.split(stack)
    count = jax.tree.leaves(state)[0].shape[0]
    return [nnx.merge(graphdef, jax.tree.map(lambda w, i=i: w[i], state)) for i in range(count)]


def _rope(model: HybridDecoder, positions_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    cfg = model.config
    assert cfg.hybrid is not None
    rotary = int(cfg.resolved_head_dim * cfg.hybrid.partial_rotary_factor)
    return rope_tables(positions_BxT, inverse_frequencies(rotary, cfg.rope_theta, cfg.rope_scaling))


def _logits(model: HybridDecoder, x_BxD: jax.Array) -> jax.Array:
    logits_BxV = jnp.einsum(
        "bd,dv->bv", model.final_norm(x_BxD), model.head_kernel(), preferred_element_type=jnp.float32
    )
    return mask_padded_vocab(logits_BxV, model.config.usable_vocab)


def prefill(
    model: HybridDecoder, tokens_BxT: jax.Array, lengths_B: jax.Array, first_segment: int | None = None
) -> tuple[jax.Array, HybridCache]:
    """Right-padded prompts: fp32 logits [B, V] at each last real token and the cache decoding continues from
    (a KV cache of length T cut into segments from `first_segment`; entries past a prompt are garbage, masked)."""
    cfg = model.config
    assert cfg.hybrid is not None
    b, t = tokens_BxT.shape
    positions_BxT = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
    segment_ids_BxT = (positions_BxT < lengths_B[:, None]).astype(jnp.int32)
    sin, cos = _rope(model, positions_BxT)
    attend = get_attention(cfg.attention_impl)
    linear: list[LinearAttentionLayer] = _unstack(model.linear_layers)
    full: list[FullAttentionLayer] = _unstack(model.full_layers)
    x_BxTxD = model._embed(tokens_BxT)
    states: list[jax.Array] = []
    windows: list[jax.Array] = []
    keys: list[jax.Array] = []
    values: list[jax.Array] = []
    for kind in cfg.hybrid.layer_types:
        if kind == "linear_attention":
            lin = linear[len(states)]
            mixed_BxTxD, state, window = lin.mixer.prefill(lin.input_norm(x_BxTxD), lengths_B)
            states.append(state)
            windows.append(window)
            x_BxTxD = x_BxTxD + mixed_BxTxD
            x_BxTxD = x_BxTxD + lin.mlp(lin.post_attention_norm(x_BxTxD))
        else:
            att = full[len(keys)]
            q, gate, k, v = att.attn.inputs(att.input_norm(x_BxTxD), sin, cos)
            keys.append(k)
            values.append(v)
            out = attend(q, k, v, segment_ids=segment_ids_BxT, positions=positions_BxT)
            x_BxTxD = x_BxTxD + att.attn.output(out, gate)
            x_BxTxD = x_BxTxD + att.mlp(att.post_attention_norm(x_BxTxD))
    last_BxD = jnp.take_along_axis(x_BxTxD, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    kv = KVCache.from_entries(jnp.stack(keys), jnp.stack(values), first_segment) if keys else None
    return _logits(model, last_BxD), HybridCache(kv=kv, state=tuple(states), window=tuple(windows))


def decode_step(
    model: HybridDecoder, tokens_B: jax.Array, positions_B: jax.Array, cache: HybridCache
) -> tuple[jax.Array, HybridCache]:
    """Feed one token per slot at `positions_B`: the full-attention layers write its key/value at that position
    and attend to the cache up to it, the linear ones update the slot's state and window. Returns fp32 logits
    [B, V] and the cache."""
    cfg = model.config
    assert cfg.hybrid is not None
    sin, cos = _rope(model, positions_B[:, None])
    attend = get_attention(cfg.attention_impl, decode=True)
    linear: list[LinearAttentionLayer] = _unstack(model.linear_layers)
    full: list[FullAttentionLayer] = _unstack(model.full_layers)
    rows_B = jnp.arange(tokens_B.shape[0])
    spans = []
    if cache.kv is not None:
        spans = list(zip((0, *cache.kv.ends[:-1]), cache.kv.ends, strict=True))
        valid_BxS = jnp.arange(cache.kv.length)[None, :] <= positions_B[:, None]
    x_Bx1xD = model._embed(tokens_B[:, None])
    states: list[jax.Array] = []
    windows: list[jax.Array] = []
    keys: list[tuple[jax.Array, ...]] = []
    values: list[tuple[jax.Array, ...]] = []
    for kind in cfg.hybrid.layer_types:
        if kind == "linear_attention":
            y = len(states)
            lin = linear[y]
            mixed, state, window = lin.mixer.decode(lin.input_norm(x_Bx1xD), cache.state[y], cache.window[y])
            states.append(state)
            windows.append(window)
            x_Bx1xD = x_Bx1xD + mixed
            x_Bx1xD = x_Bx1xD + lin.mlp(lin.post_attention_norm(x_Bx1xD))
        else:
            assert cache.kv is not None  # a full-attention layer's prefill made it
            y = len(keys)
            att = full[y]
            q, gate, k, v = att.attn.inputs(att.input_norm(x_Bx1xD), sin, cos)
            k_segments, v_segments = list(cache.kv.k[y]), list(cache.kv.v[y])
            for j, (a, end) in enumerate(spans):  # each slot's entry goes to the segment holding its position
                index_B = jnp.where((positions_B >= a) & (positions_B < end), positions_B - a, cache.kv.length)
                k_segments[j] = (
                    k_segments[j].at[rows_B, :, :, index_B].set(k[:, 0].astype(k_segments[j].dtype), mode="drop")
                )
                v_segments[j] = (
                    v_segments[j].at[rows_B, :, index_B].set(v[:, 0].astype(v_segments[j].dtype), mode="drop")
                )
            keys.append(tuple(k_segments))
            values.append(tuple(v_segments))
            x_Bx1xD = x_Bx1xD + att.attn.output(attend(q, k_segments, v_segments, valid_BxS=valid_BxS), gate)
            x_Bx1xD = x_Bx1xD + att.mlp(att.post_attention_norm(x_Bx1xD))
    kv = KVCache(k=tuple(keys), v=tuple(values)) if keys else None
    return _logits(model, x_Bx1xD[:, 0]), HybridCache(kv=kv, state=tuple(states), window=tuple(windows))

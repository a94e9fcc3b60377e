"""Attention behind one function, masked by segment ids and positions, with swappable kernels.

Legend: B batch rows, T query length, S key/value length, N query heads, K key/value heads,
G = N / K query heads per KV head, H head dim.

A query attends to a key when both belong to the same non-zero segment and the key's position is
not after the query's. The same rule covers packed training rows, right-padded prefill rows and
decoding against a slot cache (where stale cache entries carry segment 0).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

AttentionFn = Callable[..., jax.Array]


def attention_mask(
    q_segment_ids_BxT: jax.Array,
    kv_segment_ids_BxS: jax.Array,
    q_positions_BxT: jax.Array,
    kv_positions_BxS: jax.Array,
) -> jax.Array:
    """Boolean [B, T, S]: query t may attend to key s."""
    same_segment = q_segment_ids_BxT[:, :, None] == kv_segment_ids_BxS[:, None, :]
    causal = kv_positions_BxS[:, None, :] <= q_positions_BxT[:, :, None]
    return same_segment & causal & (kv_segment_ids_BxS[:, None, :] != 0)


def xla_attention(
    q_BxTxNxH: jax.Array,
    k_BxSxKxH: jax.Array,
    v_BxSxKxH: jax.Array,
    *,
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array,
    q_positions: jax.Array,
    kv_positions: jax.Array,
) -> jax.Array:
    """Portable grouped-query attention; softmax in fp32, output in the query dtype."""
    b, t, n, h = q_BxTxNxH.shape
    k_heads = k_BxSxKxH.shape[2]
    q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, k_heads, n // k_heads, h)
    scores_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH, preferred_element_type=jnp.float32) * (
        h**-0.5
    )
    mask_BxTxS = attention_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    # A finite fill keeps fully-masked (padding) queries NaN-free; their outputs are ignored.
    scores_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None, :, :], scores_BxKxGxTxS, jnp.finfo(jnp.float32).min)
    probs_BxKxGxTxS = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(v_BxSxKxH.dtype)
    out_BxTxKxGxH = jnp.einsum("bkgts,bskh->btkgh", probs_BxKxGxTxS, v_BxSxKxH)
    return out_BxTxKxGxH.reshape(b, t, n, h)


ATTENTION_IMPLS: dict[str, AttentionFn] = {"xla": xla_attention}


def get_attention(name: str) -> AttentionFn:
    if name not in ATTENTION_IMPLS:
        raise KeyError(f"attention implementation {name!r} unknown; available: {sorted(ATTENTION_IMPLS)}")
    return ATTENTION_IMPLS[name]

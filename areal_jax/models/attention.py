"""Attention by name: one function for rows masked by segment ids and positions, one for decoding.

Legend: B batch rows, T query length, S key/value length, N query heads, K key/value heads,
G = N / K query heads per KV head, H head dim.

`get_attention(name)` returns the row attention (self-attention over packed or right-padded rows): a
query attends to a key when both belong to the same non-zero segment and the key's position is not after
the query's. `get_attention(name, decode=True)` returns the decode attention: one new token per cache
slot attends to the slot's cache entries that `valid_BxS` marks (up to and including its own, already
written). Row attention: `xla` (plain JAX), `splash` (JAX's Pallas TPU kernel, `models/splash.py`; in
Pallas's interpreter off TPU), `auto` (splash on TPU where it applies, else xla); decode attention: plain JAX
under every name. The decode attention over a paged cache is `paged_attention.py`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from areal_jax.activation_sharding import mesh_platform
from areal_jax.models.splash import splash_attention, splash_block

AttentionFn = Callable[..., jax.Array]

# Queries per block of the row attention: rows up to this long are one block.
ROW_BLOCK = 256
# Blocks the XLA row attention writes out one by one (skipping the keys past each block's diagonal); a longer
# row is scanned. Program size: 128 unrolled blocks a layer (a 32k row) kept a TPU compile of a 1.5B model
# from finishing in 26 CPU-minutes.
UNROLLED_BLOCKS = 8


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


def masked_attention(
    q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array, mask_BxTxS: jax.Array
) -> jax.Array:
    """Grouped-query attention under an explicit mask; softmax in fp32, output in the query dtype."""
    b, t, n, h = q_BxTxNxH.shape
    k_heads = k_BxSxKxH.shape[2]
    q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, k_heads, n // k_heads, h)
    scores_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH, preferred_element_type=jnp.float32) * (
        h**-0.5
    )
    # A finite fill keeps fully-masked (padding) queries NaN-free; their outputs are ignored.
    scores_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None, :, :], scores_BxKxGxTxS, jnp.finfo(jnp.float32).min)
    probs_BxKxGxTxS = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(v_BxSxKxH.dtype)
    out_BxTxKxGxH = jnp.einsum("bkgts,bskh->btkgh", probs_BxKxGxTxS, v_BxSxKxH)
    return out_BxTxKxGxH.reshape(b, t, n, h)


def xla_attention(
    q_BxTxNxH: jax.Array,
    k_BxTxKxH: jax.Array,
    v_BxTxKxH: jax.Array,
    *,
    segment_ids: jax.Array,
    positions: jax.Array,
    block: int = ROW_BLOCK,
) -> jax.Array:
    """Self-attention over rows whose segments are contiguous runs of increasing positions (packed or
    right-padded rows), so no query attends to a key further along its row.

    Queries are taken `block` at a time. Up to `UNROLLED_BLOCKS` blocks, each block is written into the
    program against the keys up to its own end: the key blocks after the diagonal, always masked, are never
    computed (about half the work of a long row). A longer row is a `lax.scan` over its query blocks, each
    against every key (twice the work past the diagonal, but a program that does not grow with the row; each
    block rematerialised in the backward pass, so no [T, T] scores are kept).
    """
    t = q_BxTxNxH.shape[1]
    if t > UNROLLED_BLOCKS * block and t % block == 0:
        return _scanned_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids, positions, block)
    outs = []
    for start in range(0, t, block):
        end = min(start + block, t)
        mask_BxTxS = attention_mask(
            segment_ids[:, start:end], segment_ids[:, :end], positions[:, start:end], positions[:, :end]
        )
        outs.append(masked_attention(q_BxTxNxH[:, start:end], k_BxTxKxH[:, :end], v_BxTxKxH[:, :end], mask_BxTxS))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def _scanned_attention(
    q_BxTxNxH: jax.Array,
    k_BxTxKxH: jax.Array,
    v_BxTxKxH: jax.Array,
    segment_ids_BxT: jax.Array,
    positions_BxT: jax.Array,
    block: int,
) -> jax.Array:
    b, t, n, h = q_BxTxNxH.shape
    blocks = t // block

    def by_block(x: jax.Array) -> jax.Array:  # [B, T, ...] -> [T / block, B, block, ...]
        return jnp.moveaxis(x.reshape(b, blocks, block, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def one_block(q_BxCxNxH: jax.Array, segments_BxC: jax.Array, positions_BxC: jax.Array) -> jax.Array:
        mask_BxCxT = attention_mask(segments_BxC, segment_ids_BxT, positions_BxC, positions_BxT)
        return masked_attention(q_BxCxNxH, k_BxTxKxH, v_BxTxKxH, mask_BxCxT)

    _, out_XxBxCxNxH = jax.lax.scan(
        lambda carry, xs: (carry, one_block(*xs)),
        None,
        (by_block(q_BxTxNxH), by_block(segment_ids_BxT), by_block(positions_BxT)),
    )
    return jnp.moveaxis(out_XxBxCxNxH, 0, 1).reshape(b, t, n, h)


def uses_splash(impl: str, platform: str, length: int) -> bool:
    """Whether the row attention `impl` takes rows of `length` tokens to the splash kernel in a program for
    `platform`: `splash` always, `auto` on TPU for rows longer than one XLA block that the kernel's tiles divide."""
    if impl == "splash":
        return True
    return impl == "auto" and platform == "tpu" and length > ROW_BLOCK and splash_block(length) is not None


def auto_attention(
    q_BxTxNxH: jax.Array,
    k_BxTxKxH: jax.Array,
    v_BxTxKxH: jax.Array,
    *,
    segment_ids: jax.Array,
    positions: jax.Array,
) -> jax.Array:
    """The row attention for the program's platform: the splash kernel on TPU for rows longer than one block
    of the XLA path that its tiles divide, else `xla_attention`."""
    if uses_splash("auto", mesh_platform(), q_BxTxNxH.shape[1]):
        return splash_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids=segment_ids, positions=positions)
    return xla_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids=segment_ids, positions=positions)


def xla_decode_attention(
    q_Bx1xNxH: jax.Array,
    k_segments: Sequence[jax.Array],
    v_segments: Sequence[jax.Array],
    *,
    valid_BxS: jax.Array,
) -> jax.Array:
    """One query token per row attending to the cache entries `valid_BxS` marks (its own included).

    The cache comes in segments along its length (keys [B, K, H, S_j], values [B, K, S_j, H], together
    S long): one softmax over all their scores. The layouts make every dot a plain batched matmul over
    (B, K) that reads its segment where it lies, with no transpose or copy.
    """
    b, _, n, h = q_Bx1xNxH.shape
    k_heads = k_segments[0].shape[1]
    q_BxKxGxH = q_Bx1xNxH.reshape(b, k_heads, n // k_heads, h)
    scores_BxKxGxS = jnp.concatenate(
        [jnp.einsum("bkgh,bkhs->bkgs", q_BxKxGxH, k, preferred_element_type=jnp.float32) for k in k_segments],
        axis=-1,
    ) * (h**-0.5)
    scores_BxKxGxS = jnp.where(valid_BxS[:, None, None, :], scores_BxKxGxS, jnp.finfo(jnp.float32).min)
    probs_BxKxGxS = jax.nn.softmax(scores_BxKxGxS, axis=-1)
    out_BxKxGxH, start = jnp.zeros((), jnp.float32), 0
    for v in v_segments:
        probs = probs_BxKxGxS[..., start : start + v.shape[2]].astype(v.dtype)
        out_BxKxGxH = out_BxKxGxH + jnp.einsum("bkgs,bksh->bkgh", probs, v, preferred_element_type=jnp.float32)
        start += v.shape[2]
    return out_BxKxGxH.reshape(b, 1, n, h).astype(q_Bx1xNxH.dtype)


ATTENTION_IMPLS: dict[str, AttentionFn] = {"auto": auto_attention, "xla": xla_attention, "splash": splash_attention}
DECODE_ATTENTION_IMPLS: dict[str, AttentionFn] = {
    "auto": xla_decode_attention,
    "xla": xla_decode_attention,
    "splash": xla_decode_attention,
}


def get_attention(name: str, decode: bool = False) -> AttentionFn:
    """The row attention (or, with `decode`, the decode attention) named `name`."""
    impls = DECODE_ATTENTION_IMPLS if decode else ATTENTION_IMPLS
    if name not in impls:
        raise KeyError(f"attention implementation {name!r} unknown; available: {sorted(impls)}")
    return impls[name]

"""The row attention by JAX's Pallas TPU kernel (splash attention), per shard of the program's mesh.

Same contract as `attention.xla_attention`: rows whose segments are contiguous runs of increasing positions,
so "key position not after the query's, same segment" is the kernel's causal mask and-ed with its segment
ids. The kernel never writes the [T, T] scores (flash-style, with its own backward) and skips the blocks
above the diagonal; its program does not grow with the row, where the XLA path writes one block of code per
256 queries. Padding (segment 0) queries attend padding keys; their outputs are never read.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from areal_jax.activation_sharding import ROW_AXES, mesh_platform, program_mesh
from areal_jax.sharding import logical_to_spec

# The kernel's tiles along the row (queries and keys): the largest of these dividing the row; a row that
# none divides takes the XLA path.
SPLASH_BLOCKS = (512, 256, 128)


def splash_block(length: int) -> int | None:
    """The kernel's tile for rows of `length` tokens, or None when the kernel cannot take them."""
    return next((block for block in SPLASH_BLOCKS if length % block == 0), None)


def _kernel(length: int, heads: int, interpret: bool) -> Any:
    """A splash kernel for one row of `length` tokens and `heads` query heads. Made anew in each trace: its block
    maps (built in NumPy) become the program's constants, so a kernel kept across traces would leak them."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    block = splash_block(length)
    assert block is not None, length
    sizes = kernel_lib.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((length, length)) for _ in range(heads)])
    return kernel_lib.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def _rows(
    interpret: bool, q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array, segment_ids_BxT: jax.Array
) -> jax.Array:
    """The kernel over this shard's rows and heads."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

    _, t, n, h = q_BxTxNxH.shape
    kernel = _kernel(t, n, interpret)
    q_BxNxTxH = (q_BxTxNxH * (h**-0.5)).astype(q_BxTxNxH.dtype).swapaxes(1, 2)
    k_BxKxTxH, v_BxKxTxH = k_BxTxKxH.swapaxes(1, 2), v_BxTxKxH.swapaxes(1, 2)

    def one_row(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array) -> jax.Array:
        return kernel(q, k, v, segment_ids=SegmentIds(q=segments, kv=segments))

    return jax.vmap(one_row)(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, segment_ids_BxT.astype(jnp.int32)).swapaxes(1, 2)


def splash_attention(
    q_BxTxNxH: jax.Array,
    k_BxTxKxH: jax.Array,
    v_BxTxKxH: jax.Array,
    *,
    segment_ids: jax.Array,
    positions: jax.Array,
) -> jax.Array:
    """Self-attention over packed rows by the splash kernel (`positions` are implied by the row order). On a
    mesh of several devices it runs per shard (XLA cannot partition a Pallas kernel): rows split as the
    activations are, heads over the tensor axis when both the query and the KV heads divide it. Off TPU the
    kernel runs in Pallas's interpreter (slow: for tests)."""
    del positions
    rows_fn = functools.partial(_rows, mesh_platform() != "tpu")
    mesh = program_mesh()
    if mesh is None or mesh.size == 1:
        return rows_fn(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids)
    P = jax.sharding.PartitionSpec
    rows = logical_to_spec(ROW_AXES, segment_ids.shape, mesh)
    heads = logical_to_spec(("heads",), q_BxTxNxH.shape[2:3], mesh)[0]
    kv_heads = logical_to_spec(("kv_heads",), k_BxTxKxH.shape[2:3], mesh)[0]
    if heads != kv_heads:  # a KV head's query heads must stay on its chip
        heads = kv_heads = None
    q_spec, kv_spec = P(*rows, heads, None), P(*rows, kv_heads, None)
    return jax.shard_map(
        rows_fn,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, rows),
        out_specs=q_spec,
        check_vma=False,
    )(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids)

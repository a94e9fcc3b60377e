"""Decode attention over a paged KV cache: each slot's one new query token over the tokens its pages hold.

A layer's pool comes in one of two layouts (`page_pool.py`), each read in place by one of JAX's Pallas TPU
kernels, which run per shard of the mesh the program is built for (`mesh_platform`, not the local backend):
  - split, keys and values each [K, P, page, H]: `paged_attention` (head dims a multiple of 128, pages a
    multiple of 8 tokens);
  - combined, one [P, page, 2K, H] (head k's key at 2k, its value at 2k + 1): `ragged_paged_attention` (head dim
    128 only: at 256, Mosaic refuses its page copies in jax 0.10.2, docs/tpu.md).
Elsewhere (CPU, GPU, shapes a kernel refuses) `xla_paged_decode_attention`: a scan over blocks of pages with an
online softmax, gathering one block's pages at a time.

Legend: B slots, M pages per slot, C pages per block, T tokens per block, P pool pages, K kv heads, N query
heads, G = N / K, H head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from areal_jax.sharding import logical_to_spec

# Tokens of pages the reference paged attention gathers per block (pages of 16: 4 per block); measured
# on XLA:CPU (64 slots, 512 tokens attended): gathering every attended page at once is 3-4x slower than
# blocks of 32..64 tokens, whose gathered copy stays in cache.
PAGED_BLOCK_TOKENS = 64
# The ragged kernel's blocks: queries per block (one token per slot in a decode step) and the VMEM it may use.
# Given, since its tuning table reads the local device kind (the CPU when compiling ahead of time).
RAGGED_QUERIES_PER_BLOCK = 32
RAGGED_VMEM_LIMIT_BYTES = 64 * 2**20


class PageBlocks(Protocol):
    """A pool the reference attention reads: pages of `page_size` tokens, gathered a block at a time."""

    @property
    def page_size(self) -> int: ...

    @property
    def kv_heads(self) -> int: ...

    def gather(self, pages_BxC: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values [K, B, C * page, H] of each slot's pages `pages_BxC` (valid pool indices)."""
        ...


def pages_per_block(page_size: int, attend_pages: int) -> int:
    """Pages the reference paged attention takes per block: about PAGED_BLOCK_TOKENS tokens, at most
    `attend_pages`."""
    return max(1, min(attend_pages, PAGED_BLOCK_TOKENS // page_size))


def xla_paged_decode_attention(
    q_Bx1xNxH: jax.Array, pool: PageBlocks, pages_BxM: jax.Array, positions_B: jax.Array
) -> jax.Array:
    """One query token per row attending to its row's cache positions [0, positions_B] held in the pages
    `pages_BxM` lists (in sequence order; every entry a valid pool index) of `pool`.

    A `lax.scan` over blocks of pages with a running (online) softmax: each block's pages are gathered
    into a small [K, B, block * page, H] copy, never the whole attended cache. M must be a multiple of
    the block (`pages_per_block`)."""
    b, _, n, h = q_Bx1xNxH.shape
    m = pages_BxM.shape[1]
    block = pages_per_block(pool.page_size, m)
    tokens = block * pool.page_size
    blocks_NxBxC = pages_BxM.reshape(b, m // block, block).swapaxes(0, 1)
    k_heads = pool.kv_heads
    g = n // k_heads
    q_BxKxGxH = q_Bx1xNxH.reshape(b, k_heads, g, h)

    def one_block(carry: tuple[jax.Array, jax.Array, jax.Array], xs: tuple[jax.Array, jax.Array]):
        max_BxKxG, sum_BxKxG, out_BxKxGxH = carry
        pages_BxC, first = xs
        k_KxBxTxH, v_KxBxTxH = pool.gather(pages_BxC)
        scores_BxKxGxT = jnp.einsum("bkgh,kbth->bkgt", q_BxKxGxH, k_KxBxTxH, preferred_element_type=jnp.float32) * (
            h**-0.5
        )
        valid_BxT = (first + jnp.arange(tokens))[None, :] <= positions_B[:, None]
        scores_BxKxGxT = jnp.where(valid_BxT[:, None, None, :], scores_BxKxGxT, jnp.finfo(jnp.float32).min)
        new_max = jnp.maximum(max_BxKxG, scores_BxKxGxT.max(axis=-1))
        weights_BxKxGxT = jnp.exp(scores_BxKxGxT - new_max[..., None])
        rescale = jnp.exp(max_BxKxG - new_max)
        sum_BxKxG = sum_BxKxG * rescale + weights_BxKxGxT.sum(axis=-1)
        out_BxKxGxH = out_BxKxGxH * rescale[..., None] + jnp.einsum(
            "bkgt,kbth->bkgh", weights_BxKxGxT.astype(v_KxBxTxH.dtype), v_KxBxTxH, preferred_element_type=jnp.float32
        )
        return (new_max, sum_BxKxG, out_BxKxGxH), None

    init = (
        jnp.full((b, k_heads, g), jnp.finfo(jnp.float32).min, jnp.float32),
        jnp.zeros((b, k_heads, g), jnp.float32),
        jnp.zeros((b, k_heads, g, h), jnp.float32),
    )
    firsts = jnp.arange(m // block, dtype=jnp.int32) * tokens
    (_, sum_BxKxG, out_BxKxGxH), _ = jax.lax.scan(one_block, init, (blocks_NxBxC, firsts))
    out_BxKxGxH = out_BxKxGxH / sum_BxKxG[..., None]
    return out_BxKxGxH.reshape(b, 1, n, h).astype(q_Bx1xNxH.dtype)


def kv_heads_spec(kv_heads: int, mesh: Any) -> Any:
    """The mesh axes `kv_heads` KV heads split over on `mesh` (a `PartitionSpec` entry; None without a mesh): the
    tensor axis where it divides them, like the attention weights. A pool's heads split the same way, a combined
    pool's [2K] axis in whole heads (each key with its value)."""
    if mesh is None or mesh.empty:
        return None
    return logical_to_spec(("kv_heads",), (kv_heads,), mesh)[0]


def kv_head_shards(kv_heads: int, mesh: Any) -> int:
    """Devices the KV heads split over on `mesh` (`kv_heads_spec`; None or empty: 1)."""
    spec = kv_heads_spec(kv_heads, mesh)
    axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
    return math.prod(mesh.shape[a] for a in axes)


def split_kernel_applies(head_dim: int, page_size: int) -> bool:
    """Whether JAX's TPU `paged_attention` kernel takes a split pool: head dims a multiple of 128 and pages a
    multiple of 8 tokens (its block tiling)."""
    return head_dim % 128 == 0 and page_size % 8 == 0


def ragged_kernel_applies(query_heads: int, kv_heads: int, head_dim: int, dtype: Any) -> bool:
    """Whether JAX's TPU `ragged_paged_attention` kernel takes a combined pool of a device's share of the heads:
    head dim 128 (Mosaic refuses 256's page copies in jax 0.10.2) and combined heads it can tile (its
    `get_min_heads_per_blk` refuses the others)."""
    if head_dim != 128:
        return False
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import get_min_heads_per_blk

    try:
        get_min_heads_per_blk(query_heads, 2 * kv_heads, dtype, dtype)
    except ValueError:
        return False
    return True


def tpu_paged_decode_attention(
    q_Bx1xNxH: jax.Array, k_pages: jax.Array, v_pages: jax.Array, pages_BxM: jax.Array, positions_B: jax.Array
) -> jax.Array:
    """The decode attention over a split pool by JAX's Pallas TPU kernel `paged_attention`. Not run here (no
    TPU): the reference is what the tests check."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    b, _, n, h = q_Bx1xNxH.shape
    q_BxNxH = (q_Bx1xNxH[:, 0] * (h**-0.5)).astype(k_pages.dtype)
    m = pages_BxM.shape[1]

    def kernel(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, pages: jax.Array) -> jax.Array:
        lengths = (positions + 1).astype(jnp.int32)
        return paged_attention(q, k, v, lengths, pages, pages_per_compute_block=pages_per_block(k.shape[2], m))

    pool_spec = (kv_heads_spec(k_pages.shape[0], jax.sharding.get_abstract_mesh()), None, None, None)
    out_BxNxH = _on_mesh_shards(kernel, q_BxNxH, (k_pages, v_pages), pool_spec, positions_B, pages_BxM)
    return out_BxNxH.reshape(b, 1, n, h).astype(q_Bx1xNxH.dtype)


def ragged_decode_args(
    q_BxNxH: jax.Array, kv_pages: jax.Array, positions_B: jax.Array, pages_BxM: jax.Array
) -> tuple[jax.Array, ...]:
    """The ragged paged attention kernel's arguments for a decode step: every slot a sequence of one query token
    (`q_BxNxH`, at `positions_B`) over its cached tokens up to and including it, in the pages `pages_BxM` lists
    (valid pool indices)."""
    slots = q_BxNxH.shape[0]
    lengths_B = (positions_B + 1).astype(jnp.int32)
    cumulative_query_lengths = jnp.arange(slots + 1, dtype=jnp.int32)
    return q_BxNxH, kv_pages, lengths_B, pages_BxM, cumulative_query_lengths, jnp.array([slots], jnp.int32)


def tpu_ragged_decode_attention(
    q_Bx1xNxH: jax.Array, kv_pages: jax.Array, pages_BxM: jax.Array, positions_B: jax.Array
) -> jax.Array:
    """The decode attention over a combined pool by JAX's Pallas TPU kernel `ragged_paged_attention`: each slot
    one query token over its `positions_B + 1` cached tokens. Not run here (no TPU; the kernel fails in Pallas's
    TPU interpreter in jax 0.10.2): the tests check our inputs against its own `ref_ragged_paged_attention`."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    b, _, n, h = q_Bx1xNxH.shape
    m = pages_BxM.shape[1]

    def kernel(q_BxNxH: jax.Array, kv: jax.Array, positions: jax.Array, pages: jax.Array) -> jax.Array:
        return ragged_paged_attention(
            *ragged_decode_args(q_BxNxH, kv, positions, pages),
            sm_scale=h**-0.5,
            num_kv_pages_per_block=pages_per_block(kv.shape[1], m),
            num_queries_per_block=min(RAGGED_QUERIES_PER_BLOCK, q_BxNxH.shape[0]),
            vmem_limit_bytes=RAGGED_VMEM_LIMIT_BYTES,
        )

    q_BxNxH = q_Bx1xNxH[:, 0].astype(kv_pages.dtype)
    pool_spec = (
        None,
        None,
        kv_heads_spec(kv_pages.shape[2] // 2, jax.sharding.get_abstract_mesh()),
        None,
    )  # a shard holds whole heads' key and value
    out_BxNxH = _on_mesh_shards(kernel, q_BxNxH, (kv_pages,), pool_spec, positions_B, pages_BxM)
    return out_BxNxH.reshape(b, 1, n, h).astype(q_Bx1xNxH.dtype)


def _on_mesh_shards(
    kernel: Callable[..., jax.Array],
    q_BxNxH: jax.Array,
    pools: tuple[jax.Array, ...],
    pool_spec: tuple[Any, ...],
    positions_B: jax.Array,
    pages_BxM: jax.Array,
) -> jax.Array:
    """`kernel(q, *pools, positions, pages)` per shard of the mesh of `jax.set_mesh` (XLA cannot partition a
    Pallas kernel): slots split like the decode state's, heads like the pools' (`pool_spec`; query heads with
    their KV heads), pools whole along the other axes (any slot may hold any page). Without a mesh of several
    devices, `kernel` as it is."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel(q_BxNxH, *pools, positions_B, pages_BxM)
    P = jax.sharding.PartitionSpec
    heads = next((axis for axis in pool_spec if axis is not None), None)
    slots = logical_to_spec(("slots",), q_BxNxH.shape[:1], mesh)[0]
    return jax.shard_map(
        kernel,
        in_specs=(P(slots, heads, None), *(P(*pool_spec) for _ in pools), P(slots), P(slots, None)),
        out_specs=P(slots, heads, None),
        check_vma=False,
    )(q_BxNxH, *pools, positions_B, pages_BxM)

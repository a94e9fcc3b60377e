"""One decode step's reads and writes of a paged KV cache, shared by every model that pages its attention (the
`Decoder`'s layers, a `HybridDecoder`'s full-attention layers): where each slot's new key/value goes, which pages
it attends to, and a layer's write-then-attend over its pools.

Layout (`inference/paged.py`): per layer, a pool (`page_pool.py`: split or combined); a page table [B, M] maps a
slot's j-th page to a pool page, P (past the pool) meaning "no page" (a write there is dropped, a read clamped and
masked).

Legend: B slots, M pages per slot, P pool pages, K kv heads, N query heads, H head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from areal_jax.models.page_pool import PagePool
from areal_jax.models.paged_attention import pages_per_block


class PagedDecodeStep(NamedTuple):
    """Where one decode step writes and reads each slot: the same for every layer of the step."""

    write_page_B: jax.Array  # the pool page holding each slot's position (P: none, the write is dropped)
    offset_B: jax.Array  # the position within that page
    read_BxM: jax.Array  # the pages each slot attends to, a whole number of attention blocks, valid pool indices
    positions_B: jax.Array

    @classmethod
    def plan(
        cls, page_table_BxM: jax.Array, positions_B: jax.Array, pool_pages: int, page_size: int, attend_pages: int
    ) -> PagedDecodeStep:
        """The step for slots at `positions_B` attending to their first `attend_pages` pages (static, covering
        every position): a slot's pages past its position are masked, so what they hold does not matter."""
        column_B = jnp.minimum(positions_B // page_size, page_table_BxM.shape[1] - 1)
        write_page_B = jnp.take_along_axis(page_table_BxM, column_B[:, None], axis=1)[:, 0]
        block = pages_per_block(page_size, attend_pages)
        read_BxM = jnp.minimum(page_table_BxM[:, :attend_pages], pool_pages - 1)
        if attend_pages % block:
            read_BxM = jnp.pad(read_BxM, ((0, 0), (0, block - attend_pages % block)))
        return cls(write_page_B, positions_B % page_size, read_BxM, positions_B)

    def write_and_attend(
        self, q_Bx1xNxH: jax.Array, k_Bx1xKxH: jax.Array, v_Bx1xKxH: jax.Array, pool: PagePool
    ) -> tuple[jax.Array, PagePool]:
        """One layer: each slot's new key/value written at its position's page, then its query attending to its
        pages up to and including it. Returns the attention output [B, 1, N, H] and the pool."""
        pool = pool.write(self.write_page_B, self.offset_B, k_Bx1xKxH[:, 0], v_Bx1xKxH[:, 0])
        return pool.attend(q_Bx1xNxH, self.read_BxM, self.positions_B), pool

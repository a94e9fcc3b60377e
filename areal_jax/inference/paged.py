"""The paged KV cache: fixed-size pages in one pool per layer, a page table per slot, and the host-side
allocator that hands pages out as sequences grow.

Layout. Per layer, one pool of P pages of `page` tokens, in the layout a JAX TPU kernel reads as it is
(`models/page_pool.py`): keys and values each [K, P, page, H] (`paged_attention`'s), or both in one
[P, page, 2K, H] (`ragged_paged_attention`'s, chosen on TPU at head dim 128); the reference attention
(`models/paged_attention.py`) gathers a block of pages at a time from either. The page table [S, M]
(M = pages a slot of `max_length` tokens needs) maps a slot's j-th page to a pool page, with `P` (past
the pool) marking "no page": a write there is dropped and a read is clamped and masked. The table and
the pools live in the decode state on the device.

Ownership. `PagedSlots` (the free list, each slot's pages, the table changes not yet sent) is plain
Python owned by one thread, the generator's loop; the device only ever sees the table rows written by
an insert and the small batched update (`PagedSlots.take_updates`) sent with each decode step.

Legend: Y layers, B prefix rows, S slots, T tokens, K kv heads, H head dim, P pool pages, M pages per slot,
W pages written by one insert.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models.config import ModelConfig
from areal_jax.models.page_pool import PagePool, empty_pool


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-tokens // page_size)


class PageAllocator:
    """The free list of page ids [0, num_pages). Pages come from the low end first, and a freed page is
    the next one handed out. Not thread-safe: one owner."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int] | None:
        """`n` free pages, or None (and nothing taken) when fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Give `pages` back; a page that is not allocated, or listed twice, raises ValueError (a double
        free) and nothing is freed."""
        unknown = [page for page in pages if page not in self._used]
        if unknown or len(set(pages)) != len(pages):
            raise ValueError(f"pages {sorted(pages)}: {unknown or 'a repeated one'} not allocated")
        self._used.difference_update(pages)
        self._free.extend(reversed(pages))


class PagedSlots:
    """The pages of every decode slot: the allocator, each slot's page list (in sequence order) and the
    page-table changes the device has not seen yet (rows to clear, one new page per slot).

    Insert writes a slot's whole table row itself (see `PagedKVCache.insert`), so `assign` cancels any
    change still pending for that slot; everything else reaches the device through `take_updates`."""

    def __init__(self, slots: int, num_pages: int, page_size: int, max_pages: int):
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size
        self.max_pages = max_pages
        self.slot_pages: list[list[int]] = [[] for _ in range(slots)]
        self._clear = np.zeros(slots, np.int32)
        self._column = np.full(slots, max_pages, np.int32)  # max_pages: no new page for that slot
        self._page = np.zeros(slots, np.int32)
        self._dirty = False

    def pages_needed(self, tokens: int) -> int:
        """Pages a slot needs to hold positions [0, tokens)."""
        return pages_for(tokens, self.page_size)

    def assign(self, slot: int, tokens: int) -> list[int] | None:
        """Pages for positions [0, tokens) of a sample entering the empty `slot` (None: not enough free,
        nothing taken)."""
        if self.slot_pages[slot]:
            raise ValueError(f"slot {slot} still holds pages {self.slot_pages[slot]}")
        pages = self.allocator.allocate(self.pages_needed(tokens))
        if pages is not None:
            self.slot_pages[slot] = pages
            self._clear[slot] = 0
            self._column[slot] = self.max_pages
        return pages

    def grow(self, slot: int, position: int) -> bool:
        """Make sure `slot` has the page holding `position` (its next write); False when it needs one and
        none is free. At most one new page per slot between two `take_updates` (one token per step)."""
        pages = self.slot_pages[slot]
        if position // self.page_size < len(pages):
            return True
        if self._column[slot] != self.max_pages:
            raise ValueError(f"slot {slot} already got a page this step")
        new = self.allocator.allocate(1)
        if new is None:
            return False
        self._column[slot] = len(pages)
        self._page[slot] = new[0]
        pages.append(new[0])
        self._dirty = True
        return True

    def release(self, slot: int) -> None:
        """Free the pages of `slot` and clear its table row with the next step."""
        self.allocator.free(self.slot_pages[slot])
        self.slot_pages[slot] = []
        self._clear[slot] = 1
        self._column[slot] = self.max_pages
        self._dirty = True

    @staticmethod
    def no_updates(slots: int, max_pages: int) -> np.ndarray:
        """The [3, S] update that changes nothing."""
        return np.stack([np.zeros(slots, np.int32), np.full(slots, max_pages, np.int32), np.zeros(slots, np.int32)])

    def take_updates(self) -> np.ndarray | None:
        """The pending table changes as one [3, S] int32 array (rows: clear the slot's row, the column of
        its new page or M for none, that page), and forget them; None when there are none."""
        if not self._dirty:
            return None
        updates = np.stack([self._clear, self._column, self._page])
        self._clear[:] = 0
        self._column[:] = self.max_pages
        self._dirty = False
        return updates


@flax.struct.dataclass
class PrefixEntries:
    """Prefilled keys and values as the layer scan makes them, k/v [Y, B, T, K, H] (the paged engine's
    prefix; an insert scatters them into pages)."""

    k: jax.Array
    v: jax.Array

    @property
    def length(self) -> int:
        return self.k.shape[2]


@flax.struct.dataclass
class PagedKVCache:
    """Every layer's page pool, pools[y] (`SplitPages` or `CombinedPages`, all in one layout), and the page table
    [S, M] (entry P: no page)."""

    pools: tuple[PagePool, ...]
    page_table: jax.Array

    @classmethod
    def zeros(
        cls,
        cfg: ModelConfig,
        slots: int,
        num_pages: int,
        page_size: int,
        max_pages: int,
        layers: int | None = None,
        combined: bool = False,
    ) -> PagedKVCache:
        """Empty pools for `layers` layers (None: every layer of `cfg`; a hybrid model's full layers only), in the
        combined layout or the split one (`page_pool.uses_combined_pages`)."""
        layers = cfg.num_layers if layers is None else layers
        return cls(
            pools=tuple(empty_pool(cfg, num_pages, page_size, combined) for _ in range(layers)),
            page_table=jnp.full((slots, max_pages), num_pages, jnp.int32),
        )

    @property
    def num_pages(self) -> int:
        return self.pools[0].num_pages

    @property
    def page_size(self) -> int:
        return self.pools[0].page_size

    @property
    def pool_bytes(self) -> int:
        """Bytes of all the page pools (the page table not included)."""
        return sum(pool.nbytes for pool in self.pools)

    def insert(self, prefix: PrefixEntries, slots_B: jax.Array, pages_BxW: jax.Array) -> PagedKVCache:
        """This cache with prefix row b in slot slots_B[b]: its table row set to pages_BxW[b] (then no
        page), and its positions [0, W * page) written into those pages (entries past the prefix are
        zeros or garbage, masked until written). Out-of-range slots, and pages equal to P, are dropped."""
        p, page = self.num_pages, self.page_size
        b, w = pages_BxW.shape
        rows_BxM = jnp.full((b, self.page_table.shape[1]), p, jnp.int32).at[:, :w].set(pages_BxW)
        table = self.page_table.at[slots_B].set(rows_BxM, mode="drop")
        pad = w * page - prefix.length

        def pages_of(entries_BxTxKxH: jax.Array) -> jax.Array:  # [B, W, page, K, H]
            if pad > 0:
                entries_BxTxKxH = jnp.pad(entries_BxTxKxH, ((0, 0), (0, pad), (0, 0), (0, 0)))
            cut = entries_BxTxKxH[:, : w * page]
            return cut.reshape(b, w, page, *cut.shape[2:])

        pools = tuple(
            pool.put(pages_BxW, pages_of(prefix.k[y]), pages_of(prefix.v[y])) for y, pool in enumerate(self.pools)
        )
        return PagedKVCache(pools=pools, page_table=table)

    def update_table(self, updates_3xS: jax.Array) -> PagedKVCache:
        """Apply `PagedSlots.take_updates`: clear the marked rows, then write each slot's new page."""
        clear_S, column_S, page_S = updates_3xS[0], updates_3xS[1], updates_3xS[2]
        table = jnp.where(clear_S[:, None] != 0, self.num_pages, self.page_table)
        rows_S = jnp.arange(table.shape[0])
        return dataclasses.replace(self, page_table=table.at[rows_S, column_S].set(page_S, mode="drop"))

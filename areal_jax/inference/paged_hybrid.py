"""A paged engine's cache for either kind of model: the prefix a prefill makes, the decode state's cache, its
shardings and the decode step over it.

An attention model's is a `PagedKVCache` (`paged.py`), filled from `PrefixEntries`. A Qwen3.5 hybrid model's is a
`PagedHybridCache`: the same page pools and page table for its full-attention layers only (the generator hands out
the pages exactly as for an attention model), beside each slot's recurrent state [S, L, E, V] and convolution
window [S, W-1, A*J] per linear layer, kept as the dense cache keeps them (`slot_cache.py`):
  - prefill: `HybridPrefixEntries`, the full layers' keys and values as they come plus each row's state and window;
  - insert: the keys and values scattered into the slot's pages (`PagedKVCache.insert`), the state and window
    copied into the slot's row (`HybridCache.put_rows`): the n samples of one prompt each get their own copy;
  - decode: the full layers read and write the pools as a `Decoder`'s layers do (`models/paged_decode.py`), the
    linear ones move each slot's state and window on;
  - abort and free: the pages go back (the generator), the row is left as it is: the next insert replaces it;
  - interruption or preemption: a re-prefill under the current weights and an insert, so nothing made by older
    weights survives.

Legend: S slots, P pool pages, L linear value heads, E key dim, V value dim, A*J convolution channels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.inference.engine_config import EngineConfig
from areal_jax.inference.paged import PagedKVCache, PrefixEntries
from areal_jax.inference.slot_cache import recurrent_shardings
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.hybrid import HybridDecoder
from areal_jax.models.hybrid_serving import HybridCache
from areal_jax.models.page_pool import pool_sharding


def _engine_pools(cfg: ModelConfig, config: EngineConfig, combined: bool, layers: int | None = None) -> PagedKVCache:
    """`config`'s zero pools and page table for `layers` layers of `cfg` (None: all)."""
    pages, page, table = config.pool_pages, config.page_size, config.max_pages
    return PagedKVCache.zeros(cfg, config.max_slots, pages, page, table, layers=layers, combined=combined)


@flax.struct.dataclass
class HybridPrefixEntries:
    """A hybrid model's prefilled prompts for a paged engine: the full layers' keys and values (`PrefixEntries`,
    [Y, B, T, K, H] each) and each row's recurrent state and convolution window per linear layer."""

    kv: PrefixEntries
    state: tuple[jax.Array, ...]
    window: tuple[jax.Array, ...]

    @property
    def length(self) -> int:
        return self.kv.length


@flax.struct.dataclass
class PagedHybridCache:
    """A paged hybrid engine's decode cache: the full layers' page pools and page table (`PagedKVCache`) and,
    per linear layer, every slot's recurrent state [S, L, E, V] (fp32) and convolution window [S, W-1, A*J]."""

    kv: PagedKVCache
    state: tuple[jax.Array, ...]
    window: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, cfg: ModelConfig, config: EngineConfig, combined: bool) -> PagedHybridCache:
        hy = cfg.hybrid
        assert hy is not None  # a qwen3_5 model
        kv = _engine_pools(cfg, config, combined, layers=hy.count("full_attention"))
        recurrent = HybridCache.recurrent_zeros(cfg, config.max_slots)
        return cls(kv=kv, state=recurrent.state, window=recurrent.window)

    @property
    def recurrent(self) -> HybridCache:
        """The states and windows as a `HybridCache` without keys and values."""
        return HybridCache(kv=None, state=self.state, window=self.window)

    @property
    def pool_bytes(self) -> int:
        """Bytes of the full layers' page pools."""
        return self.kv.pool_bytes

    def insert(self, prefix: HybridPrefixEntries, slots_B: jax.Array, pages_BxW: jax.Array) -> PagedHybridCache:
        """Prefix row b in slot slots_B[b]: its keys and values into the pages pages_BxW[b], its states and windows
        into the slot's row (out-of-range slots, and pages equal to P, dropped)."""
        prefix_recurrent = HybridCache(kv=None, state=prefix.state, window=prefix.window)
        recurrent = self.recurrent.put_rows(prefix_recurrent, slots_B)
        return PagedHybridCache(
            kv=self.kv.insert(prefix.kv, slots_B, pages_BxW), state=recurrent.state, window=recurrent.window
        )

    def update_table(self, updates_3xS: jax.Array) -> PagedHybridCache:
        """`PagedKVCache.update_table` (the states and windows do not change)."""
        return dataclasses.replace(self, kv=self.kv.update_table(updates_3xS))


PagedCache = PagedKVCache | PagedHybridCache
PagedPrefix = PrefixEntries | HybridPrefixEntries
PAGED_CACHES = (PagedKVCache, PagedHybridCache)  # for isinstance


def empty_paged_cache(model: ModelConfig, config: EngineConfig, combined: bool) -> PagedCache:
    """The zero paged cache of `config` for `model`, its pools in the combined layout or the split one
    (`page_pool.uses_combined_pages`): an attention model's pools, or a hybrid model's."""
    if model.hybrid is None:
        return _engine_pools(model, config, combined)
    return PagedHybridCache.zeros(model, config, combined)


def paged_prefill(
    model: Decoder, tokens_BxT: jax.Array, lengths_B: jax.Array
) -> tuple[jax.Array, PagedPrefix, jax.Array | None]:
    """Right-padded prompts: logits [B, V], the prefix a paged insert takes and each position's experts (None
    without a mixture of experts)."""
    if isinstance(model, HybridDecoder):
        logits_BxV, k, v, recurrent, routing = model.prefill_recurrent_entries(tokens_BxT, lengths_B)
        assert k is not None and v is not None  # full layers: `slot_cache.check_cache_layout`
        prefix = HybridPrefixEntries(kv=PrefixEntries(k=k, v=v), state=recurrent.state, window=recurrent.window)
        return logits_BxV, prefix, routing
    logits_BxV, k, v, routing = model.prefill_entries_routed(tokens_BxT, lengths_B)
    return logits_BxV, PrefixEntries(k=k, v=v), routing


def paged_insert(cache: PagedCache, prefix: Any, slots_B: jax.Array, pages_BxW: jax.Array) -> PagedCache:
    """`cache.insert` of a prefix of its kind (`HybridPrefixEntries` for a `PagedHybridCache`, else `PrefixEntries`)."""
    if isinstance(cache, PagedHybridCache):
        assert isinstance(prefix, HybridPrefixEntries)  # a hybrid model's prefill
        return cache.insert(prefix, slots_B, pages_BxW)
    assert isinstance(prefix, PrefixEntries)  # an attention model's prefill
    return cache.insert(prefix, slots_B, pages_BxW)


def paged_decode(
    model: Decoder,
    tokens_B: jax.Array,
    positions_B: jax.Array,
    cache: PagedCache,
    attend_pages: int,
    layer_states: Sequence[nnx.State] | None,
) -> tuple[jax.Array, PagedCache, jax.Array | None]:
    """One token per slot over a paged cache (its page table already updated): logits [B, V], the cache and each
    fed token's experts (None without a mixture of experts)."""
    if isinstance(cache, PagedHybridCache):
        assert isinstance(model, HybridDecoder)  # a hybrid model's cache
        kv = cache.kv
        logits_BxV, pools, recurrent, routing = model.decode_step_paged_recurrent(
            tokens_B, positions_B, kv.pools, kv.page_table, attend_pages, cache.recurrent, layer_states
        )
        moved = dataclasses.replace(kv, pools=pools)
        return logits_BxV, PagedHybridCache(kv=moved, state=recurrent.state, window=recurrent.window), routing
    logits_BxV, pools, routing = model.decode_step_paged_routed(
        tokens_B, positions_B, cache.pools, cache.page_table, attend_pages, layer_states
    )
    return logits_BxV, dataclasses.replace(cache, pools=pools), routing


def paged_cache_shardings(model: ModelConfig, config: EngineConfig, mesh: Mesh, combined: bool) -> PagedCache:
    """Where a paged cache's arrays live on `mesh`: the pools split over KV heads like the attention weights
    (replicated along the other axes: any slot may hold any page; `page_pool.pool_sharding`), the page table
    replicated; a hybrid model's states and windows as the dense cache's (`slot_cache.recurrent_shardings`)."""
    pools: Any = pool_sharding(model, combined, mesh)  # a pytree prefix: one sharding for every layer's pool
    kv = PagedKVCache(pools=pools, page_table=NamedSharding(mesh, PartitionSpec()))  # type: ignore[arg-type]
    if model.hybrid is None:
        return kv
    recurrent = recurrent_shardings(model, config.max_slots, mesh)
    return PagedHybridCache(kv=kv, state=recurrent.state, window=recurrent.window)

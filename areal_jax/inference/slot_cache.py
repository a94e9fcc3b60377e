"""What a dense engine's decode state keeps per slot, whatever the model: a `SlotCache`.

Two caches satisfy it: the attention `KVCache` (`models/decoder.py`: keys and values per layer) and the Qwen3.5
`HybridCache` (`models/hybrid_serving.py`: per linear-attention layer a recurrent state and a convolution window,
beside a `KVCache` for the full-attention layers). The engine treats them alike:
  - prefill: `model.prefill(tokens, lengths, first_segment)` makes a prefix cache of the model's kind;
  - insert: `cache.put_rows(prefix, slots)` replaces each chosen slot's row (state, window and the prefix's
    keys/values), so the n samples of one prompt are n copies of its prefix;
  - decode: `model.decode_step(tokens, positions, cache, attend_length, layers)` moves every slot on by one token;
  - abort and free: nothing to clear, the next insert into the slot replaces its row;
  - interruption (new weights mid-generation): the generator re-prefills prompt + tokens so far under the new
    weights and inserts that, so no state made by the old weights survives.

A paged engine (`kv_cache: paged`, `paged.py`) keeps keys and values in pages instead; for a hybrid model only its
full-attention layers' (`paged_hybrid.py`): the recurrent states and windows stay per slot as here (one fixed-size
array per slot, which pages would not shrink), inserted, decoded, left behind by an abort and replaced by a
re-prefill in the same way. A hybrid model without full-attention layers has nothing to page: `kv_cache: paged` is
refused for it (`check_cache_layout`).

Legend: S slots, T cache length, L linear value heads, E key dim, V value dim, A*J convolution channels.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
from jax.sharding import Mesh, NamedSharding

from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import KEY_CACHE_AXES, VALUE_CACHE_AXES, KVCache
from areal_jax.models.hybrid_serving import HybridCache
from areal_jax.sharding import logical_to_spec

# Logical axes of a slot's recurrent state [S, L, E, V] (split over value heads, like the layer's decays) and of
# its convolution window [S, W-1, A*J] (small: split over slots only).
STATE_AXES = ("slots", "heads", None, None)
WINDOW_AXES = ("slots", None, None)

PAGED_REFUSAL = (
    "a qwen3_5 model without full-attention layers keeps no keys and values to page (only a recurrent state and "
    "convolution window per slot); use kv_cache: dense"
)


class SlotCache(Protocol):
    """A decode cache of `batch` rows (slots); see the module docstring."""

    @property
    def batch(self) -> int: ...

    @property
    def length(self) -> int: ...

    def put_rows(self, prefix: Any, rows_B: jax.Array) -> Any:
        """This cache with `prefix` (a cache of the same kind) row b as row rows_B[b], out-of-range rows dropped."""
        ...


def pages_nothing(model: ModelConfig) -> bool:
    """Whether `model` has no layer that a paged cache would hold (a hybrid model of linear layers only)."""
    return model.hybrid is not None and not model.hybrid.count("full_attention")


def check_cache_layout(model: ModelConfig, paged: bool) -> None:
    """Refuse a paged cache for a model with no keys and values to page (ValueError: `PAGED_REFUSAL`)."""
    if paged and pages_nothing(model):
        raise ValueError(PAGED_REFUSAL)


def empty_cache(model: ModelConfig, slots: int, length: int, first_segment: int | None) -> KVCache | HybridCache:
    """The zero cache of `slots` rows for `model`, its keys and values `length` long in segments from
    `first_segment`."""
    kind = KVCache if model.hybrid is None else HybridCache
    return kind.zeros(model, slots, length, first_segment)


def cache_shardings(model: ModelConfig, batch: int, length: int, mesh: Mesh) -> KVCache | HybridCache:
    """Where a cache's arrays live on `mesh` (KV heads split like the attention weights, recurrent states over
    value heads, every part over slots): a pytree prefix of any cache of `batch` rows however segmented."""
    k, h = model.num_kv_heads, model.resolved_head_dim
    key = NamedSharding(mesh, logical_to_spec(KEY_CACHE_AXES, (batch, k, h, length), mesh))
    value = NamedSharding(mesh, logical_to_spec(VALUE_CACHE_AXES, (batch, k, length, h), mesh))
    kv: Any = KVCache(k=key, v=value)  # type: ignore[arg-type]  # a pytree of shardings, shaped like a KVCache
    hy = model.hybrid
    if hy is None:
        return kv
    return dataclasses.replace(recurrent_shardings(model, batch, mesh), kv=kv if hy.count("full_attention") else None)


def recurrent_shardings(model: ModelConfig, batch: int, mesh: Mesh) -> HybridCache:
    """Where the recurrent part of a hybrid model's cache (kv None) of `batch` rows lives on `mesh`: each state
    over slots and value heads, each window over slots."""
    hy = model.hybrid
    assert hy is not None  # a qwen3_5 model
    state_shape = (batch, hy.linear_num_value_heads, hy.linear_key_head_dim, hy.linear_value_head_dim)
    window_shape = (batch, hy.conv_kernel - 1, hy.linear_num_key_heads * hy.group_width)
    return HybridCache(
        kv=None,
        state=NamedSharding(mesh, logical_to_spec(STATE_AXES, state_shape, mesh)),  # type: ignore[arg-type]
        window=NamedSharding(mesh, logical_to_spec(WINDOW_AXES, window_shape, mesh)),  # type: ignore[arg-type]
    )

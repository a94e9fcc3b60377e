"""A layer's page pool in one of two layouts, each the one a JAX Pallas TPU kernel reads in place
(`paged_attention.py`):
  - `SplitPages`: keys and values each [K, P, page, H] (`paged_attention`'s). The reference attention reads it
    a little faster on CPU (paged_vs_dense --quick 0.89-0.90 against 0.85-0.88 in the combined layout).
  - `CombinedPages`: one [P, page, 2K, H], head k's key at 2k and its value at 2k + 1 (`ragged_paged_attention`'s).
`uses_combined_pages` picks one, once, when a cache is made (`rollout.engine.page_layout`): converting a pool from
one to the other would copy all of it every step.

Both take the same writes: one token per slot (`write`, a decode step) and whole pages of a prefix (`put`, an
insert); a page id past the pool is dropped.

Legend: B slots or prefix rows, W pages per row, C pages per block, K kv heads, N query heads, H head dim,
P pool pages.
"""

from __future__ import annotations

from typing import Any, Literal

import flax.struct
import jax
import jax.numpy as jnp

from areal_jax.activation_sharding import mesh_platform
from areal_jax.configuration import ConfigError
from areal_jax.models.config import DTYPES, ModelConfig
from areal_jax.models.paged_attention import (
    kv_head_shards,
    kv_heads_spec,
    ragged_kernel_applies,
    split_kernel_applies,
    tpu_paged_decode_attention,
    tpu_ragged_decode_attention,
    xla_paged_decode_attention,
)

PageLayout = Literal["auto", "split", "combined"]


@flax.struct.dataclass
class SplitPages:
    """Keys and values each [K, P, page, H]."""

    k: jax.Array
    v: jax.Array

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[0]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def gather(self, pages_BxC: jax.Array) -> tuple[jax.Array, jax.Array]:
        k, b, tokens, h = self.kv_heads, pages_BxC.shape[0], pages_BxC.shape[1] * self.page_size, self.k.shape[3]
        keys = self.k.at[:, pages_BxC].get(mode="promise_in_bounds").reshape(k, b, tokens, h)
        values = self.v.at[:, pages_BxC].get(mode="promise_in_bounds").reshape(k, b, tokens, h)
        return keys, values

    def write(self, page_B: jax.Array, offset_B: jax.Array, k_BxKxH: jax.Array, v_BxKxH: jax.Array) -> SplitPages:
        return SplitPages(
            k=self.k.at[:, page_B, offset_B].set(k_BxKxH.swapaxes(0, 1).astype(self.k.dtype), mode="drop"),
            v=self.v.at[:, page_B, offset_B].set(v_BxKxH.swapaxes(0, 1).astype(self.v.dtype), mode="drop"),
        )

    def put(self, pages_BxW: jax.Array, k_BxWxPagexKxH: jax.Array, v_BxWxPagexKxH: jax.Array) -> SplitPages:
        def heads_first(entries: jax.Array) -> jax.Array:  # [K, B, W, page, H]
            return entries.transpose(3, 0, 1, 2, 4).astype(self.k.dtype)

        return SplitPages(
            k=self.k.at[:, pages_BxW].set(heads_first(k_BxWxPagexKxH), mode="drop"),
            v=self.v.at[:, pages_BxW].set(heads_first(v_BxWxPagexKxH), mode="drop"),
        )

    def attend(self, q_Bx1xNxH: jax.Array, pages_BxM: jax.Array, positions_B: jax.Array) -> jax.Array:
        if mesh_platform() == "tpu" and split_kernel_applies(self.k.shape[3], self.page_size):
            return tpu_paged_decode_attention(q_Bx1xNxH, self.k, self.v, pages_BxM, positions_B)
        return xla_paged_decode_attention(q_Bx1xNxH, self, pages_BxM, positions_B)


@flax.struct.dataclass
class CombinedPages:
    """Keys and values in one [P, page, 2K, H]: head k's key at 2k, its value at 2k + 1."""

    kv: jax.Array

    @property
    def num_pages(self) -> int:
        return self.kv.shape[0]

    @property
    def page_size(self) -> int:
        return self.kv.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.kv.shape[2] // 2

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    def gather(self, pages_BxC: jax.Array) -> tuple[jax.Array, jax.Array]:
        b, tokens, h = pages_BxC.shape[0], pages_BxC.shape[1] * self.page_size, self.kv.shape[3]
        pages = self.kv.at[pages_BxC].get(mode="promise_in_bounds").reshape(b, tokens, self.kv_heads, 2, h)
        return pages[:, :, :, 0].transpose(2, 0, 1, 3), pages[:, :, :, 1].transpose(2, 0, 1, 3)

    def write(self, page_B: jax.Array, offset_B: jax.Array, k_BxKxH: jax.Array, v_BxKxH: jax.Array) -> CombinedPages:
        entries_BxCxH = _combine(k_BxKxH, v_BxKxH).astype(self.kv.dtype)
        return CombinedPages(kv=self.kv.at[page_B, offset_B].set(entries_BxCxH, mode="drop"))

    def put(self, pages_BxW: jax.Array, k_BxWxPagexKxH: jax.Array, v_BxWxPagexKxH: jax.Array) -> CombinedPages:
        entries = _combine(k_BxWxPagexKxH, v_BxWxPagexKxH).astype(self.kv.dtype)
        return CombinedPages(kv=self.kv.at[pages_BxW].set(entries, mode="drop"))

    def attend(self, q_Bx1xNxH: jax.Array, pages_BxM: jax.Array, positions_B: jax.Array) -> jax.Array:
        shards = kv_head_shards(self.kv_heads, jax.sharding.get_abstract_mesh())
        heads = (q_Bx1xNxH.shape[2] // shards, self.kv_heads // shards)
        if mesh_platform() == "tpu" and ragged_kernel_applies(*heads, self.kv.shape[3], self.kv.dtype):
            return tpu_ragged_decode_attention(q_Bx1xNxH, self.kv, pages_BxM, positions_B)
        return xla_paged_decode_attention(q_Bx1xNxH, self, pages_BxM, positions_B)


PagePool = SplitPages | CombinedPages


def _combine(k_xKxH: jax.Array, v_xKxH: jax.Array) -> jax.Array:
    """Keys and values [..., K, H] as combined heads [..., 2K, H] (key of head k at 2k, value at 2k + 1)."""
    return jnp.stack([k_xKxH, v_xKxH], axis=-2).reshape(*k_xKxH.shape[:-2], 2 * k_xKxH.shape[-2], k_xKxH.shape[-1])


def uses_combined_pages(layout: PageLayout, cfg: ModelConfig, platform: str, kv_shards: int = 1) -> bool:
    """`rollout.engine.page_layout` resolved for `cfg` on `platform`'s devices, its KV heads split over `kv_shards`
    of them: auto is combined exactly where the ragged kernel takes a shard's pool (TPU, head dim 128, heads it can
    tile), else split (the `paged_attention` kernel's, or the reference's elsewhere). An explicit `combined` the
    kernel cannot take on TPU is refused: the reference would then run over a layout XLA:TPU relays out whole."""
    heads = (cfg.num_heads // kv_shards, cfg.num_kv_heads // kv_shards)
    takes = ragged_kernel_applies(*heads, cfg.resolved_head_dim, DTYPES[cfg.compute_dtype_on(platform)])
    if layout == "combined" and platform == "tpu" and not takes:
        raise ConfigError(
            "rollout.engine.page_layout",
            f"'combined' needs JAX's ragged paged attention to take the pool on TPU (head dim 128 and a device's "
            f"{2 * heads[1]} combined KV heads tileable); this model has head dim {cfg.resolved_head_dim}: use "
            "'split' or 'auto'",
        )
    return layout == "combined" or (layout == "auto" and platform == "tpu" and takes)


def empty_pool(cfg: ModelConfig, num_pages: int, page_size: int, combined: bool) -> PagePool:
    """A layer's zero pool of `num_pages` pages of `page_size` tokens in the compute dtype."""
    k, h, dtype = cfg.num_kv_heads, cfg.resolved_head_dim, cfg.compute_jnp_dtype
    if combined:
        return CombinedPages(kv=jnp.zeros((num_pages, page_size, 2 * k, h), dtype))
    shape = (k, num_pages, page_size, h)
    return SplitPages(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def pool_shard_shape(cfg: ModelConfig, num_pages: int, page_size: int, combined: bool, mesh: Any) -> tuple[int, ...]:
    """One device's share of one array of a layer's pool (split: of each of the two): only the KV heads are split
    (over `tensor`, like the attention weights, where it divides them); a combined pool's shard holds whole heads,
    each key beside its value."""
    k, h = cfg.num_kv_heads, cfg.resolved_head_dim
    shards = kv_head_shards(k, mesh)
    return (num_pages, page_size, 2 * k // shards, h) if combined else (k // shards, num_pages, page_size, h)


def pool_sharding(cfg: ModelConfig, combined: bool, mesh: Any) -> jax.NamedSharding:
    """Where every array of every layer's pool lives on `mesh` (one sharding, a pytree prefix of the pools): split
    over KV heads only (`kv_heads_spec`), replicated along the other axes (any slot may hold any page)."""
    heads = kv_heads_spec(cfg.num_kv_heads, mesh)
    spec = (None, None, heads, None) if combined else (heads, None, None, None)
    return jax.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))

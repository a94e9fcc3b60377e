"""An inference engine's capacity: its slots and cache length, the prefill length and row buckets, and the
KV cache's layout (dense, or paged and its page pool)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from areal_jax.configuration import Config, ConfigError, option
from areal_jax.inference.paged import PagedSlots, pages_for
from areal_jax.models.decoder import segment_ends
from areal_jax.models.page_pool import PageLayout


@dataclasses.dataclass(frozen=True)
class EngineConfig(Config):
    """Capacity of the engine."""

    max_slots: int = option(32, ge=1, doc="concurrent sequences (decode batch)")
    max_length: int = option(1024, ge=2, doc="cache length per slot: prompt + generated tokens at most")
    min_prefill_bucket: int = option(16, ge=1, doc="shortest prefill length bucket")
    max_prefill_batch: int = option(16, ge=1, doc="prompts prefilled together in one call at most")
    row_bucket_growth: int = option(
        2, ge=2, doc="batched prefill/insert rows are padded to powers of this (fewer programs vs less padding)"
    )
    decode_layer_copies: Literal["auto", "on", "off"] = option(
        "auto",
        doc="keep each layer's weights a second time as separate arrays, which the decode step reads in place "
        "(XLA:CPU copies a layer's slice of the stacked weights on every step: ~1.1 of 12 ms on a 3M model); "
        "doubles the engine's layer-weight memory. auto: on for CPU devices only",
    )

    kv_cache: Literal["dense", "paged"] = option(
        "dense",
        doc="dense: max_slots x max_length per layer; paged: pages of page_size tokens from a pool of num_pages, "
        "handed to sequences as they grow (memory follows the tokens in flight)",
    )
    page_size: int = option(16, ge=1, le=1024, doc="tokens per page of the paged KV cache")
    num_pages: int | None = option(
        None,
        ge=1,
        doc="pages in the paged KV cache's pool; null = max_slots x ceil(max_length / page_size), the dense "
        "footprint; at least ceil(max_length / page_size), so one sequence of max_length always fits",
    )
    page_layout: PageLayout = option(
        "auto",
        doc="the paged pools' layout, each read in place by one of JAX's TPU kernels: split (keys and values each "
        "[K, P, page, H]: paged_attention) or combined ([P, page, 2K, H]: ragged_paged_attention, head dim 128 "
        "only); auto: combined on TPU where the ragged kernel takes the pool, else split",
    )

    @property
    def paged(self) -> bool:
        return self.kv_cache == "paged"

    def fits_prompt(self, length: int) -> bool:
        """Whether a prompt (a turn's whole context included) of `length` tokens fits a slot: at least one
        token, and room for one generated token after it."""
        return 0 < length < self.max_length

    def fits_sample(self, prompt_tokens: int, new_tokens: int) -> bool:
        """Whether the longest prompt with the most new tokens fits a slot's `max_length`."""
        return prompt_tokens + new_tokens <= self.max_length

    @property
    def max_pages(self) -> int:
        """Pages one slot of max_length tokens needs (the page table's width)."""
        return pages_for(self.max_length, self.page_size)

    @property
    def pool_pages(self) -> int:
        """The paged pool's size, num_pages resolved."""
        return self.max_slots * self.max_pages if self.num_pages is None else self.num_pages

    def insert_pages(self, prefix_length: int) -> int:
        """Page-table entries an insert of a prefix bucket `prefix_length` long writes: its pages plus the
        one holding the first decoded position."""
        return min(pages_for(prefix_length + 1, self.page_size), self.max_pages)

    def page_slots(self) -> PagedSlots:
        """A fresh host-side page allocator for a decode state of this config (kv_cache: paged)."""
        return PagedSlots(self.max_slots, self.pool_pages, self.page_size, self.max_pages)

    def keeps_layer_copies(self, platform: str) -> bool:
        """Whether an engine on devices of `platform` keeps the per-layer weight copies."""
        return self.decode_layer_copies == "on" or (self.decode_layer_copies == "auto" and platform == "cpu")

    def validate(self) -> None:
        if self.min_prefill_bucket > self.max_length:
            raise ConfigError(
                "min_prefill_bucket", f"value {self.min_prefill_bucket} exceeds max_length={self.max_length}"
            )
        if self.num_pages is not None and self.num_pages < self.max_pages:
            raise ConfigError(
                "num_pages",
                f"value {self.num_pages} is below ceil(max_length / page_size) = {self.max_pages}: one sequence of "
                f"max_length={self.max_length} must fit (allowed: >= {self.max_pages}, or null)",
            )

    def row_buckets(self, cap: int) -> tuple[int, ...]:
        """Batch sizes a batched prefill or insert is padded to: powers of row_bucket_growth below `cap`,
        then `cap`."""
        sizes, size = [], 1
        while size < cap:
            sizes.append(size)
            size *= self.row_bucket_growth
        return (*sizes, cap)

    def prefill_buckets(self) -> tuple[int, ...]:
        """Power-of-two prefill lengths from min_prefill_bucket up to max_length (which is always one); also
        where the decode cache's segments end, so a bucket's prefill fills whole segments."""
        return segment_ends(self.max_length, 1 << (self.min_prefill_bucket - 1).bit_length())

"""The inference engine with JetStream's Engine API shape: prefill, insert, generate over a slot KV cache.

- `prefill(params, padded_tokens, true_length)` runs one prompt (padded to a power-of-two bucket, so a
  new prompt length never compiles a new program) and returns a `Prefix`: its KV cache and the logits
  of its last token.
- `insert(prefix, decode_state, slot, sampling, key)` copies the prefix into a slot of the decode
  state and samples the slot's first token from the prefix logits. The n samples of one prompt share a
  prefill: its prefix is inserted into n slots, each with its own key.
- `generate(params, decode_state)` feeds every slot's pending token at its position (writing its K/V in
  place; the decode state is donated), samples each slot's next token, and returns the tokens it fed
  with their behaviour log-probs. A slot's first `generate` thus emits the token sampled at insert.

With a mixture of experts, prefill also returns every prompt position's experts and `generate` those of each
token it feeds ([Ym, K] per token, Ym sparse layers, `routing_dtype`): what routing replay trains with.

The cache is dense (`kv_cache: dense`: [slots, max_length] per layer, whatever the tokens in flight; for a
Qwen3.5 model also a recurrent state and convolution window per slot and linear layer: `slot_cache.py`, the
protocol both kinds of dense cache follow) or paged (`kv_cache: paged`, `paged.py`): pages of `page_size` tokens
from one pool, a page table per slot; for a Qwen3.5 model its full-attention layers' keys and values in pages and
the states and windows per slot (`paged_hybrid.py`). A paged engine's `insert_batch` takes each row's pages and
its `generate` the step's page-table changes; the caller (the generator) owns the allocator.

The decoder's logits arrive with ids past the model's `vocab_limit` masked, so no slot ever samples
an id the tokenizer cannot decode. Params are versioned (`VersionedParams`); the version is host-side
bookkeeping for the generator. `load_params` makes the engine's own copy of each version (`engine_weights.py`),
`warmup` compiles every program ahead of the first request (`engine_warmup.py`). The engine's capacity and
cache layout: `EngineConfig` (`engine_config.py`).
Legend: S slots, T cache length, V vocab, Y layers, K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from areal_jax.activation_sharding import on_mesh
from areal_jax.inference.engine_config import EngineConfig
from areal_jax.inference.engine_warmup import compile_programs
from areal_jax.inference.engine_weights import EngineWeights, VersionedParams
from areal_jax.inference.paged import PagedSlots, pages_for
from areal_jax.inference.paged_hybrid import (
    PAGED_CACHES,
    PagedCache,
    PagedPrefix,
    empty_paged_cache,
    paged_cache_shardings,
    paged_decode,
    paged_insert,
    paged_prefill,
)
from areal_jax.inference.sampling import SamplingParams, sample_slots
from areal_jax.inference.slot_cache import SlotCache, cache_shardings, check_cache_layout, empty_cache
from areal_jax.models.decoder import Decoder, KVCache
from areal_jax.models.hybrid import HybridDecoder
from areal_jax.models.page_pool import uses_combined_pages
from areal_jax.models.paged_attention import kv_head_shards
from areal_jax.sharding import logical_to_spec, state_shardings

logger = logging.getLogger(__name__)


@flax.struct.dataclass
class Prefix:
    """One prefilled prompt: its cache (1 row of length Tb), the last prompt token's logits [V] and the
    length."""

    cache: SlotCache | PagedPrefix  # a paged engine's prefill makes a `PagedPrefix` (its `insert` refuses them)
    logits: jax.Array
    length: jax.Array


@flax.struct.dataclass
class PrefixBatch:
    """Several prefilled prompts of one length bucket: cache (B rows of length Tb; a paged engine's
    a `PagedPrefix`), logits [B, V], lengths [B]."""

    cache: SlotCache | PagedPrefix
    logits: jax.Array
    lengths: jax.Array
    routing: jax.Array | None = None  # [B, Tb, Ym, K] each position's experts (a mixture of experts; else None)


@flax.struct.dataclass
class DecodeState:
    """Everything a decode step reads and writes, one row per slot."""

    cache: SlotCache | PagedCache  # dense: S rows of length T (`slot_cache.py`); paged: `paged_hybrid.py`
    positions: jax.Array  # [S] where the pending token is written next
    tokens: jax.Array  # [S] the pending (sampled, not yet fed) token
    logprobs: jax.Array  # [S] its behaviour log-prob
    keys: jax.Array  # [S, 2] uint32 key data of each slot's stream
    temperature: jax.Array  # [S]
    top_k: jax.Array  # [S]
    top_p: jax.Array  # [S]


@flax.struct.dataclass
class ResultTokens:
    """What one generate step emitted: per slot the token fed and its behaviour log-prob."""

    tokens: jax.Array  # [S]
    logprobs: jax.Array  # [S]
    routing: jax.Array | None = None  # [S, Ym, K] the experts each fed token was routed to (mixture of experts)


def bucket_for(length: int, buckets: tuple[int, ...]) -> int:
    for size in buckets:
        if length <= size:
            return size
    raise ValueError(f"length {length} exceeds the largest prefill bucket {buckets[-1]}")


class Engine:
    """Prefill / insert / generate over one model, on an inference mesh (or one device)."""

    def __init__(self, model: Decoder, config: EngineConfig, mesh: Mesh | None = None):
        check_cache_layout(model.config, config.paged)
        self.model_config = model.config
        self.config = config
        self.mesh = mesh
        self.graphdef, state = nnx.split(model)
        # Without a mesh everything is committed to one device, so the arguments of every call carry the
        # same shardings and a warmed-up program is never compiled again for a fresh decode state.
        self.device = jax.local_devices()[0] if mesh is None else None
        self.param_shardings = (
            state_shardings(state, mesh) if mesh is not None else jax.tree.map(lambda _: self._single(), state)
        )
        self.buckets = config.prefill_buckets()
        platform = (jax.local_devices()[0] if mesh is None else mesh.devices.flat[0]).platform
        self.layer_copies = config.keeps_layer_copies(platform)
        kv_shards = kv_head_shards(model.config.num_kv_heads, mesh)
        self.combined_pages = uses_combined_pages(config.page_layout, model.config, platform, kv_shards)
        if platform == "cpu" and self.model_config.compute_dtype == "bfloat16":
            logger.warning(
                "model.compute_dtype is bfloat16 on CPU: XLA:CPU converts bf16 matmul operands to f32, so every "
                "engine program writes an f32 copy of the weights (%.2f GiB) and decodes several times slower than "
                "in float32 (benchmarks/cpu_compute_dtype.py); compute_dtype auto chooses float32 here",
                self.model_config.num_params() * 4 / 2**30,
            )
        self._decode_shardings = self._make_decode_shardings()
        self.prefill_rows = config.row_buckets(min(config.max_prefill_batch, config.max_slots))
        # The host reads each step's tokens on process 0: over a mesh of several processes they are
        # replicated (the emitted arrays are [S], tiny next to the step).
        spans_processes = mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1
        emitted_sharding = NamedSharding(mesh, PartitionSpec()) if mesh is not None and spans_processes else None
        self._prefill = on_mesh(jax.jit(self._prefill_impl), mesh)
        self._prefill_batch = on_mesh(jax.jit(self._prefill_batch_impl), mesh)
        self._insert = on_mesh(
            jax.jit(self._insert_impl, donate_argnums=(1,), out_shardings=self._decode_shardings), mesh
        )
        self._insert_batch = on_mesh(
            jax.jit(self._insert_batch_impl, donate_argnums=(1,), out_shardings=self._decode_shardings), mesh
        )

        def decode_program(impl: Any, attend_argnum: int) -> Any:
            """A decode step: the decode state donated, the attended length static."""
            shardings = (self._decode_shardings, emitted_sharding)
            jitted = jax.jit(impl, static_argnums=(attend_argnum,), donate_argnums=(2,), out_shardings=shardings)
            return on_mesh(jitted, mesh)

        self._generate = decode_program(self._generate_impl, 3)
        self._generate_paged = decode_program(self._generate_paged_impl, 4)
        self._weights = EngineWeights(self.graphdef, state, self.model_config, self.param_shardings, self.layer_copies)
        self._init_decode_state = on_mesh(
            jax.jit(self._init_decode_state_impl, out_shardings=self._decode_shardings), mesh
        )
        # A paged step with no page-table change takes this no-op update: host data like every update, so
        # one program serves both.
        self._no_page_updates = PagedSlots.no_updates(config.max_slots, config.max_pages) if config.paged else None

    # -- JetStream Engine API ---------------------------------------------------------------------

    @property
    def max_concurrent_decodes(self) -> int:
        return self.config.max_slots

    @property
    def max_prefill_length(self) -> int:
        return self.config.max_length

    @property
    def samples_per_slot(self) -> int:
        return 1

    def load_params(self, state: nnx.State, version: int) -> VersionedParams:
        """The engine's own copy of `state` on its shardings, each weight in its serving dtype
        (`models.serving_weights`): one device-to-device copy (no host round trip; from devices that only
        partly overlap the engine's, a copy and then the move: `engine_weights.py`). It shares no buffer with
        `state`, which the caller may go on updating or donate as soon as this returns.

        With `model.lora`, a full state (the first version) also becomes the engine's base, kept once; a later
        version may carry only the adapters (`lora.is_adapter_only`): they are copied and served over that base,
        applied inside each projection's matmul (docs/lora.md: measured against merging them per version), so a
        version moves and stores only adapter bytes and every program keeps its shapes (nothing recompiles)."""
        return self._weights.load(state, version)

    def init_decode_state(self) -> DecodeState:
        return self._init_decode_state()

    def _init_decode_state_impl(self) -> DecodeState:
        cfg, s, c = self.model_config, self.config.max_slots, self.config
        cache: SlotCache | PagedCache
        if c.paged:
            cache = empty_paged_cache(cfg, c, self.combined_pages)
        else:
            cache = empty_cache(cfg, s, c.max_length, first_segment=self.buckets[0])
        return DecodeState(
            cache=cache,
            positions=jnp.zeros((s,), jnp.int32),
            tokens=jnp.zeros((s,), jnp.int32),
            logprobs=jnp.zeros((s,), jnp.float32),
            keys=jnp.zeros((s, 2), jnp.uint32),
            temperature=jnp.ones((s,), jnp.float32),
            top_k=jnp.zeros((s,), jnp.int32),
            top_p=jnp.ones((s,), jnp.float32),
        )

    def pad_tokens(self, tokens: list[int] | np.ndarray) -> tuple[np.ndarray, int]:
        """Right-pad a prompt to its bucket: (padded [Tb] int32, true length)."""
        n = len(tokens)
        if not self.config.fits_prompt(n):
            raise ValueError(f"prompt length {n} must be in [1, {self.config.max_length - 1}] (engine max_length)")
        padded = np.zeros(bucket_for(n, self.buckets), np.int32)
        padded[:n] = tokens
        return padded, n

    def prefill(self, params: VersionedParams, padded_tokens: np.ndarray, true_length: int) -> Prefix:
        # host arrays go to the program as they are (each jnp.asarray would compile a staging program per shape)
        return self._prefill(params.state, np.asarray(padded_tokens, np.int32), np.int32(true_length))

    def insert(
        self, prefix: Prefix, decode_state: DecodeState, slot: int, sampling: SamplingParams, key: jax.Array
    ) -> DecodeState:
        """Put `prefix` into `slot` and sample the slot's first token with `sampling` and `key` (dense
        engines: a paged insert needs its pages, `insert_batch`)."""
        if self.config.paged:
            raise ValueError("insert: a paged engine inserts through insert_batch(..., pages=...)")
        top_k = np.int32(sampling.top_k)
        return self._insert(
            prefix,
            decode_state,
            np.int32(slot),
            jax.random.key_data(key),
            np.float32(sampling.temperature),
            top_k,
            np.float32(sampling.top_p),
        )

    def prefill_batch(self, params: VersionedParams, prompts: Sequence[Sequence[int]]) -> PrefixBatch:
        """Prefill up to `max_prefill_batch` prompts of one length bucket in one call (rows padded to a
        row bucket; row i of the result is prompt i)."""
        if not 0 < len(prompts) <= self.prefill_rows[-1]:
            raise ValueError(f"{len(prompts)} prompts; a batched prefill takes 1..{self.prefill_rows[-1]}")
        padded = [self.pad_tokens(list(p)) for p in prompts]
        width = max(len(tokens) for tokens, _ in padded)
        rows = bucket_for(len(prompts), self.prefill_rows)
        tokens_BxT = np.zeros((rows, width), np.int32)
        lengths_B = np.ones(rows, np.int32)
        for row, (tokens, length) in enumerate(padded):
            tokens_BxT[row, :length] = tokens[:length]
            lengths_B[row] = length
        return self._prefill_batch(params.state, tokens_BxT, lengths_B)

    def insert_batch(
        self,
        prefixes: PrefixBatch,
        decode_state: DecodeState,
        slots: Sequence[int | None],
        samplings: Sequence[SamplingParams],
        key_data: np.ndarray,
        pages: Sequence[Sequence[int]] | None = None,
    ) -> DecodeState:
        """Insert row i of `prefixes` into slot `slots[i]` (None: leave row i out), sampling the slot's first
        token with `samplings[i]` and the PRNG key whose raw uint32 words are `key_data[i]` (host data, so no
        eager device op runs per request). A paged engine takes `pages[i]`: the pool pages of row i, in
        order, covering its prompt and first decoded position (at most `config.insert_pages(prefix bucket)`). The
        program depends only on the prefix batch's shape; the n samples of one prompt are n calls with the
        same `prefixes`."""
        rows = prefixes.logits.shape[0]
        n = len(slots)
        if not 0 < n <= rows or not len(samplings) == len(key_data) == n:
            raise ValueError(f"insert_batch takes 1..{rows} equally long slots/samplings/key_data, got {n}")
        if self.config.paged != (pages is not None) or (pages is not None and len(pages) != n):
            raise ValueError(f"insert_batch: pages are given for each of the {n} rows iff the engine is paged")
        pad = rows - n
        dropped = self.config.max_slots  # an out-of-range slot: the scatter drops that row
        slot_B = np.array([dropped if slot is None else slot for slot in slots] + [dropped] * pad, np.int32)
        key_data = np.concatenate([np.asarray(key_data, np.uint32).reshape(n, 2), np.zeros((pad, 2), np.uint32)])
        temperature = np.array([s.temperature for s in samplings] + [1.0] * pad, np.float32)
        top_k = np.array([s.top_k for s in samplings] + [0] * pad, np.int32)
        top_p = np.array([s.top_p for s in samplings] + [1.0] * pad, np.float32)
        if pages is None:
            return self._insert_batch(prefixes, decode_state, slot_B, key_data, temperature, top_k, top_p)
        width = self.config.insert_pages(prefixes.cache.length)
        pages_BxW = np.full((rows, width), self.config.pool_pages, np.int32)  # no page: written nowhere
        for row, (slot, row_pages) in enumerate(zip(slots, pages, strict=True)):
            if len(row_pages) > width:
                raise ValueError(f"row {row}: {len(row_pages)} pages, an insert of this bucket takes {width} at most")
            if slot is not None:
                pages_BxW[row, : len(row_pages)] = row_pages
        return self._insert_batch(prefixes, decode_state, slot_B, key_data, temperature, top_k, top_p, pages_BxW)

    def generate(
        self,
        params: VersionedParams,
        decode_state: DecodeState,
        max_position: int | None = None,
        page_updates: np.ndarray | None = None,
    ) -> tuple[DecodeState, ResultTokens]:
        """One decode step over all slots. `max_position` (host-side: the largest position any active slot
        writes this step) lets the step read only the cache segments (or pages) up to the bucket covering
        it. A paged engine applies `page_updates` (`PagedSlots.take_updates`; None: no change) to the page
        table before the step."""
        attend_length = None if max_position is None else bucket_for(max_position + 1, self.buckets)
        if attend_length == self.config.max_length:
            attend_length = None
        if not self.config.paged:
            if page_updates is not None:
                raise ValueError("generate: page_updates are for a paged engine")
            return self._generate(params.state, params.layers, decode_state, attend_length)
        attend = self.config.max_length if attend_length is None else attend_length
        updates = self._no_page_updates if page_updates is None else page_updates
        return self._generate_paged(
            params.state, params.layers, decode_state, updates, pages_for(attend, self.config.page_size)
        )

    def warmup(self, params: VersionedParams, single_prompt_api: bool = False) -> None:
        """Compile every program the generator can need (batched prefill and insert at each row and length
        bucket, generate at each cache-prefix bucket), so no request pays a compilation later. The
        one-prompt `prefill`/`insert` of the JetStream API are compiled too with `single_prompt_api`.

        The programs are compiled, not run (at real size on CPU running them all costs minutes), several at
        once (XLA compiles outside the GIL): one per CPU core, at most `engine_warmup.WARMUP_THREADS`."""
        compile_programs(self, params, single_prompt_api)

    # -- compiled bodies -----------------------------------------------------------------------

    def _single(self) -> SingleDeviceSharding:
        return SingleDeviceSharding(self.device)

    def _make_decode_shardings(self) -> DecodeState:
        slots, c = self.config.max_slots, self.config
        # shardings in place of the arrays: a pytree shaped like a DecodeState, not one
        cache: Any
        per_slot: Any
        keys: Any
        if self.mesh is None:
            cache = per_slot = keys = self._single()
        else:
            per_slot = NamedSharding(self.mesh, logical_to_spec(("slots",), (slots,), self.mesh))
            keys = NamedSharding(self.mesh, logical_to_spec(("slots", None), (slots, 2), self.mesh))
            if c.paged:
                cache = paged_cache_shardings(self.model_config, c, self.mesh, self.combined_pages)
            else:
                cache = cache_shardings(self.model_config, slots, self.config.max_length, self.mesh)
        return DecodeState(
            cache=cache,
            positions=per_slot,
            tokens=per_slot,
            logprobs=per_slot,
            keys=keys,
            temperature=per_slot,
            top_k=per_slot,
            top_p=per_slot,
        )

    def _prefill_batch_impl(self, state: nnx.State, tokens_BxT: jax.Array, lengths_B: jax.Array) -> PrefixBatch:
        model = nnx.merge(self.graphdef, state)
        routing = None
        cache: SlotCache | PagedPrefix
        if self.config.paged:  # the full layers' keys and values as they come (and a hybrid model's states)
            logits_BxV, cache, routing = paged_prefill(model, tokens_BxT, lengths_B)
        elif self.model_config.moe is not None and isinstance(model, HybridDecoder):  # qwen3_5_moe: a HybridCache
            logits_BxV, cache, routing = model.prefill_routed(tokens_BxT, lengths_B, self.buckets[0])
        elif self.model_config.moe is not None:
            logits_BxV, k, v, routing = model.prefill_entries_routed(tokens_BxT, lengths_B)
            cache = KVCache.from_entries(k, v, self.buckets[0])
        else:  # the model's own cache: a KVCache, or a hybrid model's HybridCache
            logits_BxV, cache = model.prefill(tokens_BxT, lengths_B, self.buckets[0])
        return PrefixBatch(cache=cache, logits=logits_BxV, lengths=lengths_B, routing=routing)

    def _prefill_impl(self, state: nnx.State, tokens_T: jax.Array, length: jax.Array) -> Prefix:
        batch = self._prefill_batch_impl(state, tokens_T[None, :], length[None])
        return Prefix(cache=batch.cache, logits=batch.logits[0], length=length)

    def _insert_impl(
        self,
        prefix: Prefix,
        ds: DecodeState,
        slot: jax.Array,
        key_data: jax.Array,
        temperature: jax.Array,
        top_k: jax.Array,
        top_p: jax.Array,
    ) -> DecodeState:
        batch = PrefixBatch(cache=prefix.cache, logits=prefix.logits[None], lengths=prefix.length[None])
        return self._insert_batch_impl(
            batch, ds, slot[None], key_data[None], temperature[None], top_k[None], top_p[None]
        )

    def _insert_batch_impl(
        self,
        batch: PrefixBatch,
        ds: DecodeState,
        slots_B: jax.Array,
        key_data_Bx2: jax.Array,
        temperature_B: jax.Array,
        top_k_B: jax.Array,
        top_p_B: jax.Array,
        pages_BxW: jax.Array | None = None,
    ) -> DecodeState:
        """Scatter prefix row b into slot slots_B[b] (out-of-range slots are dropped; paged: into the pages
        pages_BxW[b]) and sample each slot's first token from its prefix logits."""
        split = jax.vmap(lambda data: jax.random.split(jax.random.wrap_key_data(data)))(key_data_Bx2)
        tokens_B, logprobs_B = sample_slots(batch.logits, split[:, 1], temperature_B, top_k_B, top_p_B)

        def put(target: jax.Array, values: jax.Array) -> jax.Array:
            return target.at[slots_B].set(values, mode="drop")

        cache: SlotCache | PagedCache
        if pages_BxW is None:
            assert not isinstance(ds.cache, PAGED_CACHES) and type(batch.cache) is type(ds.cache)  # a dense engine's
            cache = ds.cache.put_rows(batch.cache, slots_B)
        else:
            assert isinstance(ds.cache, PAGED_CACHES)  # a paged engine's
            cache = paged_insert(ds.cache, batch.cache, slots_B, pages_BxW)
        return DecodeState(
            cache=cache,
            positions=put(ds.positions, batch.lengths),
            tokens=put(ds.tokens, tokens_B),
            logprobs=put(ds.logprobs, logprobs_B),
            keys=put(ds.keys, jax.vmap(jax.random.key_data)(split[:, 0])),
            temperature=put(ds.temperature, temperature_B),
            top_k=put(ds.top_k, top_k_B),
            top_p=put(ds.top_p, top_p_B),
        )

    def _generate_impl(
        self, state: nnx.State, layers: tuple[nnx.State, ...] | None, ds: DecodeState, attend_length: int | None
    ) -> tuple[DecodeState, ResultTokens]:
        model = nnx.merge(self.graphdef, state)
        # Idle or finished slots write harmlessly at a clamped position of their own row; their output
        # is ignored. Active slots are always below attend_length.
        limit = self.config.max_length if attend_length is None else attend_length
        positions = jnp.minimum(ds.positions, limit - 1)
        assert not isinstance(ds.cache, PAGED_CACHES)  # a dense engine's
        cache: Any = ds.cache  # the model's own kind: a KVCache, or a HybridDecoder's HybridCache
        routing = None
        if self.model_config.moe is None:
            logits_SxV, cache = model.decode_step(ds.tokens, positions, cache, attend_length, layers)
        else:
            logits_SxV, cache, routing = model.decode_step_routed(ds.tokens, positions, cache, attend_length, layers)
        split = jax.vmap(lambda data: jax.random.split(jax.random.wrap_key_data(data)))(ds.keys)
        next_keys, sample_keys = split[:, 0], split[:, 1]
        tokens, logprobs = sample_slots(logits_SxV, sample_keys, ds.temperature, ds.top_k, ds.top_p)
        emitted = ResultTokens(tokens=ds.tokens, logprobs=ds.logprobs, routing=routing)
        new_state = dataclasses.replace(
            ds,
            cache=cache,
            positions=ds.positions + 1,
            tokens=tokens,
            logprobs=logprobs,
            keys=jax.vmap(jax.random.key_data)(next_keys),
        )
        return new_state, emitted

    def _generate_paged_impl(
        self,
        state: nnx.State,
        layers: tuple[nnx.State, ...] | None,
        ds: DecodeState,
        page_updates_3xS: jax.Array,
        attend_pages: int,
    ) -> tuple[DecodeState, ResultTokens]:
        model = nnx.merge(self.graphdef, state)
        assert isinstance(ds.cache, PAGED_CACHES)  # a paged engine's
        cache = ds.cache.update_table(page_updates_3xS)
        # Idle slots' table rows have no page (their writes are dropped); their positions are clamped so
        # they index the table and the mask like any slot (a hybrid model's idle rows move their states on
        # harmlessly: the next insert replaces them).
        positions = jnp.minimum(ds.positions, attend_pages * self.config.page_size - 1)
        logits_SxV, cache, routing = paged_decode(model, ds.tokens, positions, cache, attend_pages, layers)
        split = jax.vmap(lambda data: jax.random.split(jax.random.wrap_key_data(data)))(ds.keys)
        next_keys, sample_keys = split[:, 0], split[:, 1]
        tokens, logprobs = sample_slots(logits_SxV, sample_keys, ds.temperature, ds.top_k, ds.top_p)
        emitted = ResultTokens(tokens=ds.tokens, logprobs=ds.logprobs, routing=routing)
        new_state = dataclasses.replace(
            ds,
            cache=cache,
            positions=ds.positions + 1,
            tokens=tokens,
            logprobs=logprobs,
            keys=jax.vmap(jax.random.key_data)(next_keys),
        )
        return new_state, emitted

"""The decoder (Flax NNX) and its three call paths over the same weights.

(a) `token_logprobs`: packed training/scoring rows (segment ids + positions) -> per-token log-probs of
    given targets, computed chunk by chunk so the full [T, V] logits never exist at once;
(b) `prefill`: right-padded prompts -> logits of each last prompt token and a fresh KV cache;
(c) `decode_step`: one token per slot against a slot-indexed KV cache, written in place
    (`decode_step_paged`: the same against a paged cache, `areal_jax/inference/paged.py`).

Layers are stacked along a leading "layers" axis. (a) and (b) run them with `lax.scan`, so their compile
time does not grow with depth; (c) unrolls them to read each layer's cache in place (see `KVCache`).
Every path masks the logits of embedding rows past the tokenizer (`vocab_limit`) with
`mask_padded_vocab`, so nothing samples them and every softmax is over the same usable ids.

Legend: B batch rows (or cache slots), T length, S cache length, D model width, V vocab,
Y layers, K key/value heads, H head dim, C chunk length, M = B * T positions, J chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.activation_sharding import ROW_AXES, constrain, put_rows_locally
from areal_jax.models.attention import get_attention
from areal_jax.models.config import ModelConfig
from areal_jax.models.layers import DecoderLayer, RMSNorm, _param
from areal_jax.models.lora import lora_rngs
from areal_jax.models.moe import RouterOutput, routing_dtype, sparse_layer_ids
from areal_jax.models.page_pool import PagePool
from areal_jax.models.paged_decode import PagedDecodeStep
from areal_jax.models.rope import inverse_frequencies, rope_tables

_REMAT_POLICIES: dict[str, Any] = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

# A finite stand-in for -inf: its exp underflows to exactly 0 in fp32, yet 0 * MASKED_LOGIT is 0 (in
# the entropy and in gradients), where 0 * -inf would be nan.
MASKED_LOGIT = -1e30


def mask_padded_vocab(logits_xV: jax.Array, usable_vocab: int) -> jax.Array:
    """`logits_xV` with every id >= `usable_vocab` set to MASKED_LOGIT; unchanged (no op) when nothing
    is padded."""
    if usable_vocab >= logits_xV.shape[-1]:
        return logits_xV
    ids_xV = jax.lax.broadcasted_iota(jnp.int32, logits_xV.shape, logits_xV.ndim - 1)
    return jnp.where(ids_xV < usable_vocab, logits_xV, MASKED_LOGIT)


# Logical axes of one cache segment. Keys are stored transposed ([B, K, H, S]) and values as [B, K, S, H],
# so both decode attention dots read the cache in place, with no transpose.
KEY_CACHE_AXES = ("slots", "kv_heads", "head_dim", "length")
VALUE_CACHE_AXES = ("slots", "kv_heads", "length", "head_dim")


def segment_ends(length: int, first: int | None = None) -> tuple[int, ...]:
    """Where the cache segments of a cache of `length` end: `first`, then doubling, then `length` (one
    segment when `first` is None or not below `length`)."""
    ends, end = [], first or length
    while end < length:
        ends.append(end)
        end *= 2
    return (*ends, length)


def _starts(ends: tuple[int, ...]) -> tuple[int, ...]:
    return (0, *ends[:-1])


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer, each layer's cut along the length into segments (B = batch rows or
    cache slots): k[y][j] [B, K, H, S_j] and v[y][j] [B, K, S_j, H] hold positions [start_j, end_j) (see
    `segment_ends`).

    Every array is read and written where it lies: XLA copies a slice of an array before a matmul reads
    it, so one stacked [Y, ...] array would be copied layer by layer, and reading a prefix of one long
    array would copy the prefix. The decode step reads the segments that cover the positions it attends
    to, whole."""

    k: tuple[tuple[jax.Array, ...], ...]
    v: tuple[tuple[jax.Array, ...], ...]

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, first_segment: int | None = None) -> KVCache:
        k, h, dtype = cfg.num_kv_heads, cfg.resolved_head_dim, cfg.compute_jnp_dtype
        ends = segment_ends(length, first_segment)
        sizes = [end - start for start, end in zip(_starts(ends), ends, strict=True)]
        return cls(
            k=tuple(tuple(jnp.zeros((batch, k, h, n), dtype) for n in sizes) for _ in range(cfg.num_layers)),
            v=tuple(tuple(jnp.zeros((batch, k, n, h), dtype) for n in sizes) for _ in range(cfg.num_layers)),
        )

    @classmethod
    def from_entries(cls, k_YxBxSxKxH: jax.Array, v_YxBxSxKxH: jax.Array, first_segment: int | None = None) -> KVCache:
        """The cache holding these per-position entries (the layout a layer scan produces)."""
        ends = segment_ends(k_YxBxSxKxH.shape[2], first_segment)
        spans = list(zip(_starts(ends), ends, strict=True))
        layers = range(k_YxBxSxKxH.shape[0])
        return cls(
            k=tuple(tuple(k_YxBxSxKxH[y, :, a:b].transpose(0, 2, 3, 1) for a, b in spans) for y in layers),
            v=tuple(tuple(v_YxBxSxKxH[y, :, a:b].transpose(0, 2, 1, 3) for a, b in spans) for y in layers),
        )

    @property
    def batch(self) -> int:
        return self.k[0][0].shape[0]

    @property
    def ends(self) -> tuple[int, ...]:
        """Where each segment ends."""
        ends, end = [], 0
        for segment in self.k[0]:
            end += segment.shape[-1]
            ends.append(end)
        return tuple(ends)

    @property
    def length(self) -> int:
        return self.ends[-1]

    def put_rows(self, prefix: KVCache, rows_B: jax.Array) -> KVCache:
        """This cache with `prefix` row b written at row rows_B[b], positions [0, prefix.length); rows out
        of range are dropped."""
        t = prefix.length
        spans = [(a, min(b, t)) for a, b in zip(_starts(self.ends), self.ends, strict=True) if a < t]

        def put(
            segments: tuple[jax.Array, ...], entries_BxKxT: jax.Array, axis: int, names: tuple[str, ...]
        ) -> tuple[jax.Array, ...]:
            written = []
            for segment, (a, b) in zip(segments, spans, strict=False):
                part = jax.lax.slice_in_dim(entries_BxKxT, a, b, axis=axis).astype(segment.dtype)
                at = (*[slice(None)] * (axis - 1), slice(0, b - a))
                written.append(put_rows_locally(segment, rows_B, part, names, at))
            return (*written, *segments[len(spans) :])

        return KVCache(
            k=tuple(
                put(c, jnp.concatenate(p, axis=3), 3, KEY_CACHE_AXES) for c, p in zip(self.k, prefix.k, strict=True)
            ),
            v=tuple(
                put(c, jnp.concatenate(p, axis=2), 2, VALUE_CACHE_AXES) for c, p in zip(self.v, prefix.v, strict=True)
            ),
        )


class Decoder(nnx.Module):
    """Qwen2 / Qwen3 / Llama-3 / Qwen3-MoE decoder-only language model."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.config = cfg
        with nnx.use_eager_sharding(False):
            self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg, cfg.initializer_range)

            @nnx.split_rngs(splits=cfg.num_layers)
            @nnx.vmap(in_axes=(0, 0), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_layers(layer_rngs: nnx.Rngs, layer_lora_rngs: nnx.Rngs | None) -> DecoderLayer:
                return DecoderLayer(cfg, layer_rngs, layer_lora_rngs)

            self.layers = make_layers(rngs, lora_rngs(cfg))
            self.final_norm = RMSNorm(cfg.hidden_size, cfg)
            self.lm_head = (
                None
                if cfg.tie_word_embeddings
                else _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg, cfg.initializer_range)
            )

    # -- shared pieces -------------------------------------------------------------------------

    def _rope(self, positions_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        inv_freq = inverse_frequencies(cfg.resolved_head_dim, cfg.rope_theta, cfg.rope_scaling)
        return rope_tables(positions_BxT, inv_freq)

    def _embed(self, tokens_BxT: jax.Array) -> jax.Array:
        return jnp.take(self.embed[...], tokens_BxT, axis=0).astype(self.config.compute_jnp_dtype)

    def head_kernel(self) -> jax.Array:
        """The [D, V] output projection (the transposed embedding when tied)."""
        kernel = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        return kernel.astype(self.config.compute_jnp_dtype)

    def _scan_layers(
        self, body: Callable[[Any, DecoderLayer, jax.Array], tuple[Any, Any]], carry: Any
    ) -> tuple[Any, Any]:
        """Run `body(carry, layer, layer_index)` over the stacked layers with `lax.scan` (unrolled unless
        `scans_layers()`)."""
        graphdef, state = nnx.split(self.layers)

        def step(carry: Any, xs: tuple[nnx.State, jax.Array]) -> tuple[Any, Any]:
            layer_state, index = xs
            return body(carry, nnx.merge(graphdef, layer_state), index)

        if self.config.remat != "none":
            step = jax.checkpoint(step, policy=_REMAT_POLICIES[self.config.remat])
        layers = (state, jnp.arange(self.config.num_layers))
        return jax.lax.scan(step, carry, layers, unroll=not self.config.scans_layers())

    def _run_rows(
        self,
        tokens_BxT: jax.Array,
        segment_ids_BxT: jax.Array,
        positions_BxT: jax.Array,
        keep_kv: bool,
        dropout_key: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """Every layer over rows masked by segment ids and positions (packed or right-padded): the last
        layer's output [B, T, D] (not normed) and, with `keep_kv`, each layer's keys/values [Y, B, T, K, H].
        With `dropout_key`, LoRA dropout (`lora.dropout`) on the adapters' inputs, a key per layer."""
        x_BxTxD, kv, _ = self._run_rows_routed(tokens_BxT, segment_ids_BxT, positions_BxT, keep_kv, dropout_key)
        return x_BxTxD, kv

    def _run_rows_routed(
        self,
        tokens_BxT: jax.Array,
        segment_ids_BxT: jax.Array,
        positions_BxT: jax.Array,
        keep_kv: bool,
        dropout_key: jax.Array | None = None,
        replay_BxTxYmxK: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None, RouterOutput | None]:
        """`_run_rows` and the sparse layers' routers (`RouterOutput`, fields [Ym, B, T, ...]; None when dense).
        With `replay_BxTxYmxK` (expert ids per sparse layer) every sparse layer routes each token to them."""
        attend = get_attention(self.config.attention_impl)
        sin, cos = self._rope(positions_BxT)
        sparse_ids = jnp.asarray(sparse_layer_ids(self.config), jnp.int32)
        replay_YxBxTxK = None
        if replay_BxTxYmxK is not None:
            b, t, _, k = replay_BxTxYmxK.shape
            replay_YxBxTxK = jnp.zeros((self.config.num_layers, b, t, k), jnp.int32)
            replay_YxBxTxK = replay_YxBxTxK.at[sparse_ids].set(jnp.moveaxis(replay_BxTxYmxK, 2, 0).astype(jnp.int32))

        def body(x_BxTxD: jax.Array, layer: DecoderLayer, index: jax.Array):
            key = None if dropout_key is None else jax.random.fold_in(dropout_key, index)
            q, k, v = layer.attention_inputs(x_BxTxD, sin, cos, key)
            q = constrain(q, (*ROW_AXES, "heads", None))
            k, v = (constrain(a, (*ROW_AXES, "kv_heads", None)) for a in (k, v))
            out = constrain(
                attend(q, k, v, segment_ids=segment_ids_BxT, positions=positions_BxT), (*ROW_AXES, "heads", None)
            )
            replay = None if replay_YxBxTxK is None else replay_YxBxTxK[index]
            x_BxTxD, router = layer.finish_routed(x_BxTxD, out, key, index, replay)
            x_BxTxD = constrain(x_BxTxD, (*ROW_AXES, None))
            return x_BxTxD, (((k, v) if keep_kv else None), router)

        x_BxTxD, (kv, router) = self._scan_layers(body, constrain(self._embed(tokens_BxT), (*ROW_AXES, None)))
        if router is not None:
            router = RouterOutput(*(jnp.take(field, sparse_ids, axis=0) for field in router))
        return x_BxTxD, kv, router

    # -- (a) packed forward -------------------------------------------------------------------

    def hidden_states(
        self,
        tokens_BxT: jax.Array,
        segment_ids_BxT: jax.Array,
        positions_BxT: jax.Array,
        dropout_key: jax.Array | None = None,
    ) -> jax.Array:
        """Final-normed hidden states [B, T, D] of packed rows (LoRA dropout with `dropout_key`)."""
        x_BxTxD, _ = self._run_rows(tokens_BxT, segment_ids_BxT, positions_BxT, keep_kv=False, dropout_key=dropout_key)
        return self.final_norm(x_BxTxD)

    def routed_hidden_states(
        self,
        tokens_BxT: jax.Array,
        segment_ids_BxT: jax.Array,
        positions_BxT: jax.Array,
        dropout_key: jax.Array | None = None,
        replay_BxTxYmxK: jax.Array | None = None,
    ) -> tuple[jax.Array, RouterOutput | None]:
        """`hidden_states` and the sparse layers' routers ([Ym, B, T, ...]), routed by `replay_BxTxYmxK` if given."""
        x_BxTxD, _, router = self._run_rows_routed(
            tokens_BxT, segment_ids_BxT, positions_BxT, False, dropout_key, replay_BxTxYmxK
        )
        return self.final_norm(x_BxTxD), router

    def logits(self, tokens_BxT: jax.Array, segment_ids_BxT: jax.Array, positions_BxT: jax.Array) -> jax.Array:
        """Full fp32 logits [B, T, V]; for tests and short inputs (training uses `token_logprobs`)."""
        h_BxTxD = self.hidden_states(tokens_BxT, segment_ids_BxT, positions_BxT)
        logits_BxTxV = jnp.einsum("btd,dv->btv", h_BxTxD, self.head_kernel(), preferred_element_type=jnp.float32)
        return mask_padded_vocab(logits_BxTxV, self.config.usable_vocab)

    def token_logprobs(
        self,
        tokens_BxT: jax.Array,
        targets_BxT: jax.Array,
        segment_ids_BxT: jax.Array,
        positions_BxT: jax.Array,
        temperature: float | jax.Array = 1.0,
        dropout_key: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """(log p(target | prefix), entropy) per token, both [B, T] fp32, at the given temperature, over
        the usable vocabulary; with `dropout_key`, under LoRA dropout (the policy update's forward)."""
        h_BxTxD = self.hidden_states(tokens_BxT, segment_ids_BxT, positions_BxT, dropout_key)
        cfg = self.config
        return chunked_logprobs(
            h_BxTxD, self.head_kernel(), targets_BxT, cfg.resolved_logprob_chunk, temperature, cfg.usable_vocab
        )

    def token_logprobs_routed(
        self,
        tokens_BxT: jax.Array,
        targets_BxT: jax.Array,
        segment_ids_BxT: jax.Array,
        positions_BxT: jax.Array,
        temperature: float | jax.Array = 1.0,
        dropout_key: jax.Array | None = None,
        replay_BxTxYmxK: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, RouterOutput | None]:
        """`token_logprobs` and the sparse layers' routers; with `replay_BxTxYmxK` each token goes through the
        recorded experts of each sparse layer (routing replay), gated by the current router."""
        h_BxTxD, router = self.routed_hidden_states(
            tokens_BxT, segment_ids_BxT, positions_BxT, dropout_key, replay_BxTxYmxK
        )
        cfg = self.config
        logp_BxT, entropy_BxT = chunked_logprobs(
            h_BxTxD, self.head_kernel(), targets_BxT, cfg.resolved_logprob_chunk, temperature, cfg.usable_vocab
        )
        return logp_BxT, entropy_BxT, router

    # -- (b) prefill --------------------------------------------------------------------------

    def prefill(
        self, tokens_BxT: jax.Array, lengths_B: jax.Array, first_segment: int | None = None
    ) -> tuple[jax.Array, KVCache]:
        """Run right-padded prompts; return fp32 logits [B, V] at each last real token and their KV cache
        of length T, cut into segments from `first_segment` (entries past a prompt's length are garbage
        and must stay masked)."""
        logits_BxV, k_YxBxTxKxH, v_YxBxTxKxH = self.prefill_entries(tokens_BxT, lengths_B)
        return logits_BxV, KVCache.from_entries(k_YxBxTxKxH, v_YxBxTxKxH, first_segment)

    def prefill_entries(self, tokens_BxT: jax.Array, lengths_B: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`prefill` with the keys and values as the layer scan makes them, [Y, B, T, K, H] each (what a
        paged cache is filled from)."""
        return self.prefill_entries_routed(tokens_BxT, lengths_B)[:3]

    def prefill_entries_routed(
        self, tokens_BxT: jax.Array, lengths_B: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
        """`prefill_entries` and each position's experts [B, T, Ym, K] (`routing_dtype`; None when dense)."""
        b, t = tokens_BxT.shape
        positions_BxT = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
        segment_ids_BxT = (positions_BxT < lengths_B[:, None]).astype(jnp.int32)
        x_BxTxD, kv, router = self._run_rows_routed(tokens_BxT, segment_ids_BxT, positions_BxT, keep_kv=True)
        assert kv is not None  # keep_kv
        k_YxBxTxKxH, v_YxBxTxKxH = kv
        last_BxD = jnp.take_along_axis(x_BxTxD, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
        logits_BxV = jnp.einsum(
            "bd,dv->bv", self.final_norm(last_BxD), self.head_kernel(), preferred_element_type=jnp.float32
        )
        experts = None if router is None else jnp.moveaxis(router.experts, 0, 2).astype(routing_dtype(self.config))
        return mask_padded_vocab(logits_BxV, self.config.usable_vocab), k_YxBxTxKxH, v_YxBxTxKxH, experts

    # -- (c) decode ---------------------------------------------------------------------------

    def layer_states(self) -> tuple[nnx.State, ...]:
        """Each layer's weights as its own arrays (a copy of the stacked ones), for `decode_step`."""
        _, stacked = nnx.split(self.layers)
        return tuple(jax.tree.map(lambda stack, y=y: stack[y], stacked) for y in range(self.config.num_layers))

    def decode_step(
        self,
        tokens_B: jax.Array,
        positions_B: jax.Array,
        cache: KVCache,
        attend_length: int | None = None,
        layer_states: Sequence[nnx.State] | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """See `decode_step_routed` (the same without the routing)."""
        return self.decode_step_routed(tokens_B, positions_B, cache, attend_length, layer_states)[:2]

    def decode_step_routed(
        self,
        tokens_B: jax.Array,
        positions_B: jax.Array,
        cache: KVCache,
        attend_length: int | None = None,
        layer_states: Sequence[nnx.State] | None = None,
    ) -> tuple[jax.Array, KVCache, jax.Array | None]:
        """Feed one token per slot at `positions_B`: write its keys/values into the cache at that position
        (in place when the cache is donated), then attend to the cache up to and including it. With
        `attend_length` (static, > every position) only the segments covering that prefix are read (and a
        segment that ends past it is sliced: a copy). Returns fp32 logits [B, V] and the cache.

        The layers are unrolled (not scanned) so each layer's attention reads its own cache arrays in
        place: inside a scan, the layer's slice of a stacked cache is a copy. Likewise the weights:
        `layer_states` (from `layer_states()`) are read in place, while without them each layer's
        weights are sliced (copied) out of the stacked ones on every call. Also returns each fed token's experts
        [B, Ym, K] (`routing_dtype`; None when dense)."""
        attend = get_attention(self.config.attention_impl, decode=True)
        s = cache.length if attend_length is None else attend_length
        valid_BxS = jnp.arange(s)[None, :] <= positions_B[:, None]
        sin, cos = self._rope(positions_B[:, None])
        rows_B = jnp.arange(cache.batch)
        # The segments holding positions [0, s): each read whole (in place), the last one cut at s if s
        # is not a segment end; each slot's new entry goes to the segment holding its position (an
        # out-of-range index elsewhere, so that segment's write drops it).
        spans = [(a, min(b, s)) for a, b in zip((0, *cache.ends[:-1]), cache.ends, strict=True) if a < s]
        outside = cache.length  # past the end of every segment
        index_B = [jnp.where((positions_B >= a) & (positions_B < b), positions_B - a, outside) for a, b in spans]
        graphdef, _ = nnx.split(self.layers)
        layer_states = self.layer_states() if layer_states is None else layer_states
        x_Bx1xD = self._embed(tokens_B[:, None])
        keys, values = [], []
        routers: list[RouterOutput | None] = []
        for y, (layer_state, k_cached, v_cached) in enumerate(zip(layer_states, cache.k, cache.v, strict=True)):
            layer = nnx.merge(graphdef, layer_state)
            q, k, v = layer.attention_inputs(x_Bx1xD, sin, cos)
            k_BxKxH, v_BxKxH = k[:, 0].astype(k_cached[0].dtype), v[:, 0].astype(v_cached[0].dtype)
            # Written before it is read: the attention then reads the updated array itself, where reading
            # first would make XLA keep (copy) the old one for the read.
            k_segments, v_segments = list(k_cached), list(v_cached)
            read_k, read_v = [], []
            for j, ((a, b), index) in enumerate(zip(spans, index_B, strict=True)):
                k_segments[j] = k_segments[j].at[rows_B, :, :, index].set(k_BxKxH, mode="drop")
                v_segments[j] = v_segments[j].at[rows_B, :, index].set(v_BxKxH, mode="drop")
                read_k.append(k_segments[j][..., : b - a])
                read_v.append(v_segments[j][:, :, : b - a])
            keys.append(tuple(k_segments))
            values.append(tuple(v_segments))
            out = attend(q, read_k, read_v, valid_BxS=valid_BxS)
            x_Bx1xD, router = layer.finish_routed(x_Bx1xD, out, layer=y)
            routers.append(router)
        logits_BxV = jnp.einsum(
            "bd,dv->bv", self.final_norm(x_Bx1xD[:, 0]), self.head_kernel(), preferred_element_type=jnp.float32
        )
        logits_BxV = mask_padded_vocab(logits_BxV, self.config.usable_vocab)
        return logits_BxV, KVCache(k=tuple(keys), v=tuple(values)), self._step_experts(routers)

    def _step_experts(self, routers: list[RouterOutput | None]) -> jax.Array | None:
        """The experts of a decode step's one token per slot, [B, Ym, K] in `routing_dtype` (None when dense)."""
        picked = [routers[y] for y in sparse_layer_ids(self.config)]
        if not picked:
            return None
        experts_BxYmxK = jnp.stack([router.experts[:, 0] for router in picked if router is not None], axis=1)
        return experts_BxYmxK.astype(routing_dtype(self.config))

    def decode_step_paged(
        self,
        tokens_B: jax.Array,
        positions_B: jax.Array,
        pools: Sequence[PagePool],
        page_table_BxM: jax.Array,
        attend_pages: int,
        layer_states: Sequence[nnx.State] | None = None,
    ) -> tuple[jax.Array, tuple[PagePool, ...]]:
        """See `decode_step_paged_routed` (the same without the routing)."""
        return self.decode_step_paged_routed(tokens_B, positions_B, pools, page_table_BxM, attend_pages, layer_states)[
            :2
        ]

    def decode_step_paged_routed(
        self,
        tokens_B: jax.Array,
        positions_B: jax.Array,
        pools: Sequence[PagePool],
        page_table_BxM: jax.Array,
        attend_pages: int,
        layer_states: Sequence[nnx.State] | None = None,
    ) -> tuple[jax.Array, tuple[PagePool, ...], jax.Array | None]:
        """`decode_step` over a paged cache: each layer's pool (`page_pool.py`) and the page table [B, M] (entry
        P: no page). Each slot's new key/value is written at its position's page (dropped where the table has no
        page), then the slot attends to its first `attend_pages` pages (static; covering every position), masked
        past its position. Returns fp32 logits [B, V], the pools and each fed token's experts [B, Ym, K] (None
        when dense)."""
        step = PagedDecodeStep.plan(page_table_BxM, positions_B, pools[0].num_pages, pools[0].page_size, attend_pages)
        sin, cos = self._rope(positions_B[:, None])
        graphdef, _ = nnx.split(self.layers)
        layer_states = self.layer_states() if layer_states is None else layer_states
        x_Bx1xD = self._embed(tokens_B[:, None])
        written: list[PagePool] = []
        routers: list[RouterOutput | None] = []
        for y, (layer_state, pool) in enumerate(zip(layer_states, pools, strict=True)):
            layer = nnx.merge(graphdef, layer_state)
            q, k, v = layer.attention_inputs(x_Bx1xD, sin, cos)
            out, pool = step.write_and_attend(q, k, v, pool)
            written.append(pool)
            x_Bx1xD, router = layer.finish_routed(x_Bx1xD, out, layer=y)
            routers.append(router)
        logits_BxV = jnp.einsum(
            "bd,dv->bv", self.final_norm(x_Bx1xD[:, 0]), self.head_kernel(), preferred_element_type=jnp.float32
        )
        logits_BxV = mask_padded_vocab(logits_BxV, self.config.usable_vocab)
        return logits_BxV, tuple(written), self._step_experts(routers)


def chunked_logprobs(
    h_BxTxD: jax.Array,
    kernel_DxV: jax.Array,
    targets_BxT: jax.Array,
    chunk: int,
    temperature: float | jax.Array = 1.0,
    usable_vocab: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of each target and the entropy of each position's distribution, [B, T] fp32, over the
    first `usable_vocab` ids (null: all).

    Each chunk is C consecutive positions of every row, about `chunk` tokens in all (C = chunk / B, at least
    one); its [B, C, V] logits are built, reduced and dropped (and rebuilt in the backward pass), so memory is
    O(chunk * V), not O(B * T * V). Chunks run along the length, never across rows: the rows stay split over
    the batch's devices (a loop over a split axis would gather it).
    """
    b, t, _ = h_BxTxD.shape
    usable_vocab = kernel_DxV.shape[1] if usable_vocab is None else usable_vocab
    # gathered over the embed axis once, here: left split, XLA gathered it inside every chunk (the 1.5B TPU
    # recipe's proximal pass: 64 gathers of the 467 MB head a micro-batch, 7.6 TB a call)
    kernel_DxV = constrain(kernel_DxV, (None, "vocab"))
    c = min(t, max(1, chunk // b))
    n_chunks = -(-t // c)
    pad = n_chunks * c - t
    if pad:
        h_BxTxD = jnp.pad(h_BxTxD, ((0, 0), (0, pad), (0, 0)))
        targets_BxT = jnp.pad(targets_BxT, ((0, 0), (0, pad)))

    @jax.checkpoint
    def one_chunk(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        h_BxCxD, targets_BxC = constrain(args[0], (*ROW_AXES, None)), args[1]
        logits_BxCxV = jnp.einsum("bcd,dv->bcv", h_BxCxD, kernel_DxV, preferred_element_type=jnp.float32)
        logits_BxCxV = mask_padded_vocab(logits_BxCxV / temperature, usable_vocab)
        lse_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1)
        target_logit_BxC = jnp.take_along_axis(logits_BxCxV, targets_BxC[..., None], axis=-1)[..., 0]
        probs_BxCxV = jax.nn.softmax(logits_BxCxV, axis=-1)
        entropy_BxC = lse_BxC - jnp.sum(probs_BxCxV * logits_BxCxV, axis=-1)
        return target_logit_BxC - lse_BxC, entropy_BxC

    def by_chunk(x_BxTx: jax.Array) -> jax.Array:  # [B, J*C, ...] -> [J, B, C, ...]
        return jnp.swapaxes(x_BxTx.reshape(b, n_chunks, c, *x_BxTx.shape[2:]), 0, 1)

    logp_JxBxC, entropy_JxBxC = jax.lax.map(one_chunk, (by_chunk(h_BxTxD), by_chunk(targets_BxT)))

    def by_row(x_JxBxC: jax.Array) -> jax.Array:
        return jnp.swapaxes(x_JxBxC, 0, 1).reshape(b, n_chunks * c)[:, :t]

    return by_row(logp_JxBxC), by_row(entropy_JxBxC)

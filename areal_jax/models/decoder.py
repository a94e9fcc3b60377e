"""The decoder (Flax NNX) and its three call paths over the same weights.

(a) `token_logprobs`: packed training/scoring rows (segment ids + positions) -> per-token log-probs of
    given targets, computed chunk by chunk so the full [T, V] logits never exist at once;
(b) `prefill`: right-padded prompts -> logits of each last prompt token and a fresh KV cache;
(c) `decode_step`: one token per slot against a slot-indexed KV cache, written in place.

Layers are stacked along a leading "layers" axis and run with `lax.scan`, so compile time does not
grow with depth. Every path masks the logits of embedding rows past the tokenizer (`vocab_limit`) with
`mask_padded_vocab`, so nothing samples them and every softmax is over the same usable ids.

Legend: B batch rows (or cache slots), T length, S cache length, D model width, V vocab,
Y layers, K key/value heads, H head dim, C chunk length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models.attention import get_attention
from areal_jax.models.config import ModelConfig
from areal_jax.models.layers import DecoderLayer, RMSNorm, _param
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


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer: k, v [Y, B, S, K, H] (B = batch rows or cache slots)."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int) -> KVCache:
        shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.resolved_head_dim)
        return cls(k=jnp.zeros(shape, cfg.compute_jnp_dtype), v=jnp.zeros(shape, cfg.compute_jnp_dtype))


class Decoder(nnx.Module):
    """Qwen2 / Qwen3 / Llama-3 decoder-only language model."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.config = cfg
        with nnx.use_eager_sharding(False):
            self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg, cfg.initializer_range)

            @nnx.split_rngs(splits=cfg.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_layers(layer_rngs: nnx.Rngs) -> DecoderLayer:
                return DecoderLayer(cfg, layer_rngs)

            self.layers = make_layers(rngs)
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
        """Run `body(carry, layer, layer_index)` over the stacked layers with `lax.scan`."""
        graphdef, state = nnx.split(self.layers)

        def step(carry: Any, xs: tuple[nnx.State, jax.Array]) -> tuple[Any, Any]:
            layer_state, index = xs
            return body(carry, nnx.merge(graphdef, layer_state), index)

        if self.config.remat != "none":
            step = jax.checkpoint(step, policy=_REMAT_POLICIES[self.config.remat])
        return jax.lax.scan(step, carry, (state, jnp.arange(self.config.num_layers)))

    def _run_rows(
        self, tokens_BxT: jax.Array, segment_ids_BxT: jax.Array, positions_BxT: jax.Array, keep_kv: bool
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """Every layer over rows masked by segment ids and positions (packed or right-padded): the last
        layer's output [B, T, D] (not normed) and, with `keep_kv`, each layer's keys/values [Y, B, T, K, H]."""
        attend = get_attention(self.config.attention_impl)
        sin, cos = self._rope(positions_BxT)

        def body(x_BxTxD: jax.Array, layer: DecoderLayer, _: jax.Array):
            q, k, v = layer.attention_inputs(x_BxTxD, sin, cos)
            out = attend(q, k, v, segment_ids=segment_ids_BxT, positions=positions_BxT)
            return layer.finish(x_BxTxD, out), ((k, v) if keep_kv else None)

        return self._scan_layers(body, self._embed(tokens_BxT))

    # -- (a) packed forward -------------------------------------------------------------------

    def hidden_states(self, tokens_BxT: jax.Array, segment_ids_BxT: jax.Array, positions_BxT: jax.Array) -> jax.Array:
        """Final-normed hidden states [B, T, D] of packed rows."""
        x_BxTxD, _ = self._run_rows(tokens_BxT, segment_ids_BxT, positions_BxT, keep_kv=False)
        return self.final_norm(x_BxTxD)

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
    ) -> tuple[jax.Array, jax.Array]:
        """(log p(target | prefix), entropy) per token, both [B, T] fp32, at the given temperature, over
        the usable vocabulary."""
        h_BxTxD = self.hidden_states(tokens_BxT, segment_ids_BxT, positions_BxT)
        cfg = self.config
        return chunked_logprobs(
            h_BxTxD, self.head_kernel(), targets_BxT, cfg.logprob_chunk, temperature, cfg.usable_vocab
        )

    # -- (b) prefill --------------------------------------------------------------------------

    def prefill(self, tokens_BxT: jax.Array, lengths_B: jax.Array) -> tuple[jax.Array, KVCache]:
        """Run right-padded prompts; return fp32 logits [B, V] at each last real token and the KV cache
        [Y, B, T, K, H] (entries past a prompt's length are garbage and must stay masked)."""
        b, t = tokens_BxT.shape
        positions_BxT = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
        segment_ids_BxT = (positions_BxT < lengths_B[:, None]).astype(jnp.int32)
        x_BxTxD, (k_YxBxTxKxH, v_YxBxTxKxH) = self._run_rows(tokens_BxT, segment_ids_BxT, positions_BxT, keep_kv=True)
        last_BxD = jnp.take_along_axis(x_BxTxD, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
        logits_BxV = jnp.einsum(
            "bd,dv->bv", self.final_norm(last_BxD), self.head_kernel(), preferred_element_type=jnp.float32
        )
        return mask_padded_vocab(logits_BxV, self.config.usable_vocab), KVCache(k=k_YxBxTxKxH, v=v_YxBxTxKxH)

    # -- (c) decode ---------------------------------------------------------------------------

    def decode_step(
        self, tokens_B: jax.Array, positions_B: jax.Array, cache: KVCache, attend_length: int | None = None
    ) -> tuple[jax.Array, KVCache]:
        """Feed one token per slot at `positions_B`: attend to cache entries before that position plus
        the token itself, then write its keys/values into the cache at that position (one scatter over
        all layers after the scan, so with a donated cache nothing is copied). With `attend_length`
        (static, > every position) only that prefix of the cache is read. Returns fp32 logits [B, V]
        and the cache."""
        attend = get_attention(self.config.attention_impl, decode=True)
        b = cache.k.shape[1]
        s = cache.k.shape[2] if attend_length is None else attend_length
        cache_valid_BxS = jnp.arange(s)[None, :] < positions_B[:, None]
        sin, cos = self._rope(positions_B[:, None])

        def body(x_Bx1xD: jax.Array, layer: DecoderLayer, index: jax.Array):
            q, k, v = layer.attention_inputs(x_Bx1xD, sin, cos)
            k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
            k_cache = jax.lax.dynamic_index_in_dim(cache.k, index, axis=0, keepdims=False)[:, :s]
            v_cache = jax.lax.dynamic_index_in_dim(cache.v, index, axis=0, keepdims=False)[:, :s]
            out = attend(q, k_cache, v_cache, k, v, cache_valid_BxS=cache_valid_BxS)
            return layer.finish(x_Bx1xD, out), (k[:, 0], v[:, 0])

        x_Bx1xD, (k_new_YxBxKxH, v_new_YxBxKxH) = self._scan_layers(body, self._embed(tokens_B[:, None]))
        rows_B = jnp.arange(b)
        cache = KVCache(
            k=cache.k.at[:, rows_B, positions_B].set(k_new_YxBxKxH),
            v=cache.v.at[:, rows_B, positions_B].set(v_new_YxBxKxH),
        )
        logits_BxV = jnp.einsum(
            "bd,dv->bv", self.final_norm(x_Bx1xD[:, 0]), self.head_kernel(), preferred_element_type=jnp.float32
        )
        return mask_padded_vocab(logits_BxV, self.config.usable_vocab), cache


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

    The sequence is cut into chunks of `chunk` tokens; each chunk's [B, C, V] logits are built, reduced
    and dropped (and rebuilt in the backward pass), so memory is O(B * C * V), not O(B * T * V).
    """
    b, t, d = h_BxTxD.shape
    usable_vocab = kernel_DxV.shape[1] if usable_vocab is None else usable_vocab
    chunk = min(chunk, t)
    n_chunks = -(-t // chunk)
    pad = n_chunks * chunk - t
    if pad:
        h_BxTxD = jnp.pad(h_BxTxD, ((0, 0), (0, pad), (0, 0)))
        targets_BxT = jnp.pad(targets_BxT, ((0, 0), (0, pad)))
    h_NxBxCxD = h_BxTxD.reshape(b, n_chunks, chunk, d).swapaxes(0, 1)
    targets_NxBxC = targets_BxT.reshape(b, n_chunks, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one_chunk(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        h_BxCxD, targets_BxC = args
        logits_BxCxV = jnp.einsum("bcd,dv->bcv", h_BxCxD, kernel_DxV, preferred_element_type=jnp.float32)
        logits_BxCxV = mask_padded_vocab(logits_BxCxV / temperature, usable_vocab)
        lse_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1)
        target_logit_BxC = jnp.take_along_axis(logits_BxCxV, targets_BxC[:, :, None], axis=-1)[:, :, 0]
        probs_BxCxV = jax.nn.softmax(logits_BxCxV, axis=-1)
        entropy_BxC = lse_BxC - jnp.sum(probs_BxCxV * logits_BxCxV, axis=-1)
        return target_logit_BxC - lse_BxC, entropy_BxC

    logp_NxBxC, entropy_NxBxC = jax.lax.map(one_chunk, (h_NxBxCxD, targets_NxBxC))
    logp_BxT = logp_NxBxC.swapaxes(0, 1).reshape(b, n_chunks * chunk)[:, :t]
    entropy_BxT = entropy_NxBxC.swapaxes(0, 1).reshape(b, n_chunks * chunk)[:, :t]
    return logp_BxT, entropy_BxT

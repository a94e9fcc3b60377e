"""The Qwen3.5 (`qwen3_5`, `qwen3_5_moe`) decoder: Gated DeltaNet linear-attention layers beside gated
full-attention layers; in `qwen3_5_moe` every layer's feed-forward is the mixture of experts (`moe.MoEBlock`, with
the shared expert and its sigmoid gate) in place of the MLP.

`HybridDecoder` is a `Decoder` whose layers come in two stacks, one per kind (`linear_layers`,
`full_layers`, each on a leading `layers` axis), run in `hybrid.layer_types` order. The packed-row path
(`hidden_states`, `logits`, `token_logprobs`) is the `Decoder`'s; sequences packed in a row are kept apart by
the attention mask in the full layers and by resetting the recurrent state and the convolution window at each
sequence's start in the linear ones (`gated_delta.py`). The layers are scanned one period of the pattern at a
time (Qwen3.5's 3 linear + 1 full: a depth-independent compile); an irregular pattern is one period. A mixture's
routers come out of the scan per layer, in layer order (`_run_rows_routed`: every layer is a sparse layer), and
recorded routing goes in the same way (routing replay).

Qwen3.5's RMSNorms scale by (1 + weight), the weight initialised at zero, except the gated norm inside the
linear layers (weight, initialised at one). Full attention: q/k RMSNorm, RoPE on the first
`partial_rotary_factor` of each head, and the output gated by sigmoid of a second query-sized projection.

Serving (`prefill`, `decode_step`: `hybrid_serving.py`) keeps a `HybridCache` per slot: a recurrent state and
convolution window per linear layer beside the full layers' dense KV cache. With a paged KV cache
(`prefill_recurrent_entries`, `decode_step_paged_recurrent`) the full layers' keys and values go to the page pool
as a `Decoder`'s do, the states and windows stay per slot.

Legend: B rows, T length, D model width, F MLP width, N query heads, K key/value heads, G = N / K,
H head dim (full attention), A linear key heads, L linear value heads, E linear key head dim, V linear
value head dim, J = 2E + (L / A) V (a linear key head's group: its query, its key, its value heads' values),
W convolution width, P = 2G + 2 (a KV head's queries, gates, key, value), R rotary dims.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.activation_sharding import ROW_AXES, constrain
from areal_jax.models import hybrid_serving
from areal_jax.models.attention import AttentionFn, get_attention
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import _REMAT_POLICIES, Decoder
from areal_jax.models.gated_delta import (
    causal_conv1d,
    chunk_gated_delta_rule,
    conv_step,
    conv_window,
    gated_delta_step,
    resets_from_segments,
)
from areal_jax.models.hybrid_serving import HybridCache
from areal_jax.models.layers import RMSNorm, SwiGLU, _const, _param
from areal_jax.models.moe import MoEBlock, RouterOutput
from areal_jax.models.page_pool import PagePool
from areal_jax.models.rope import apply_rope, inverse_frequencies, rope_tables

_RECURRENT = (
    "a qwen3_5 model's serving state is more than keys and values (a recurrent state and convolution window per "
    "slot and linear layer): prefill with prefill / prefill_recurrent_entries, decode with decode_step / "
    "decode_step_paged_recurrent"
)


class OffsetRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), in fp32 (HF `Qwen3_5RMSNorm`: a zero-initialised scale)."""

    def __init__(self, size: int, cfg: ModelConfig, axis_name: str = "norm"):
        self.eps = cfg.rms_norm_eps
        self.weight = _const((size,), (axis_name,), cfg, 0.0)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = 1.0 + self.weight[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
        return (normed * scale).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """RMSNorm of each value head, times silu(gate) (HF `Qwen3_5RMSNormGated`)."""

    def __init__(self, size: int, cfg: ModelConfig):
        self.eps = cfg.rms_norm_eps
        self.weight = _const((size,), ("head_dim",), cfg, 1.0)

    def __call__(self, x_BxTxLxV: jax.Array, gate_BxTxLxV: jax.Array) -> jax.Array:
        x32 = x_BxTxLxV.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        out = self.weight[...].reshape(1, 1, 1, -1) * normed.astype(x_BxTxLxV.dtype)
        return (out * jax.nn.silu(gate_BxTxLxV.astype(jnp.float32))).astype(x_BxTxLxV.dtype)


class GatedDeltaNet(nnx.Module):
    """The linear-attention token mixer (HF `Qwen3_5GatedDeltaNet`).

    q, k and v are one matmul over a [D, A, J] kernel grouped by key head (its query, its key, then the values
    of the L / A value heads it serves), so splitting the `kv_heads` axis gives each tensor shard whole groups;
    the depthwise convolution's [W, A, J] kernel is laid out the same way."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        hy = cfg.hybrid
        assert hy is not None  # ModelConfig.validate
        d, a, lv, v = cfg.hidden_size, hy.linear_num_key_heads, hy.linear_num_value_heads, hy.linear_value_head_dim
        std = cfg.initializer_range
        self.key_dim, self.chunk = hy.linear_key_head_dim, hy.chunk
        self.compute_dtype = cfg.compute_jnp_dtype
        self.qkv = _param(rngs, (d, a, hy.group_width), ("embed", "kv_heads", "qkv"), cfg, std)
        # torch's Conv1d scale (fan-in W), so a fresh layer's q/k are not all near zero
        conv = hy.conv_kernel**-0.5 * jax.random.normal(rngs.params(), (hy.conv_kernel, a, hy.group_width))
        self.conv = nnx.Param(conv.astype(cfg.param_jnp_dtype), out_sharding=(None, "kv_heads", "qkv"))
        self.z = _param(rngs, (d, lv, v), ("embed", "heads", "head_dim"), cfg, std)
        self.b = _param(rngs, (d, lv), ("embed", "heads"), cfg, std)
        self.a = _param(rngs, (d, lv), ("embed", "heads"), cfg, std)
        # HF's init: decay rates A uniform in [1, 16] (log-stored), dt bias 1
        a_log = jnp.log(jax.random.uniform(rngs.params(), (lv,), jnp.float32, 1.0, 16.0))
        self.a_log = nnx.Param(a_log.astype(cfg.param_jnp_dtype), out_sharding=("heads",))
        self.dt_bias = _const((lv,), ("heads",), cfg, 1.0)
        self.norm = GatedRMSNorm(v, cfg)
        self.out = _param(rngs, (lv, v, d), ("heads", "head_dim", "embed"), cfg, std)

    def _inputs(self, x_BxTxD: jax.Array) -> tuple[jax.Array, ...]:
        """The convolution's input [B, T, A*J] (before it), the output gate z [B, T, L, V], the write strength
        beta and the log decay g [B, T, L] (fp32)."""
        b, t, _ = x_BxTxD.shape
        dtype = self.compute_dtype
        mixed_BxTxAJ = jnp.einsum("btd,daj->btaj", x_BxTxD, self.qkv[...].astype(dtype)).reshape(b, t, -1)
        z_BxTxLxV = jnp.einsum("btd,dlv->btlv", x_BxTxD, self.z[...].astype(dtype))
        beta_BxTxL = jax.nn.sigmoid(x_BxTxD @ self.b[...].astype(dtype))
        dt_bias_1x1xL = self.dt_bias[...].astype(jnp.float32)[None, None]
        softplus_BxTxL = jax.nn.softplus((x_BxTxD @ self.a[...].astype(dtype)).astype(jnp.float32) + dt_bias_1x1xL)
        g_BxTxL = -jnp.exp(self.a_log[...].astype(jnp.float32))[None, None] * softplus_BxTxL
        return mixed_BxTxAJ, z_BxTxLxV, beta_BxTxL, g_BxTxL

    def _conv_kernel(self) -> jax.Array:
        return self.conv[...].astype(self.compute_dtype).reshape(self.conv.shape[0], -1)

    def _split(self, conv_BxTxAJ: jax.Array, z_BxTxLxV: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k [B, T, A, E] and v [B, T, L, V] of the convolution's (pre-activation) output."""
        b, t, _ = conv_BxTxAJ.shape
        e = self.key_dim
        mixed_BxTxAxJ = jax.nn.silu(conv_BxTxAJ).reshape(b, t, self.qkv.shape[1], -1)
        v_BxTxLxV = mixed_BxTxAxJ[..., 2 * e :].reshape(z_BxTxLxV.shape)
        return mixed_BxTxAxJ[..., :e], mixed_BxTxAxJ[..., e : 2 * e], v_BxTxLxV

    def _finish(self, out_BxTxLxV: jax.Array, z_BxTxLxV: jax.Array) -> jax.Array:
        b, t = out_BxTxLxV.shape[:2]
        out_BxTxLxV = self.norm(out_BxTxLxV, z_BxTxLxV)
        return out_BxTxLxV.reshape(b, t, -1) @ self.out[...].astype(self.compute_dtype).reshape(-1, self.out.shape[-1])

    def __call__(self, x_BxTxD: jax.Array, reset_BxT: jax.Array) -> jax.Array:
        """Packed rows: state and convolution window start from zero at each `reset`."""
        mixed_BxTxAJ, z_BxTxLxV, beta_BxTxL, g_BxTxL = self._inputs(x_BxTxD)
        q, k, v = self._split(causal_conv1d(mixed_BxTxAJ, self._conv_kernel(), reset_BxT), z_BxTxLxV)
        q, k = (constrain(x, (*ROW_AXES, "kv_heads", None)) for x in (q, k))
        v, z_BxTxLxV = (constrain(x, (*ROW_AXES, "heads", None)) for x in (v, z_BxTxLxV))
        out_BxTxLxV, _ = chunk_gated_delta_rule(q, k, v, g_BxTxL, beta_BxTxL, reset_BxT, chunk=self.chunk)
        return self._finish(constrain(out_BxTxLxV, (*ROW_AXES, "heads", None)), z_BxTxLxV)

    def prefill(self, x_BxTxD: jax.Array, lengths_B: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Right-padded prompts (one per row, from an empty state): the output [B, T, D] and what decoding
        continues from, each row's recurrent state [B, L, E, V] (fp32) and convolution window [B, W-1, A*J] as
        they stand after its last real token (padding neither writes nor decays the state)."""
        t = x_BxTxD.shape[1]
        real_BxT = jnp.arange(t)[None, :] < lengths_B[:, None]
        mixed_BxTxAJ, z_BxTxLxV, beta_BxTxL, g_BxTxL = self._inputs(x_BxTxD)
        q, k, v = self._split(causal_conv1d(mixed_BxTxAJ, self._conv_kernel()), z_BxTxLxV)
        beta_BxTxL, g_BxTxL = (jnp.where(real_BxT[..., None], x, 0.0) for x in (beta_BxTxL, g_BxTxL))
        out_BxTxLxV, state_BxLxExV = chunk_gated_delta_rule(q, k, v, g_BxTxL, beta_BxTxL, chunk=self.chunk)
        window_BxWxAJ = conv_window(mixed_BxTxAJ, lengths_B, self.conv.shape[0])
        return self._finish(out_BxTxLxV, z_BxTxLxV), state_BxLxExV, window_BxWxAJ

    def decode(
        self, x_Bx1xD: jax.Array, state_BxLxExV: jax.Array, window_BxWxAJ: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One token per slot: the output [B, 1, D], the slot's state and window moved on by it."""
        mixed_Bx1xAJ, z_Bx1xLxV, beta_Bx1xL, g_Bx1xL = self._inputs(x_Bx1xD)
        conv_BxAJ, window_BxWxAJ = conv_step(mixed_Bx1xAJ[:, 0], self._conv_kernel(), window_BxWxAJ)
        q, k, v = self._split(conv_BxAJ[:, None], z_Bx1xLxV)
        out_BxLxV, state_BxLxExV = gated_delta_step(
            q[:, 0], k[:, 0], v[:, 0], g_Bx1xL[:, 0], beta_Bx1xL[:, 0], state_BxLxExV
        )
        return self._finish(out_BxLxV[:, None], z_Bx1xLxV), state_BxLxExV, window_BxWxAJ


def apply_partial_rope(x_BxTxNxH: jax.Array, sin_BxTxR: jax.Array, cos_BxTxR: jax.Array) -> jax.Array:
    """RoPE on the first R dims of each head; the rest pass through."""
    r = sin_BxTxR.shape[-1]
    return jnp.concatenate([apply_rope(x_BxTxNxH[..., :r], sin_BxTxR, cos_BxTxR), x_BxTxNxH[..., r:]], axis=-1)


class GatedAttention(nnx.Module):
    """Full attention with q/k RMSNorm, partial RoPE and a sigmoid output gate (HF `Qwen3_5Attention`).

    q, gate, k and v are one matmul over a [D, K, P, H] kernel: for each KV head its G queries, their G gates,
    its key, its value (query head n = k * G + g, HF's order)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, k, h = cfg.hidden_size, cfg.num_kv_heads, cfg.resolved_head_dim
        self.group = cfg.num_heads // k
        self.compute_dtype = cfg.compute_jnp_dtype
        axes = ("embed", "kv_heads", "qkv", "head_dim")
        self.kernel = _param(rngs, (d, k, 2 * self.group + 2, h), axes, cfg, cfg.initializer_range)
        self.q_norm = OffsetRMSNorm(h, cfg, axis_name="head_dim")
        self.k_norm = OffsetRMSNorm(h, cfg, axis_name="head_dim")
        self.o = _param(rngs, (cfg.num_heads, h, d), ("heads", "head_dim", "embed"), cfg, cfg.initializer_range)

    def inputs(
        self, x_BxTxD: jax.Array, sin_BxTxR: jax.Array, cos_BxTxR: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """q [B, T, N, H] (normed, rotated), its output gate [B, T, N, H], k (normed, rotated) and v [B, T, K, H]."""
        b, t, _ = x_BxTxD.shape
        g = self.group
        qkv_BxTxKxPxH = jnp.einsum("btd,dkph->btkph", x_BxTxD, self.kernel[...].astype(self.compute_dtype))
        h = qkv_BxTxKxPxH.shape[-1]
        q_BxTxNxH = qkv_BxTxKxPxH[:, :, :, :g].reshape(b, t, -1, h)
        gate_BxTxNxH = qkv_BxTxKxPxH[:, :, :, g : 2 * g].reshape(b, t, -1, h)
        k_BxTxKxH, v_BxTxKxH = qkv_BxTxKxPxH[:, :, :, 2 * g], qkv_BxTxKxPxH[:, :, :, 2 * g + 1]
        q_BxTxNxH = apply_partial_rope(self.q_norm(q_BxTxNxH), sin_BxTxR, cos_BxTxR)
        k_BxTxKxH = apply_partial_rope(self.k_norm(k_BxTxKxH), sin_BxTxR, cos_BxTxR)
        return q_BxTxNxH, gate_BxTxNxH, k_BxTxKxH, v_BxTxKxH

    def output(self, attention_BxTxNxH: jax.Array, gate_BxTxNxH: jax.Array) -> jax.Array:
        """The gated attention output projected back to [B, T, D]."""
        b, t = attention_BxTxNxH.shape[:2]
        gated_BxTxNxH = attention_BxTxNxH * jax.nn.sigmoid(gate_BxTxNxH)
        return gated_BxTxNxH.reshape(b, t, -1) @ self.o[...].astype(self.compute_dtype).reshape(-1, self.o.shape[-1])

    def __call__(
        self,
        x_BxTxD: jax.Array,
        sin_BxTxR: jax.Array,
        cos_BxTxR: jax.Array,
        segment_ids_BxT: jax.Array,
        positions_BxT: jax.Array,
        attend: AttentionFn,
    ) -> jax.Array:
        q_BxTxNxH, gate_BxTxNxH, k_BxTxKxH, v_BxTxKxH = self.inputs(x_BxTxD, sin_BxTxR, cos_BxTxR)
        q_BxTxNxH, gate_BxTxNxH = (constrain(x, (*ROW_AXES, "heads", None)) for x in (q_BxTxNxH, gate_BxTxNxH))
        k_BxTxKxH, v_BxTxKxH = (constrain(x, (*ROW_AXES, "kv_heads", None)) for x in (k_BxTxKxH, v_BxTxKxH))
        out_BxTxNxH = attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids=segment_ids_BxT, positions=positions_BxT)
        return self.output(constrain(out_BxTxNxH, (*ROW_AXES, "heads", None)), gate_BxTxNxH)


class _FeedForwardHalf(nnx.Module):
    """A block's second half: the post-attention norm, then the MLP, or with `model.moe` (`qwen3_5_moe`) the
    experts (`mlp` None) in its place."""

    def _init_feed_forward(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        self.post_attention_norm = OffsetRMSNorm(cfg.hidden_size, cfg)
        self.mlp = None if cfg.moe is not None else SwiGLU(cfg, rngs)
        self.moe = MoEBlock(cfg, rngs) if cfg.moe is not None else None

    def feed_forward(
        self, h_BxTxD: jax.Array, replay_BxTxK: jax.Array | None = None
    ) -> tuple[jax.Array, RouterOutput | None]:
        """The feed-forward's output [B, T, D] (before the residual) and its router's (None when dense); with
        `replay_BxTxK` each token goes through those experts (`MoEBlock.routed`)."""
        normed_BxTxD = self.post_attention_norm(h_BxTxD)
        if self.moe is not None:
            return self.moe.routed(normed_BxTxD, replay_BxTxK)
        assert self.mlp is not None
        return self.mlp(normed_BxTxD), None


class LinearAttentionLayer(_FeedForwardHalf):
    """Pre-norm block: Gated DeltaNet, then the MLP (or the experts)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.input_norm = OffsetRMSNorm(cfg.hidden_size, cfg)
        self.mixer = GatedDeltaNet(cfg, rngs)
        self._init_feed_forward(cfg, rngs)

    def __call__(
        self, x_BxTxD: jax.Array, reset_BxT: jax.Array, replay_BxTxK: jax.Array | None = None
    ) -> tuple[jax.Array, RouterOutput | None]:
        """The block's output and its router's (`feed_forward`)."""
        h_BxTxD = x_BxTxD + self.mixer(self.input_norm(x_BxTxD), reset_BxT)
        out_BxTxD, router = self.feed_forward(h_BxTxD, replay_BxTxK)
        return h_BxTxD + out_BxTxD, router


class FullAttentionLayer(_FeedForwardHalf):
    """Pre-norm block: gated full attention, then the MLP (or the experts)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.input_norm = OffsetRMSNorm(cfg.hidden_size, cfg)
        self.attn = GatedAttention(cfg, rngs)
        self._init_feed_forward(cfg, rngs)

    def __call__(
        self, x_BxTxD: jax.Array, *attention_args: Any, replay_BxTxK: jax.Array | None = None
    ) -> tuple[jax.Array, RouterOutput | None]:
        """The block's output and its router's (`feed_forward`)."""
        h_BxTxD = x_BxTxD + self.attn(self.input_norm(x_BxTxD), *attention_args)
        out_BxTxD, router = self.feed_forward(h_BxTxD, replay_BxTxK)
        return h_BxTxD + out_BxTxD, router


def _stack(
    layer_cls: type[LinearAttentionLayer] | type[FullAttentionLayer], count: int, cfg: ModelConfig, rngs: nnx.Rngs
) -> Any:
    """`count` layers of `layer_cls` on a leading `layers` axis (None when none)."""
    if not count:
        return None

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_layers(layer_rngs: nnx.Rngs) -> nnx.Module:
        return layer_cls(cfg, layer_rngs)

    return make_layers(rngs)


class HybridDecoder(Decoder):
    """Qwen3.5 decoder-only language model (HF `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM`, or the text model of
    `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        hy = cfg.hybrid
        if hy is None:
            raise ValueError(f"HybridDecoder needs model.hybrid (family {cfg.family!r})")
        self.config = cfg
        d = cfg.hidden_size
        with nnx.use_eager_sharding(False):
            self.embed = _param(rngs, (cfg.vocab_size, d), ("vocab", "embed"), cfg, cfg.initializer_range)
            self.linear_layers = _stack(LinearAttentionLayer, hy.count("linear_attention"), cfg, rngs)
            self.full_layers = _stack(FullAttentionLayer, hy.count("full_attention"), cfg, rngs)
            self.final_norm = OffsetRMSNorm(d, cfg)
            self.lm_head = (
                None
                if cfg.tie_word_embeddings
                else _param(rngs, (d, cfg.vocab_size), ("embed", "vocab"), cfg, cfg.initializer_range)
            )

    def _run_rows(
        self,
        tokens_BxT: jax.Array,
        segment_ids_BxT: jax.Array,
        positions_BxT: jax.Array,
        keep_kv: bool,
        dropout_key: jax.Array | None = None,
    ) -> tuple[jax.Array, None]:
        """Every layer over packed or right-padded rows: the last layer's output [B, T, D] (not normed)."""
        x_BxTxD, _, _ = self._run_rows_routed(tokens_BxT, segment_ids_BxT, positions_BxT, keep_kv, dropout_key)
        return x_BxTxD, None

    def _run_rows_routed(
        self,
        tokens_BxT: jax.Array,
        segment_ids_BxT: jax.Array,
        positions_BxT: jax.Array,
        keep_kv: bool,
        dropout_key: jax.Array | None = None,
        replay_BxTxYmxK: jax.Array | None = None,
    ) -> tuple[jax.Array, None, RouterOutput | None]:
        """`_run_rows` and, for `qwen3_5_moe`, every layer's router (`RouterOutput`, fields [Y, B, T, ...] in layer
        order; None when dense); with `replay_BxTxYmxK` each layer routes each token to those experts."""
        if keep_kv:
            raise NotImplementedError(_RECURRENT)
        cfg, hy = self.config, self.config.hybrid
        assert hy is not None
        period = hy.period()
        kinds = hy.layer_types[:period]
        repeats = cfg.num_layers // period
        rotary = int(cfg.resolved_head_dim * hy.partial_rotary_factor)
        sin_BxTxR, cos_BxTxR = rope_tables(positions_BxT, inverse_frequencies(rotary, cfg.rope_theta, cfg.rope_scaling))
        attention_args = (sin_BxTxR, cos_BxTxR, segment_ids_BxT, positions_BxT, get_attention(cfg.attention_impl))
        mixer_args = {"linear_attention": (resets_from_segments(segment_ids_BxT),), "full_attention": attention_args}
        # Each stack as [repeats, its layers per period, ...]: scan step r runs period r's layers in order.
        graphdefs, stacks = {}, {}
        for kind, module in (("linear_attention", self.linear_layers), ("full_attention", self.full_layers)):
            if module is not None:
                graphdefs[kind], state = nnx.split(module)
                per = kinds.count(kind)
                stacks[kind] = jax.tree.map(lambda w, per=per: w.reshape(repeats, per, *w.shape[1:]), state)
        replay_RxPxBxTxK = None
        if replay_BxTxYmxK is not None:  # every layer is sparse: Ym = Y, in layer order
            replay_YxBxTxK = jnp.moveaxis(replay_BxTxYmxK, 2, 0).astype(jnp.int32)
            replay_RxPxBxTxK = replay_YxBxTxK.reshape(repeats, period, *replay_YxBxTxK.shape[1:])

        def run_layer(
            kind: str, x_BxTxD: jax.Array, state: nnx.State, replay_BxTxK: jax.Array | None
        ) -> tuple[jax.Array, RouterOutput | None]:
            x_BxTxD, router = nnx.merge(graphdefs[kind], state)(x_BxTxD, *mixer_args[kind], replay_BxTxK=replay_BxTxK)
            return constrain(x_BxTxD, (*ROW_AXES, None)), router

        if cfg.remat != "none":
            # each layer is its own remat unit, as in the `Decoder`: a scan step keeps its layers' inputs and its
            # backward pass holds one layer's intermediates at a time (remat of the whole step held all of the
            # period's at once: 4x a layer's activations, the experts' dispatch rows of each sparse layer among them)
            run_layer = jax.checkpoint(run_layer, policy=_REMAT_POLICIES[cfg.remat], static_argnums=(0,))

        def run_of_layers(
            kind: str, x_BxTxD: jax.Array, states: nnx.State, replay_NxBxTxK: jax.Array | None
        ) -> tuple[jax.Array, RouterOutput | None]:
            """A run of consecutive layers of one kind (their states stacked [N, ...]) as a scan, so the backward
            pass recomputes them one at a time: unrolled, XLA scheduled the recomputes of a period's layers side by
            side (Qwen3.5-27B: four layers' MLP intermediates of 2.1 GiB each live at once, 105 GiB of
            temporaries a v5p chip)."""

            def one(x: jax.Array, xs: tuple[nnx.State, jax.Array | None]) -> tuple[jax.Array, RouterOutput | None]:
                return run_layer(kind, x, *xs)

            return jax.lax.scan(one, x_BxTxD, (states, replay_NxBxTxK))

        def step(
            x_BxTxD: jax.Array, xs: tuple[dict[str, nnx.State], jax.Array | None]
        ) -> tuple[jax.Array, RouterOutput | None]:
            period_states, replay_PxBxTxK = xs
            seen = dict.fromkeys(period_states, 0)
            routers = []
            for start, end in _runs(kinds):
                kind, n = kinds[start], end - start
                states = jax.tree.map(lambda w, i=seen[kind], n=n: w[i : i + n], period_states[kind])
                seen[kind] += n
                replay = None if replay_PxBxTxK is None else replay_PxBxTxK[start:end]
                x_BxTxD, router = run_of_layers(kind, x_BxTxD, states, replay)
                routers.append(router)
            if cfg.moe is None:
                return x_BxTxD, None
            return x_BxTxD, RouterOutput(*(jnp.concatenate(field) for field in zip(*routers, strict=True)))

        x_BxTxD, routers = jax.lax.scan(
            step,
            constrain(self._embed(tokens_BxT), (*ROW_AXES, None)),
            (stacks, replay_RxPxBxTxK),
            unroll=not cfg.scans_layers(),
        )
        if routers is None:
            return x_BxTxD, None, None
        return x_BxTxD, None, RouterOutput(*(f.reshape(cfg.num_layers, *f.shape[2:]) for f in routers))

    # -- serving (`hybrid_serving.py`): the same calls as the `Decoder`'s, over a `HybridCache` ---------------

    def prefill(  # type: ignore[override]  # the cache is a HybridCache
        self, tokens_BxT: jax.Array, lengths_B: jax.Array, first_segment: int | None = None
    ) -> tuple[jax.Array, HybridCache]:
        """Right-padded prompts: fp32 logits [B, V] at each last real token and the cache decoding continues from."""
        return hybrid_serving.prefill(self, tokens_BxT, lengths_B, first_segment)

    def prefill_routed(
        self, tokens_BxT: jax.Array, lengths_B: jax.Array, first_segment: int | None = None
    ) -> tuple[jax.Array, HybridCache, jax.Array | None]:
        """`prefill` and each position's experts [B, T, Y, K] (`qwen3_5_moe`; None when dense)."""
        return hybrid_serving.prefill_routed(self, tokens_BxT, lengths_B, first_segment)

    def prefill_entries(self, tokens_BxT: jax.Array, lengths_B: jax.Array) -> NoReturn:
        raise NotImplementedError(_RECURRENT)

    def layer_states(self) -> tuple[nnx.State, ...]:
        """Each layer's weights as its own arrays, in `layer_types` order, for `decode_step`."""
        return hybrid_serving.layer_states(self)

    def decode_step(  # type: ignore[override]  # the cache is a HybridCache
        self,
        tokens_B: jax.Array,
        positions_B: jax.Array,
        cache: HybridCache,
        attend_length: int | None = None,
        layer_states: Sequence[nnx.State] | None = None,
    ) -> tuple[jax.Array, HybridCache]:
        """One token per slot: fp32 logits [B, V] and the cache moved on by it (`hybrid_serving.decode_step`)."""
        return hybrid_serving.decode_step(self, tokens_B, positions_B, cache, attend_length, layer_states)

    def decode_step_routed(  # type: ignore[override]  # the cache is a HybridCache
        self,
        tokens_B: jax.Array,
        positions_B: jax.Array,
        cache: HybridCache,
        attend_length: int | None = None,
        layer_states: Sequence[nnx.State] | None = None,
    ) -> tuple[jax.Array, HybridCache, jax.Array | None]:
        """`decode_step` and each fed token's experts [B, Y, K] (`qwen3_5_moe`; None when dense)."""
        return hybrid_serving.decode_step_routed(self, tokens_B, positions_B, cache, attend_length, layer_states)

    def decode_step_paged(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(_RECURRENT)

    def decode_step_paged_routed(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(_RECURRENT)

    def prefill_recurrent_entries(
        self, tokens_BxT: jax.Array, lengths_B: jax.Array
    ) -> tuple[jax.Array, jax.Array | None, jax.Array | None, HybridCache, jax.Array | None]:
        """A paged engine's prefill: logits [B, V], the full layers' keys and values [Y, B, T, K, H] (None without
        full layers), the recurrent part (a `HybridCache` with kv None) and the experts (`prefill_routed`'s)."""
        return hybrid_serving.prefill_entries(self, tokens_BxT, lengths_B)

    def decode_step_paged_recurrent(
        self,
        tokens_B: jax.Array,
        positions_B: jax.Array,
        pools: Sequence[PagePool],
        page_table_BxM: jax.Array,
        attend_pages: int,
        recurrent: HybridCache,
        layer_states: Sequence[nnx.State] | None = None,
    ) -> tuple[jax.Array, tuple[PagePool, ...], HybridCache, jax.Array | None]:
        """One token per slot over the full layers' page pools and each slot's states and windows: logits, the
        pools, the recurrent part and the experts (`hybrid_serving.decode_step_paged`)."""
        return hybrid_serving.decode_step_paged(
            self, tokens_B, positions_B, pools, page_table_BxM, attend_pages, recurrent, layer_states
        )


def _runs(kinds: tuple[str, ...]) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive equal kinds: (linear, linear, linear, full) -> (0, 3), (3, 4)."""
    runs, start = [], 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[start]:
            runs.append((start, i))
            start = i
    return runs


def new_decoder(cfg: ModelConfig, rngs: nnx.Rngs) -> Decoder:
    """The decoder of `cfg`'s family: `HybridDecoder` for `qwen3_5` and `qwen3_5_moe`, else `Decoder`."""
    return HybridDecoder(cfg, rngs) if cfg.hybrid is not None else Decoder(cfg, rngs)

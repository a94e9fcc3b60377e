"""The decoder's building blocks as Flax NNX modules, every parameter named by logical axes.

Legend: B batch rows, T length, D model width, N query heads, K key/value heads, G = N / K query heads
per KV head, J = G + 2 (a group's queries, key, value), H head dim, F MLP width, Q = N * H.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.lora import adapter
from areal_jax.models.moe import MoEBlock, RouterOutput, expert_ids_dtype
from areal_jax.models.rope import apply_rope


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], cfg: ModelConfig, std: float) -> nnx.Param:
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(cfg.param_jnp_dtype), out_sharding=axes)


def _const(shape: tuple[int, ...], axes: tuple[str, ...], cfg: ModelConfig, fill: float) -> nnx.Param:
    return nnx.Param(jnp.full(shape, fill, cfg.param_jnp_dtype), out_sharding=axes)


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis, computed in fp32 (HF Llama/Qwen semantics)."""

    def __init__(self, size: int, cfg: ModelConfig, axis_name: str = "norm"):
        self.eps = cfg.rms_norm_eps
        self.weight = _const((size,), (axis_name,), cfg, 1.0)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        weight = self.weight[...].reshape((1,) * (x.ndim - 1) + (-1,))
        return (weight * normed.astype(x.dtype)).astype(x.dtype)


class QKVProjection(nnx.Module):
    """q/k/v as one matmul with optional bias (Qwen2) and per-head q/k RMSNorm (Qwen3), then RoPE.

    The kernel is [D, K, G + 2, H]: for each KV head, its G query heads, then its key, then its value
    (query head n = k * G + g, HF's order). Sharding the `kv_heads` axis gives each tensor shard whole
    head groups, so the attention that follows needs no communication.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, lora_rngs: nnx.Rngs | None = None):
        d, k, h = cfg.hidden_size, cfg.num_kv_heads, cfg.resolved_head_dim
        self.group = cfg.num_heads // k
        self.compute_dtype = cfg.compute_jnp_dtype
        axes = ("embed", "kv_heads", "qkv", "head_dim")
        self.kernel = _param(rngs, (d, k, self.group + 2, h), axes, cfg, cfg.initializer_range)
        self.bias = _const((k, self.group + 2, h), axes[1:], cfg, 0.0) if cfg.qkv_bias else None
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg, axis_name="head_dim")
            self.k_norm = RMSNorm(h, cfg, axis_name="head_dim")
        else:
            self.q_norm = self.k_norm = None
        self.lora_q, self.lora_k, self.lora_v = (adapter(cfg, t, lora_rngs) for t in ("q", "k", "v"))

    def __call__(
        self, x_BxTxD: jax.Array, sin_BxTxH: jax.Array, cos_BxTxH: jax.Array, dropout_key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        b, t, _ = x_BxTxD.shape
        g = self.group
        qkv_BxTxKxJxH = jnp.einsum("btd,dkjh->btkjh", x_BxTxD, self.kernel[...].astype(self.compute_dtype))
        if self.bias is not None:
            qkv_BxTxKxJxH = qkv_BxTxKxJxH + self.bias[...].astype(self.compute_dtype)[None, None]
        q_BxTxNxH = qkv_BxTxKxJxH[:, :, :, :g].reshape(b, t, -1, qkv_BxTxKxJxH.shape[-1])
        k_BxTxKxH = qkv_BxTxKxJxH[:, :, :, g]
        v_BxTxKxH = qkv_BxTxKxJxH[:, :, :, g + 1]
        if self.lora_q is not None:
            q_BxTxNxH = q_BxTxNxH + self.lora_q(x_BxTxD, dropout_key).reshape(q_BxTxNxH.shape)
        if self.lora_k is not None:
            k_BxTxKxH = k_BxTxKxH + self.lora_k(x_BxTxD, dropout_key)
        if self.lora_v is not None:
            v_BxTxKxH = v_BxTxKxH + self.lora_v(x_BxTxD, dropout_key)
        if self.q_norm is not None and self.k_norm is not None:
            q_BxTxNxH = self.q_norm(q_BxTxNxH)
            k_BxTxKxH = self.k_norm(k_BxTxKxH)
        return apply_rope(q_BxTxNxH, sin_BxTxH, cos_BxTxH), apply_rope(k_BxTxKxH, sin_BxTxH, cos_BxTxH), v_BxTxKxH


@jax.custom_vjp
def gated_projection(x_BxTxD: jax.Array, kernel_Dx2xF: jax.Array) -> jax.Array:
    """silu(x @ gate) * (x @ up), gate and up as one matmul over the [D, 2, F] kernel (gate, then up).

    The gradient is written by hand, as two matmuls per input over the kernel's halves and the flattened
    tokens. Autodiff of the fused form pads each half's cotangent back into [B, T, 2, F], adds the two and
    transposes the sum for the kernel's gradient: on XLA:CPU the MLP's forward + backward is 1.05x (640
    tokens) to 1.15x (5120) faster by hand (hidden 256, `benchmarks/train_step.py`). Slicing the kernel's
    never-split `gate_up` axis keeps a tensor-parallel F axis where it is. The forward, and so inference,
    is the fused matmul unchanged.
    """
    gate_up_BxTx2xF = jnp.einsum("btd,dcf->btcf", x_BxTxD, kernel_Dx2xF)
    return jax.nn.silu(gate_up_BxTx2xF[:, :, 0]) * gate_up_BxTx2xF[:, :, 1]


def _gated_projection_fwd(x_BxTxD: jax.Array, kernel_Dx2xF: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    gate_up_BxTx2xF = jnp.einsum("btd,dcf->btcf", x_BxTxD, kernel_Dx2xF)
    gate_BxTxF, up_BxTxF = gate_up_BxTx2xF[:, :, 0], gate_up_BxTx2xF[:, :, 1]
    return jax.nn.silu(gate_BxTxF) * up_BxTxF, (x_BxTxD, kernel_Dx2xF, gate_BxTxF, up_BxTxF)


def _gated_projection_bwd(residuals: tuple[jax.Array, ...], d_out_BxTxF: jax.Array) -> tuple[jax.Array, jax.Array]:
    x_BxTxD, kernel_Dx2xF, gate_BxTxF, up_BxTxF = residuals
    b, t, d = x_BxTxD.shape
    sigmoid = jax.nn.sigmoid(gate_BxTxF)
    d_gate_NxF = (d_out_BxTxF * up_BxTxF * sigmoid * (1 + gate_BxTxF * (1 - sigmoid))).reshape(b * t, -1)
    d_up_NxF = (d_out_BxTxF * gate_BxTxF * sigmoid).reshape(b * t, -1)
    x_NxD = x_BxTxD.reshape(b * t, d)
    d_x = d_gate_NxF @ kernel_Dx2xF[:, 0].T + d_up_NxF @ kernel_Dx2xF[:, 1].T
    d_kernel = jnp.stack([x_NxD.T @ d_gate_NxF, x_NxD.T @ d_up_NxF], axis=1)
    return d_x.reshape(b, t, d).astype(x_BxTxD.dtype), d_kernel.astype(kernel_Dx2xF.dtype)


gated_projection.defvjp(_gated_projection_fwd, _gated_projection_bwd)


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)), gate and up as one matmul over a [D, 2, F] kernel (gate, then up)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, lora_rngs: nnx.Rngs | None = None):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.compute_dtype = cfg.compute_jnp_dtype
        self.gate_up = _param(rngs, (d, 2, f), ("embed", "gate_up", "mlp"), cfg, cfg.initializer_range)
        self.down = _param(rngs, (f, d), ("mlp", "embed"), cfg, cfg.initializer_range)
        self.lora_gate, self.lora_up, self.lora_down = (adapter(cfg, t, lora_rngs) for t in ("gate", "up", "down"))

    def __call__(self, x_BxTxD: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        dtype = self.compute_dtype
        if self.lora_gate is None and self.lora_up is None:
            hidden_BxTxF = gated_projection(x_BxTxD, self.gate_up[...].astype(dtype))
        else:  # adapters on the pre-activations: autodiff (the frozen kernel needs no gradient of its own)
            gate_up_BxTx2xF = jnp.einsum("btd,dcf->btcf", x_BxTxD, self.gate_up[...].astype(dtype))
            gate_BxTxF, up_BxTxF = gate_up_BxTx2xF[:, :, 0], gate_up_BxTx2xF[:, :, 1]
            if self.lora_gate is not None:
                gate_BxTxF = gate_BxTxF + self.lora_gate(x_BxTxD, dropout_key)
            if self.lora_up is not None:
                up_BxTxF = up_BxTxF + self.lora_up(x_BxTxD, dropout_key)
            hidden_BxTxF = jax.nn.silu(gate_BxTxF) * up_BxTxF
        out_BxTxD = hidden_BxTxF @ self.down[...].astype(dtype)
        if self.lora_down is not None:
            out_BxTxD = out_BxTxD + self.lora_down(hidden_BxTxF, dropout_key)
        return out_BxTxD


class DecoderLayer(nnx.Module):
    """Pre-norm transformer block. Split in two halves around attention so callers choose the kernel
    and where keys/values come from (fresh, or a KV cache).

    The feed-forward is a SwiGLU `mlp`, or with `model.moe` the experts `moe`; when dense and sparse layers mix,
    every stacked layer holds both (the unused one zero in a loaded checkpoint) and runs its own by layer index.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, lora_rngs: nnx.Rngs | None = None):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg)
        self.qkv = QKVProjection(cfg, rngs, lora_rngs)
        self.o = _param(
            rngs,
            (cfg.num_heads, cfg.resolved_head_dim, cfg.hidden_size),
            ("heads", "head_dim", "embed"),
            cfg,
            cfg.initializer_range,
        )
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg)
        self.sparse_layers = cfg.sparse_layers
        self.mlp = None if all(self.sparse_layers) else SwiGLU(cfg, rngs, lora_rngs)
        self.moe = MoEBlock(cfg, rngs) if any(self.sparse_layers) else None
        self.lora_o = adapter(cfg, "o", lora_rngs)
        self.compute_dtype = cfg.compute_jnp_dtype

    def attention_inputs(
        self, x_BxTxD: jax.Array, sin_BxTxH: jax.Array, cos_BxTxH: jax.Array, dropout_key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B,T,N,H], k and v [B,T,K,H] of the normed input, RoPE applied to q and k. `dropout_key`: the
        layer's key of LoRA dropout (the update's forward only)."""
        return self.qkv(self.input_norm(x_BxTxD), sin_BxTxH, cos_BxTxH, dropout_key)

    def feed_forward(
        self, x_BxTxD: jax.Array, layer: int | jax.Array | None = None, dropout_key: jax.Array | None = None
    ) -> jax.Array:
        """The MLP or the experts of layer `layer` (needed only when dense and sparse layers mix; traced in a
        layer scan, where it selects the branch at run time)."""
        return self.feed_forward_routed(x_BxTxD, layer, dropout_key)[0]

    def feed_forward_routed(
        self,
        x_BxTxD: jax.Array,
        layer: int | jax.Array | None = None,
        dropout_key: jax.Array | None = None,
        replay_BxTxK: jax.Array | None = None,
    ) -> tuple[jax.Array, RouterOutput | None]:
        """`feed_forward` and what the router did (None in a dense decoder; zeros in a dense layer of a mixed
        one); with `replay_BxTxK` a sparse layer routes each token to those experts (`MoEBlock.routed`)."""
        mlp, moe = self.mlp, self.moe
        if moe is None:
            assert mlp is not None  # a layer has one or both
            return mlp(x_BxTxD, dropout_key), None
        if mlp is None:
            return moe.routed(x_BxTxD, replay_BxTxK)
        if layer is None:
            raise ValueError("a decoder mixing dense and sparse layers needs the layer index")

        def dense(x: jax.Array) -> tuple[jax.Array, RouterOutput]:
            b, t, _ = x.shape
            e, k = moe.moe.num_experts, moe.moe.experts_per_token
            none_BxTxK = jnp.zeros((b, t, k), expert_ids_dtype(e))
            none = RouterOutput(jnp.zeros((b, t, e), jnp.float32), none_BxTxK, none_BxTxK)
            return mlp(x, dropout_key), none

        if isinstance(layer, int):
            return moe.routed(x_BxTxD, replay_BxTxK) if self.sparse_layers[layer] else dense(x_BxTxD)
        sparse = jnp.asarray(self.sparse_layers)[layer]
        return jax.lax.cond(sparse, lambda x: moe.routed(x, replay_BxTxK), dense, x_BxTxD)

    def finish(
        self,
        x_BxTxD: jax.Array,
        attention_BxTxNxH: jax.Array,
        dropout_key: jax.Array | None = None,
        layer: int | jax.Array | None = None,
    ) -> jax.Array:
        """Output projection, residual, then the feed-forward half of the block (of layer `layer`: see
        `feed_forward`)."""
        return self.finish_routed(x_BxTxD, attention_BxTxNxH, dropout_key, layer)[0]

    def finish_routed(
        self,
        x_BxTxD: jax.Array,
        attention_BxTxNxH: jax.Array,
        dropout_key: jax.Array | None = None,
        layer: int | jax.Array | None = None,
        replay_BxTxK: jax.Array | None = None,
    ) -> tuple[jax.Array, RouterOutput | None]:
        """`finish` and the router's output (`feed_forward_routed`)."""
        b, t, n, h = attention_BxTxNxH.shape
        # One [T, N*H] x [N*H, D] matmul over row-major reshapes (bitcasts); a two-axis contraction made
        # XLA transpose the kernel on every call.
        o_QxD = self.o[...].astype(self.compute_dtype).reshape(n * h, -1)
        h_BxTxD = x_BxTxD + attention_BxTxNxH.reshape(b, t, n * h) @ o_QxD
        if self.lora_o is not None:
            h_BxTxD = h_BxTxD + self.lora_o(attention_BxTxNxH, dropout_key)
        out_BxTxD, router = self.feed_forward_routed(
            self.post_attention_norm(h_BxTxD), layer, dropout_key, replay_BxTxK
        )
        return h_BxTxD + out_BxTxD, router

"""`model.hybrid`: the Qwen3.5 (`qwen3_5`, `qwen3_5_moe`) layer stack, Gated DeltaNet linear attention beside
gated full attention (a leaf of `ModelConfig`, checked against it there)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Protocol

from areal_jax.configuration import Config, ConfigError, option

LayerType = Literal["linear_attention", "full_attention"]
# The families built of these layers: the dense one, and the mixture whose every layer's feed-forward is `moe`.
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe")


class ModelDims(Protocol):
    """What these functions read of a `ModelConfig` (which holds a `HybridConfig`, so cannot be imported here)."""

    @property
    def family(self) -> str: ...
    @property
    def hybrid(self) -> HybridConfig | None: ...
    @property
    def lora(self) -> Any: ...
    @property
    def moe(self) -> Any: ...
    @property
    def qkv_bias(self) -> bool: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def resolved_head_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class HybridConfig(Config):
    """Which layers are linear attention, their widths, and the full-attention layers' rotary fraction (HF
    `Qwen3_5TextConfig`'s `layer_types`, `linear_*`, `partial_rotary_factor`)."""

    layer_types: tuple[LayerType, ...] = option(
        ("linear_attention", "full_attention"), doc="each layer's token mixer, one entry per layer"
    )
    partial_rotary_factor: float = option(
        0.25, gt=0, le=1, doc="share of a full-attention head's dims that RoPE rotates (the first ones)"
    )
    linear_num_key_heads: int = option(2, ge=1, doc="query/key heads of a linear-attention layer")
    linear_num_value_heads: int = option(4, ge=1, doc="value heads (recurrent states); a multiple of the key heads")
    linear_key_head_dim: int = option(16, ge=1, doc="query/key head width")
    linear_value_head_dim: int = option(16, ge=1, doc="value head width")
    conv_kernel: int = option(4, ge=1, doc="width of the short causal convolution over q/k/v")
    chunk: int = option(
        64, ge=1, doc="tokens per chunk of the chunked delta rule ([chunk, chunk] work per head, one scan step)"
    )

    def validate(self) -> None:
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                "linear_num_value_heads",
                f"value {self.linear_num_value_heads} must be a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}",
            )

    @property
    def group_width(self) -> int:
        """Channels per key head of the fused q/k/v projection: its query, its key, its value heads' values."""
        ratio = self.linear_num_value_heads // self.linear_num_key_heads
        return 2 * self.linear_key_head_dim + ratio * self.linear_value_head_dim

    def count(self, kind: LayerType) -> int:
        return sum(t == kind for t in self.layer_types)

    def layer_ids(self, kind: LayerType) -> tuple[int, ...]:
        """The depths of the layers of `kind`, in order (their stack's entries)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)

    def period(self) -> int:
        """The shortest prefix of `layer_types` that repeats to the whole (the layers one scan step runs)."""
        n = len(self.layer_types)
        return next(p for p in range(1, n + 1) if not n % p and self.layer_types == self.layer_types[:p] * (n // p))


def check_hybrid(cfg: ModelDims) -> None:
    """Refuse a `qwen3_5` / `qwen3_5_moe` config without `hybrid` (or the other way round) and settings the stack
    lacks."""
    hybrid = cfg.hybrid
    if (cfg.family in HYBRID_FAMILIES) != (hybrid is not None):
        raise ConfigError("hybrid", f"is set exactly when family is one of {HYBRID_FAMILIES} (family {cfg.family!r})")
    if hybrid is None:
        return
    moe = cfg.moe
    if moe is not None:  # HF Qwen3.5-MoE: every layer sparse, the top-k always renormalised
        if moe.decoder_sparse_step != 1 or moe.mlp_only_layers:
            key = "moe.decoder_sparse_step" if moe.decoder_sparse_step != 1 else "moe.mlp_only_layers"
            raise ConfigError(key, f"must leave every layer sparse for family {cfg.family!r} (1 and [])")
        if not moe.norm_topk_prob:
            raise ConfigError(
                "moe.norm_topk_prob", f"must be true for family {cfg.family!r} (HF's router always renormalises)"
            )
    if len(hybrid.layer_types) != cfg.num_layers:
        raise ConfigError(
            "hybrid.layer_types", f"has {len(hybrid.layer_types)} entries, expected num_layers={cfg.num_layers}"
        )
    rotary = int(cfg.resolved_head_dim * hybrid.partial_rotary_factor)
    if rotary < 2 or rotary % 2:
        raise ConfigError(
            "hybrid.partial_rotary_factor",
            f"value {hybrid.partial_rotary_factor} rotates {rotary} of head_dim={cfg.resolved_head_dim} dims; "
            "must be an even number >= 2",
        )
    if cfg.lora is not None:
        raise ConfigError("lora", f"is not supported for family {cfg.family!r} yet (issue 37); use null")
    if cfg.qkv_bias:
        raise ConfigError("qkv_bias", f"is not supported for family {cfg.family!r} (HF attention_bias); use false")


def hybrid_num_params(cfg: ModelDims, feed_forward: int) -> int:
    """Parameter count of a `qwen3_5` / `qwen3_5_moe` decoder, embeddings included; `feed_forward`: all layers'
    MLPs or experts (`ModelConfig._feed_forward_params`)."""
    assert cfg.hybrid is not None
    hy = cfg.hybrid
    d, h = cfg.hidden_size, cfg.resolved_head_dim
    n, k = cfg.num_heads, cfg.num_kv_heads
    nk, nv = hy.linear_num_key_heads, hy.linear_num_value_heads
    full = d * 2 * n * h + 2 * d * k * h + n * h * d + 2 * h
    channels = nk * hy.group_width
    linear = d * channels + hy.conv_kernel * channels + d * nv * hy.linear_value_head_dim * 2 + 2 * d * nv
    linear += 2 * nv + hy.linear_value_head_dim
    layers = hy.count("full_attention") * full + hy.count("linear_attention") * linear
    head = 0 if cfg.tie_word_embeddings else d * cfg.vocab_size
    return cfg.vocab_size * d + layers + feed_forward + cfg.num_layers * 2 * d + d + head


def hybrid_matmul_flops_per_token(cfg: ModelDims, context_length: int, feed_forward: int) -> int:
    """Forward FLOPs per token of a `qwen3_5` / `qwen3_5_moe` decoder: 2 per matmul weight (`feed_forward`: the
    MLP or router and experts weights one token uses, all layers'), causal attention over `context_length` in the
    full-attention layers, and each linear layer's state read and update (about 6 K V per value head: decay,
    correction, write and read)."""
    assert cfg.hybrid is not None
    hy = cfg.hybrid
    d, h = cfg.hidden_size, cfg.resolved_head_dim
    n, k = cfg.num_heads, cfg.num_kv_heads
    nv = hy.linear_num_value_heads
    full = d * 2 * n * h + 2 * d * k * h + n * h * d
    linear = d * hy.linear_num_key_heads * hy.group_width + 2 * d * nv * hy.linear_value_head_dim + 2 * d * nv
    weights = hy.count("full_attention") * full + hy.count("linear_attention") * linear
    weights += feed_forward + d * cfg.vocab_size
    attention = hy.count("full_attention") * 2 * n * h * context_length
    recurrence = hy.count("linear_attention") * 6 * nv * hy.linear_key_head_dim * hy.linear_value_head_dim
    return 2 * weights + attention + recurrence

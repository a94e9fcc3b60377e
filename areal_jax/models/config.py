"""The decoder's hyper-parameters: one config covers Qwen2/Qwen2.5, Qwen3 and Llama-3."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from areal_jax.configuration import Config, ConfigError, option
from areal_jax.models.hybrid_config import HybridConfig, check_hybrid, hybrid_matmul_flops_per_token, hybrid_num_params
from areal_jax.models.lora_config import LoRAConfig, check_rank

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# How HF checkpoints store weights (config.json `dtype` / `torch_dtype`): read into `param_dtype`, written back in
# the checkpoint's own.
CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")


def auto_compute_dtype(platform: str | None = None) -> str:
    """`compute_dtype: auto` on `platform` (default: JAX's default backend): bfloat16 on TPU and GPU; float32 on
    CPU, where XLA computes a bf16 matmul in f32 after converting its operands, so bf16 weights cost an f32 copy
    per program call and the decode step several times its time (benchmarks/cpu_compute_dtype.py)."""
    return "float32" if (platform or jax.default_backend()) == "cpu" else "bfloat16"


# `scan_layers: auto` unrolls models this shallow on CPU: their compile time stays short, and the train step
# skips the per-layer weight copies out of the stack (benchmarks/e2e.py's 4-layer workload)
UNROLL_MAX_LAYERS_CPU = 8


# The fp32 logits one log-prob chunk builds at once, when `logprob_chunk` is null.
LOGITS_CHUNK_BYTES = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class RopeScalingConfig(Config):
    """Llama-3 style RoPE frequency scaling (HF `rope_scaling` with `rope_type: llama3`)."""

    factor: float = option(8.0, gt=0, doc="divisor applied to the low frequencies")
    low_freq_factor: float = option(1.0, gt=0, doc="wavelengths above original/low_freq_factor are fully scaled")
    high_freq_factor: float = option(4.0, gt=0, doc="wavelengths below original/high_freq_factor are unscaled")
    original_max_position_embeddings: int = option(8192, ge=1, doc="context length the base model was trained on")

    def validate(self) -> None:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                "high_freq_factor",
                f"value {self.high_freq_factor} must be greater than low_freq_factor={self.low_freq_factor}",
            )


# The families whose feed-forward is a mixture of experts (`model.moe`).
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "qwen3_5_moe")
# The mixtures whose sparse block has the shared expert with its sigmoid gate.
SHARED_EXPERT_FAMILIES = ("qwen2_moe", "qwen3_5_moe")


@dataclasses.dataclass(frozen=True)
class MoEConfig(Config):
    """The sparse feed-forward of a mixture-of-experts family (HF Qwen3-MoE's fields; `models/moe.py`)."""

    num_experts: int = option(8, ge=1, doc="routed experts E per sparse layer (HF num_experts)")
    experts_per_token: int = option(2, ge=1, doc="experts each token is routed to, top-k (HF num_experts_per_tok)")
    expert_intermediate_size: int = option(64, ge=1, doc="SwiGLU hidden width of one expert (HF moe_intermediate_size)")
    norm_topk_prob: bool = option(
        False, doc="renormalise the top-k router probabilities to sum to 1 (HF norm_topk_prob; Qwen3-MoE: true)"
    )
    decoder_sparse_step: int = option(
        1, ge=1, doc="layer i (from 0) is sparse when (i + 1) % decoder_sparse_step == 0, else a dense MLP"
    )
    mlp_only_layers: tuple[int, ...] = option((), doc="layers that keep a dense MLP whatever decoder_sparse_step says")
    router_aux_loss_coef: float = option(
        0.0,
        ge=0,
        doc="weight of the routers' Switch load-balancing loss (`moe.load_balancing_loss`, HF's "
        "load_balancing_loss_func over all sparse layers) added to the policy loss; 0 = off. HF checkpoints carry "
        "0.001 but apply it only with output_router_logits, so it is not read from them",
    )
    shared_expert_intermediate_size: int | None = option(
        None,
        ge=1,
        doc="SwiGLU width of the shared expert every token also runs through, its output scaled by "
        "sigmoid(x @ shared_expert_gate) (HF Qwen2-MoE / Qwen3.5-MoE; families qwen2_moe, qwen3_5_moe); "
        "null = none (Qwen3-MoE)",
    )
    grouped_matmul: Literal["auto", "ragged_dot", "megablox"] = option(
        "auto",
        doc="the experts' grouped matmul: ragged_dot (portable), megablox (Pallas, TPU); auto: megablox when "
        "the mesh's devices are TPUs, else ragged_dot",
    )
    dispatch: Literal["auto", "all_gather", "all_to_all"] = option(
        "auto",
        doc="how tokens reach the experts split over the mesh: all_gather (each device gathers its expert group's "
        "tokens), all_to_all (each pick goes only to its expert's device, ragged all-to-all in rounds); auto: "
        "all_to_all with megablox, else all_gather (models/moe.py, docs/moe.md)",
    )

    def validate(self) -> None:
        if self.experts_per_token > self.num_experts:
            raise ConfigError(
                "experts_per_token", f"value {self.experts_per_token} exceeds num_experts={self.num_experts}"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig(Config):
    """Architecture and numerics of the decoder."""

    family: Literal["qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe", "qwen3_5", "qwen3_5_moe"] = option(
        "qwen2", doc="HF architecture family"
    )
    vocab_size: int = option(256, ge=1, doc="number of token ids")
    vocab_limit: int | None = option(
        None,
        ge=1,
        doc="token ids usable by the tokenizer: logits of ids >= this are masked out in sampling and scoring; "
        "null = vocab_size",
    )
    hidden_size: int = option(64, ge=1, doc="model width D")
    intermediate_size: int = option(128, ge=1, doc="SwiGLU hidden width F")
    num_layers: int = option(2, ge=1, doc="decoder layers")
    num_heads: int = option(4, ge=1, doc="query heads N")
    num_kv_heads: int = option(2, ge=1, doc="key/value heads K (GQA); must divide num_heads")
    head_dim: int | None = option(None, ge=1, doc="per-head width H; null = hidden_size / num_heads")
    rope_theta: float = option(10000.0, gt=0, doc="RoPE base")
    rope_scaling: RopeScalingConfig | None = option(None, doc="llama3 RoPE scaling; null = none")
    rms_norm_eps: float = option(1e-6, gt=0, doc="RMSNorm epsilon")
    qkv_bias: bool = option(True, doc="bias on q/k/v projections (Qwen2)")
    qk_norm: bool = option(False, doc="RMSNorm on each head of q and k before RoPE (Qwen3)")
    tie_word_embeddings: bool = option(False, doc="lm head shares the embedding matrix")
    max_position_embeddings: int = option(4096, ge=1, doc="longest supported sequence")
    param_dtype: Literal["float32", "bfloat16"] = option(
        "float32",
        doc="dtype the parameters are held and updated in: float32 master params whatever the checkpoint stores "
        "(bfloat16 halves their memory; the trainer then updates bf16 weights, losing updates below a weight's "
        "bf16 resolution)",
    )
    export_dtype: Literal["float32", "bfloat16", "float16"] | None = option(
        None,
        doc="dtype of exported HF checkpoints; null = the dtype of the HF checkpoint the run started from "
        "(float32 for a random init)",
    )
    compute_dtype: Literal["auto", "float32", "bfloat16"] = option(
        "auto",
        doc="matmul dtype; norms/softmax stay fp32. auto: bfloat16 on TPU/GPU, float32 on CPU (XLA:CPU converts "
        "bf16 matmul operands to f32: slower and larger there)",
    )
    remat: Literal["none", "full", "dots"] = option("none", doc="rematerialise each layer in the backward pass")
    scan_layers: bool | Literal["auto"] = option(
        "auto",
        doc="true: run the stacked layers as one lax.scan (compile time independent of depth); false: unroll "
        "them, so XLA:CPU neither copies each layer's weights out of the stack nor stacks their gradients "
        "(faster train steps for shallow models on CPU: docs/benchmarks.md), compile time growing with depth. "
        f"auto: unroll on CPU up to {UNROLL_MAX_LAYERS_CPU} layers, scan otherwise (and on TPU/GPU)",
    )
    logprob_chunk: int | None = option(
        None,
        ge=1,
        doc="tokens per chunk when turning hidden states into log-probs (a chunk's [tokens, vocab] logits exist at "
        "once); null = the power of two whose fp32 logits fill about 256 MiB (256 tokens at Qwen's 151,936 ids), "
        "64..8192",
    )
    attention_impl: Literal["auto", "xla", "splash"] = option(
        "auto",
        doc="row attention: 'auto' (splash on TPU for rows over 256 tokens its tiles divide, else xla), 'xla' "
        "(portable), 'splash' (JAX's Pallas TPU kernel; off TPU in Pallas's interpreter, slow)",
    )
    initializer_range: float = option(0.02, gt=0, doc="std of the normal init of fresh weights")
    lora: LoRAConfig | None = option(
        None,
        doc="low-rank adapters on the projections: only they train and travel to the engines; null = full training",
    )
    moe: MoEConfig | None = option(
        None, doc="the sparse layers' experts (families qwen3_moe, qwen2_moe and qwen3_5_moe only); null = dense"
    )
    hybrid: HybridConfig | None = option(
        None,
        doc="the linear- and full-attention layers of families qwen3_5 and qwen3_5_moe (set exactly for them; "
        "`models/hybrid.py`)",
    )

    def validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_kv_heads", f"value {self.num_kv_heads} must divide num_heads={self.num_heads}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ConfigError(
                "hidden_size",
                f"value {self.hidden_size} must be a multiple of num_heads={self.num_heads} when head_dim is null",
            )
        if self.resolved_head_dim % 2:
            raise ConfigError("head_dim", f"value {self.resolved_head_dim} must be even for RoPE")
        if self.vocab_limit is not None and self.vocab_limit > self.vocab_size:
            raise ConfigError("vocab_limit", f"value {self.vocab_limit} must not exceed vocab_size={self.vocab_size}")
        if (self.family in MOE_FAMILIES) != (self.moe is not None):
            raise ConfigError(
                "moe",
                f"must be set exactly when family is one of {MOE_FAMILIES} ({self.family!r}); to set model.moe's "
                "run-time choices over an HF checkpoint, set model.family to the checkpoint's too",
            )
        if self.moe is not None and (self.family in SHARED_EXPERT_FAMILIES) != (
            self.moe.shared_expert_intermediate_size is not None
        ):
            raise ConfigError(
                "moe.shared_expert_intermediate_size",
                f"must be set exactly when family is one of {SHARED_EXPERT_FAMILIES} (family {self.family!r}: HF's "
                "Qwen2-MoE and Qwen3.5-MoE blocks always "
                "have the shared expert, Qwen3-MoE's never)",
            )
        if self.moe is not None:
            bad = [i for i in self.moe.mlp_only_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ConfigError("moe.mlp_only_layers", f"layers {bad} are outside 0..{self.num_layers - 1}")
            mlp_targets = [t for t in self.lora.targets if t in ("gate", "up", "down")] if self.lora else []
            if mlp_targets:
                raise ConfigError(
                    "lora.targets",
                    f"value {list(mlp_targets)}: a mixture of experts takes adapters on attention only (q, k, v, o)",
                )
        check_hybrid(self)
        if self.lora is not None:
            check_rank(self.lora, self.projection_widths)

    @property
    def projection_widths(self) -> dict[str, tuple[int, int]]:
        """(input, output) width of each projection an adapter can target (`lora_config.TARGETS`)."""
        d, f, h = self.hidden_size, self.intermediate_size, self.resolved_head_dim
        q, kv = self.num_heads * h, self.num_kv_heads * h
        return {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, f), "up": (d, f), "down": (f, d)}

    def num_lora_params(self) -> int:
        """Adapter parameter count (0 without `lora`): rank * (input + output) per targeted projection and layer."""
        if self.lora is None:
            return 0
        widths = self.projection_widths
        return self.num_layers * sum(self.lora.rank * sum(widths[t]) for t in self.lora.targets)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def resolved_logprob_chunk(self) -> int:
        """Tokens per log-prob chunk: `logprob_chunk`, else the power of two whose fp32 logits fill about
        LOGITS_CHUNK_BYTES, within 64..8192."""
        if self.logprob_chunk is not None:
            return self.logprob_chunk
        fits = max(1, LOGITS_CHUNK_BYTES // (4 * self.vocab_size))
        return min(8192, max(64, 1 << (fits.bit_length() - 1)))

    @property
    def usable_vocab(self) -> int:
        """Token ids the model may emit and scores over: vocab_limit, or every id."""
        return self.vocab_size if self.vocab_limit is None else self.vocab_limit

    @property
    def param_jnp_dtype(self) -> jnp.dtype:
        return DTYPES[self.param_dtype]

    def compute_dtype_on(self, platform: str | None = None) -> str:
        """`compute_dtype` with auto resolved for `platform` (default: JAX's default backend)."""
        return auto_compute_dtype(platform) if self.compute_dtype == "auto" else self.compute_dtype

    def scans_layers(self, platform: str | None = None) -> bool:
        """`scan_layers` with auto resolved for `platform` (default: JAX's default backend)."""
        if self.scan_layers != "auto":
            return self.scan_layers
        on_cpu = (platform or jax.default_backend()) == "cpu"
        return not (on_cpu and self.num_layers <= UNROLL_MAX_LAYERS_CPU)

    def for_platform(self, platform: str) -> ModelConfig:
        """This config with every `auto` resolved for `platform`, the platform of the mesh a program is built
        for (not JAX's default backend: an ahead-of-time compile for TPU runs on CPU)."""
        return self.replace(compute_dtype=self.compute_dtype_on(platform), scan_layers=self.scans_layers(platform))

    @property
    def compute_jnp_dtype(self) -> jnp.dtype:
        return DTYPES[self.compute_dtype_on()]

    @property
    def resolved_export_dtype(self) -> str:
        """The dtype an HF export writes: `export_dtype`, else `param_dtype`."""
        return self.export_dtype if self.export_dtype is not None else self.param_dtype

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its feed-forward is the mixture of experts (HF Qwen3-MoE's rule); all False when
        dense."""
        moe = self.moe
        if moe is None:
            return (False,) * self.num_layers
        return tuple(
            i not in moe.mlp_only_layers and (i + 1) % moe.decoder_sparse_step == 0 for i in range(self.num_layers)
        )

    def _feed_forward_params(self, active: bool) -> int:
        """The weights of every layer's MLP or experts (with `active`, only the top-k experts a token uses)."""
        d, f = self.hidden_size, self.intermediate_size
        if self.moe is None:
            return self.num_layers * 3 * d * f
        experts = self.moe.experts_per_token if active else self.moe.num_experts
        sparse = self._sparse_layer_params(experts)
        return sum(sparse if is_sparse else 3 * d * f for is_sparse in self.sparse_layers)

    def _sparse_layer_params(self, experts: int) -> int:
        """A sparse layer's router, `experts` experts and the shared expert with its gate."""
        assert self.moe is not None
        d, shared = self.hidden_size, self.moe.shared_expert_intermediate_size
        routed = d * self.moe.num_experts + experts * 3 * d * self.moe.expert_intermediate_size
        return routed + (3 * d * shared + d if shared is not None else 0)

    def _attention_params(self) -> int:
        d, h, n, k = self.hidden_size, self.resolved_head_dim, self.num_heads, self.num_kv_heads
        return d * n * h + 2 * d * k * h + n * h * d

    def num_params(self) -> int:
        """Parameter count, embeddings and every expert included (the checkpoint's)."""
        if self.hybrid is not None:
            return hybrid_num_params(self, self._feed_forward_params(active=False))
        h, n, k = self.resolved_head_dim, self.num_heads, self.num_kv_heads
        layer = self._attention_params() + 2 * self.hidden_size
        if self.qkv_bias:
            layer += n * h + 2 * k * h
        if self.qk_norm:
            layer += 2 * h
        head = 0 if self.tie_word_embeddings else self.hidden_size * self.vocab_size
        embeddings = self.vocab_size * self.hidden_size + self.hidden_size + head
        return embeddings + self.num_layers * layer + self._feed_forward_params(active=False)

    def num_active_params(self) -> int:
        """Parameters one token's forward uses: `num_params` less the experts it is not routed to."""
        return self.num_params() - self._feed_forward_params(active=False) + self._feed_forward_params(active=True)

    def num_held_params(self) -> int:
        """Parameters the decoder holds: `num_params`, plus, when sparse and dense layers mix, the zero experts of
        the dense layers and the zero MLPs of the sparse ones (every stacked layer has both: `models/moe.py`)."""
        moe, layers = self.moe, self.sparse_layers
        if moe is None or all(layers):
            return self.num_params()
        sparse = self._sparse_layer_params(moe.num_experts)
        dense = 3 * self.hidden_size * self.intermediate_size
        return self.num_params() + sum(dense if is_sparse else sparse for is_sparse in layers)

    def matmul_flops_per_token(self, context_length: int) -> int:
        """Forward FLOPs per token: 2 per weight in matmuls (the routed experts only) plus causal attention over
        `context_length`."""
        if self.hybrid is not None:
            return hybrid_matmul_flops_per_token(self, context_length, self._feed_forward_params(active=True))
        h, n = self.resolved_head_dim, self.num_heads
        weights = self.num_layers * self._attention_params() + self._feed_forward_params(active=True)
        weights += self.hidden_size * self.vocab_size
        # QK^T and PV, 2 FLOPs per multiply-add each, over context_length / 2 keys on average (causal)
        attention = self.num_layers * 2 * n * h * context_length
        return 2 * weights + attention

"""Tiny random HF checkpoints (Qwen2, Qwen3, Llama-3, Qwen3-MoE, Qwen2-MoE) written by transformers, for parity
tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TINY = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

VARIANTS = {
    "qwen2-untied": ("Qwen2Config", dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "qwen3-tied": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=16, rope_theta=1000000.0)),
    "llama3-tied": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    # dense MLP layers 1 and 2 between sparse ones; top-k probabilities as they come
    "qwen3moe-mixed": (
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=4,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            mlp_only_layers=[1, 2],
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
    ),
    # every layer sparse, top-k renormalised
    "qwen3moe-renorm-tied": (
        "Qwen3MoeConfig",
        dict(
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            tie_word_embeddings=True,
        ),
    ),
    # Qwen2-MoE: a gated shared expert beside the routed ones, every second layer sparse, q/k/v biases
    "qwen2moe-shared": (
        "Qwen2MoeConfig",
        dict(
            num_hidden_layers=4,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=40,
            decoder_sparse_step=2,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
    ),
}


def make_hf_checkpoint(variant: str, directory: Path, seed: int = 0, dtype: str = "float32"):
    """Create, randomise (biases and norms included) and save a tiny HF model; return the torch model."""
    import torch
    import transformers

    config_cls, extra = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**{**TINY, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.05 * torch.randn_like(param))
    model.eval()
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(directory)
    return model


def hf_logits(model, tokens: list[int]) -> np.ndarray:
    """fp32 logits [T, V] of one unpadded sequence under the torch model."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([tokens]))
    return out.logits[0].float().numpy()

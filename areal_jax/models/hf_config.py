"""HF `config.json` to and from `ModelConfig`: the families we load (their HF architectures), the options
refused with a reason, and the dtype a checkpoint stores its weights in."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from areal_jax.configuration import ConfigError
from areal_jax.models.config import (
    CHECKPOINT_DTYPES,
    MOE_FAMILIES,
    SHARED_EXPERT_FAMILIES,
    ModelConfig,
    MoEConfig,
    RopeScalingConfig,
)
from areal_jax.models.hybrid_io import (
    MULTIMODAL_ARCHITECTURES,
    hybrid_family,
    hybrid_fields_from_hf,
    hybrid_fields_to_hf,
    text_config,
)

ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
}
_FAMILY_BY_ARCH = {arch: family for family, arch in ARCHITECTURES.items()} | MULTIMODAL_ARCHITECTURES


class CheckpointError(ValueError):
    """An HF checkpoint that cannot be loaded as-is (unsupported option, missing or mis-shaped tensor)."""


def checkpoint_dtype(hf: Mapping[str, Any]) -> str:
    """The dtype an HF `config.json` says its weights are stored in (float32 when it says none)."""
    dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch.")
    if dtype not in CHECKPOINT_DTYPES:
        raise CheckpointError(f"config.json dtype {dtype!r} is not supported; supported: {list(CHECKPOINT_DTYPES)}")
    return dtype


def model_config_from_hf(
    hf: Mapping[str, Any], moe_options: Mapping[str, Any] | None = None, **overrides: Any
) -> ModelConfig:
    """ModelConfig from the dict of an HF `config.json`; `overrides` set our own fields (dtypes, remat) and
    `moe_options` fields of the checkpoint's `moe` (its run-time choices: `assembly.MOE_RUN_TIME_FIELDS`). The
    weights load into float32 unless `param_dtype` is overridden, whatever the checkpoint stores; exports
    are written in the checkpoint's own dtype unless `export_dtype` is overridden."""
    hf = text_config(hf)  # a multimodal checkpoint's text model
    archs = hf.get("architectures") or []
    family = _FAMILY_BY_ARCH.get(archs[0]) if archs else hf.get("model_type")
    if family is None:
        family = hybrid_family(hf)
    if family not in ARCHITECTURES:
        raise CheckpointError(
            f"unsupported architecture {archs or hf.get('model_type')!r}; supported: {sorted(ARCHITECTURES.values())}"
        )
    if hf.get("use_sliding_window"):
        raise CheckpointError("use_sliding_window=true is not supported (sliding-window attention)")
    if hf.get("mlp_bias"):
        raise CheckpointError("mlp_bias=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act={hf.get('hidden_act')!r} is not supported (only 'silu')")
    rope = dict(hf.get("rope_parameters") or {})
    legacy_scaling = hf.get("rope_scaling") or {}
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling_dict = rope if rope.get("rope_type", "default") != "default" else dict(legacy_scaling)
    rope_type = scaling_dict.get("rope_type", scaling_dict.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise CheckpointError(f"rope_type={rope_type!r} is not supported; supported: 'default', 'llama3'")
    rope_scaling = None
    if rope_type == "llama3":
        rope_scaling = RopeScalingConfig(
            factor=float(scaling_dict["factor"]),
            low_freq_factor=float(scaling_dict["low_freq_factor"]),
            high_freq_factor=float(scaling_dict["high_freq_factor"]),
            original_max_position_embeddings=int(scaling_dict["original_max_position_embeddings"]),
        )
    fields: dict[str, Any] = {
        "family": family,
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        # Qwen3.5-MoE has no dense MLP (HF's config has no such key): the experts' width stands in, unused
        "intermediate_size": hf["intermediate_size"] if family != "qwen3_5_moe" else _dense_width(hf),
        "num_layers": hf["num_hidden_layers"],
        "num_heads": hf["num_attention_heads"],
        "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        "head_dim": hf.get("head_dim"),
        "rope_theta": float(rope_theta),
        "rope_scaling": rope_scaling,
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "qkv_bias": _qkv_bias(family, hf),
        "qk_norm": family in ("qwen3", "qwen3_moe"),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "max_position_embeddings": int(hf.get("max_position_embeddings", 4096)),
        "export_dtype": checkpoint_dtype(hf),
        "initializer_range": float(hf.get("initializer_range", 0.02)),
    }
    if family in MOE_FAMILIES:
        fields["moe"] = _moe_config_from_hf(hf, family)
        if moe_options:
            try:
                fields["moe"] = fields["moe"].replace(**moe_options)
            except ConfigError as err:
                raise err.under("moe") from None
    elif moe_options is not None:
        raise ConfigError("moe", f"is set, but the HF checkpoint is a dense {family} model (no experts)")
    if family in ("qwen3_5", "qwen3_5_moe"):
        fields.update(hybrid_fields_from_hf(hf))
    fields.update(overrides)
    return ModelConfig(**fields)


def _qkv_bias(family: str, hf: Mapping[str, Any]) -> bool:
    if family == "qwen2":
        return True
    if family == "qwen2_moe":  # HF Qwen2MoeConfig.qkv_bias, true unless set
        return bool(hf.get("qkv_bias", True))
    return bool(hf.get("attention_bias", False))


def _dense_width(hf: Mapping[str, Any]) -> int:
    return int(hf.get("intermediate_size") or _moe_width(hf))


def _moe_width(hf: Mapping[str, Any]) -> int:
    if not hf.get("moe_intermediate_size"):
        raise CheckpointError("a mixture-of-experts config.json without moe_intermediate_size is not supported")
    return int(hf["moe_intermediate_size"])


def _moe_config_from_hf(hf: Mapping[str, Any], family: str) -> MoEConfig:
    num_experts = hf.get("num_experts") or hf.get("num_local_experts")
    if not num_experts:
        raise CheckpointError(f"a {family} config.json without num_experts (a dense model?) is not supported")
    shared = hf.get("shared_expert_intermediate_size") if family in SHARED_EXPERT_FAMILIES else None
    if family in SHARED_EXPERT_FAMILIES and not shared:
        raise CheckpointError(f"a {family} config.json without shared_expert_intermediate_size is not supported")
    if family == "qwen3_5_moe":
        # HF's Qwen3.5-MoE renormalises the top-k always and makes every layer sparse: it drops these keys
        if hf.get("norm_topk_prob") is False:
            raise CheckpointError(
                "norm_topk_prob=false in a qwen3_5_moe config.json: transformers' Qwen3.5-MoE router renormalises "
                "the top-k whatever it says, so the checkpoint's intended routing is ambiguous"
            )
        sparse: dict[str, Any] = {"norm_topk_prob": True}
    else:
        sparse = {
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "decoder_sparse_step": int(hf.get("decoder_sparse_step", 1)),
            "mlp_only_layers": tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
        }
    return MoEConfig(
        shared_expert_intermediate_size=int(shared) if shared else None,
        num_experts=int(num_experts),
        experts_per_token=int(hf["num_experts_per_tok"]),
        expert_intermediate_size=_moe_width(hf),
        **sparse,
    )


def model_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF `config.json` dict describing `cfg`."""
    rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    legacy_scaling = None
    if cfg.rope_scaling is not None:
        legacy_scaling = {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
        rope.update(legacy_scaling)
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.family]],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": legacy_scaling,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "dtype": cfg.resolved_export_dtype,
        "use_cache": True,
    }
    if cfg.family == "llama":
        hf.update(attention_bias=cfg.qkv_bias, mlp_bias=False)
    elif cfg.family == "qwen3":
        hf.update(attention_bias=cfg.qkv_bias)
    elif cfg.moe is not None:
        if cfg.family == "qwen2_moe":
            hf.update(qkv_bias=cfg.qkv_bias)
        if cfg.moe.shared_expert_intermediate_size is not None:
            hf.update(shared_expert_intermediate_size=cfg.moe.shared_expert_intermediate_size)
        hf.update(
            attention_bias=cfg.qkv_bias,
            use_sliding_window=False,
            sliding_window=None,
            num_experts=cfg.moe.num_experts,
            num_experts_per_tok=cfg.moe.experts_per_token,
            moe_intermediate_size=cfg.moe.expert_intermediate_size,
            norm_topk_prob=cfg.moe.norm_topk_prob,
            decoder_sparse_step=cfg.moe.decoder_sparse_step,
            mlp_only_layers=list(cfg.moe.mlp_only_layers),
            router_aux_loss_coef=cfg.moe.router_aux_loss_coef,
            output_router_logits=False,
        )
        if cfg.hybrid is not None:  # qwen3_5_moe
            hf.update(hybrid_fields_to_hf(cfg))
    elif cfg.hybrid is not None:
        hf.update(hybrid_fields_to_hf(cfg))
    else:
        hf.update(use_sliding_window=False, sliding_window=None)
    return hf

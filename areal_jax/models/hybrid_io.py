"""HF Qwen3.5 (`qwen3_5`, `qwen3_5_moe`) checkpoints: the config fields, the tensor layout of `HybridDecoder`, and
the text model inside the multimodal layout (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`:
`text_config`, `model.language_model.*`, a vision tower that is skipped). Also the layout of a `MoEBlock`
(`moe_tensor_table`: one HF tensor per expert, as transformers writes them), which `hf_io` uses for the Qwen-MoE
families too. `hf_io` reads and writes through these.

Legend as in `hybrid.py`: D model width, A linear key heads, L linear value heads, E / V their head dims,
J = 2E + (L / A) V, W convolution width, K key/value heads, G = N / K, H head dim, C fused q/k/v channels.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from areal_jax.models.config import ModelConfig, MoEConfig
from areal_jax.models.hybrid_config import HybridConfig, LayerType

logger = logging.getLogger(__name__)

# our family -> its text model's HF architecture, its multimodal wrapper, its HF model types
TEXT_ARCHITECTURES = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
MULTIMODAL_ARCHITECTURES = {
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}
TEXT_MODEL_TYPES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
_LANGUAGE_MODEL = "model.language_model."
_VISION = ("model.visual.",)

# path -> (HF names with {i} for the layer, (to_ours, to_hf), per layer, the HF layer of each stack entry)
TensorTable = dict[tuple[str, ...], tuple[tuple[str, ...], tuple[Callable, Callable], bool, tuple[int, ...] | None]]
T = TypeVar("T")


def hybrid_family(hf: Mapping[str, Any]) -> str | None:
    """`qwen3_5` or `qwen3_5_moe` for an HF `config.json` dict of a Qwen3.5 (text or multimodal) checkpoint, else
    None."""
    archs = hf.get("architectures") or []
    by_arch = {arch: family for family, arch in TEXT_ARCHITECTURES.items()} | MULTIMODAL_ARCHITECTURES
    return (by_arch.get(archs[0]) if archs else None) or TEXT_MODEL_TYPES.get(hf.get("model_type", ""))


def text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's config: a multimodal checkpoint's `text_config`, with the top level's dtype and tied
    embeddings where the text config does not say; any other config as it is."""
    if "text_config" not in hf:
        return dict(hf)
    text = dict(hf["text_config"])
    for key in ("dtype", "torch_dtype", "tie_word_embeddings"):
        if key in hf and key not in text:
            text[key] = hf[key]
    family = hybrid_family(hf) or hybrid_family(text) or "qwen3_5"
    text["architectures"] = [TEXT_ARCHITECTURES[family]]
    return text


def text_model_view(file_of: Mapping[str, T]) -> dict[str, tuple[str, T]]:
    """Checkpoint tensor name -> (stored name, its file) as a text-only checkpoint names them: the multimodal
    layout's `model.language_model.*` as `model.*`, the vision tower left out (one log line says so)."""
    view: dict[str, tuple[str, T]] = {}
    vision = 0
    for name, file in file_of.items():
        if name.startswith(_VISION):
            vision += 1
        elif name.startswith(_LANGUAGE_MODEL):
            view["model." + name.removeprefix(_LANGUAGE_MODEL)] = (name, file)
        else:
            view[name] = (name, file)
    if vision:
        logger.info("multimodal checkpoint: loading its language model, skipping the vision tower (%d tensors)", vision)
    return view


def hybrid_fields_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields particular to `qwen3_5`, from its text config."""
    n = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types")
    if layer_types is None:  # older configs: every `full_attention_interval`-th layer is full attention
        interval = int(hf.get("full_attention_interval", 4))
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    rope = hf.get("rope_parameters") or {}
    hybrid = HybridConfig(
        layer_types=tuple(layer_types),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
        linear_num_key_heads=int(hf["linear_num_key_heads"]),
        linear_num_value_heads=int(hf["linear_num_value_heads"]),
        linear_key_head_dim=int(hf["linear_key_head_dim"]),
        linear_value_head_dim=int(hf["linear_value_head_dim"]),
        conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)),
    )
    return {"hybrid": hybrid, "qk_norm": True, "qkv_bias": bool(hf.get("attention_bias", False))}


def hybrid_fields_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The `Qwen3_5TextConfig` / `Qwen3_5MoeTextConfig` fields particular to `qwen3_5` / `qwen3_5_moe` (a text-only
    `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` checkpoint)."""
    hy = cfg.hybrid
    assert hy is not None
    return {
        "model_type": "qwen3_5_moe_text" if cfg.moe is not None else "qwen3_5_text",
        "attention_bias": False,
        "layer_types": list(hy.layer_types),
        "linear_num_key_heads": hy.linear_num_key_heads,
        "linear_num_value_heads": hy.linear_num_value_heads,
        "linear_key_head_dim": hy.linear_key_head_dim,
        "linear_value_head_dim": hy.linear_value_head_dim,
        "linear_conv_kernel_dim": hy.conv_kernel,
        "rope_parameters": {
            "rope_theta": cfg.rope_theta,
            "rope_type": "default",
            "partial_rotary_factor": hy.partial_rotary_factor,
        },
    }


def _one(to_ours: Callable[[np.ndarray], np.ndarray], to_hf: Callable[[np.ndarray], np.ndarray]) -> tuple:
    return (lambda ws: to_ours(ws[0]), lambda w: [to_hf(w)])


def moe_tensor_table(moe: MoEConfig, mlp: str) -> dict[tuple[str, ...], tuple[tuple[str, ...], tuple]]:
    """A `MoEBlock`'s parameters (paths under the block) -> their HF names under `mlp` (with `{i}` for the layer) and
    conversions: the router ([E, D] in HF, [D, E] ours), one HF tensor per expert ([F, D] gate and up, [D, F] down)
    stacked on our leading `expert` axis, and the shared expert with its [1, D] gate when the block has one."""
    experts = range(moe.num_experts)
    gate_up_names = tuple(f"{mlp}experts.{e}.{proj}_proj.weight" for e in experts for proj in ("gate", "up"))

    def experts_gate_up(ws: list[np.ndarray]) -> np.ndarray:  # [F, D] x 2E (gate_0, up_0, gate_1, ...) -> [E, D, 2, F]
        return np.stack([np.stack([g.T, u.T], axis=1) for g, u in zip(ws[0::2], ws[1::2], strict=True)])

    def experts_gate_up_to_hf(w: np.ndarray) -> list[np.ndarray]:
        return [w[e, :, c].T for e in experts for c in (0, 1)]

    down_names = tuple(f"{mlp}experts.{e}.down_proj.weight" for e in experts)
    down = (lambda ws: np.stack([w.T for w in ws]), lambda w: [w[e].T for e in experts])  # [D, F] x E <-> [E, F, D]
    table: dict[tuple[str, ...], tuple[tuple[str, ...], tuple]] = {
        ("router",): ((mlp + "gate.weight",), _one(lambda w: w.T, lambda w: w.T)),
        ("gate_up",): (gate_up_names, (experts_gate_up, experts_gate_up_to_hf)),
        ("down",): (down_names, down),
    }
    if moe.shared_expert_intermediate_size is not None:
        shared = mlp + "shared_expert."
        # [S, D] x 2 <-> [D, 2, S]
        gate_up = (lambda ws: np.stack([w.T for w in ws], axis=1), lambda w: [w[:, 0].T, w[:, 1].T])
        table[("shared_gate_up",)] = ((shared + "gate_proj.weight", shared + "up_proj.weight"), gate_up)
        table[("shared_down",)] = ((shared + "down_proj.weight",), _one(lambda w: w.T, lambda w: w.T))
        gate = _one(lambda w: w.reshape(-1), lambda w: w.reshape(1, -1))
        table[("shared_gate",)] = ((mlp + "shared_expert_gate.weight",), gate)
    return table


def hybrid_tensor_table(cfg: ModelConfig) -> TensorTable:
    """Our state path -> how HF stores it, for every parameter of `cfg`'s `HybridDecoder`."""
    hy = cfg.hybrid
    assert hy is not None
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    g = n // k
    a, lv, e, v = hy.linear_num_key_heads, hy.linear_num_value_heads, hy.linear_key_head_dim, hy.linear_value_head_dim
    identity = _one(lambda w: w, lambda w: w)
    transpose = _one(lambda w: w.T, lambda w: w.T)

    def grouped(w_XxC: np.ndarray) -> np.ndarray:  # HF channels [q (A E), k (A E), v (L V)] -> [X, A, J]
        x = w_XxC.shape[0]
        q, key, value = np.split(w_XxC, [a * e, 2 * a * e], axis=1)
        return np.concatenate([q.reshape(x, a, e), key.reshape(x, a, e), value.reshape(x, a, -1)], axis=2)

    def ungrouped(w_XxAxJ: np.ndarray) -> np.ndarray:
        x = w_XxAxJ.shape[0]
        parts = np.split(w_XxAxJ, [e, 2 * e], axis=2)
        return np.concatenate([part.reshape(x, -1) for part in parts], axis=1)

    in_proj_qkv = _one(lambda w: grouped(w.T), lambda w: ungrouped(w).T)  # HF [C, D] <-> [D, A, J]
    conv = _one(lambda w: grouped(w[:, 0].T), lambda w: ungrouped(w).T[:, None])  # HF [C, 1, W] <-> [W, A, J]
    z = _one(lambda w: w.T.reshape(d, lv, v), lambda w: w.reshape(d, lv * v).T)  # HF [L V, D] <-> [D, L, V]
    out = _one(lambda w: w.T.reshape(lv, v, d), lambda w: w.reshape(lv * v, d).T)  # HF [D, L V] <-> [L, V, D]

    def attention_kernel(ws: list[np.ndarray]) -> np.ndarray:  # HF q+gate [N 2H, D], k/v [K H, D] -> [D, K, 2G+2, H]
        q_gate = ws[0].T.reshape(d, k, g, 2, h)
        key, value = (w.T.reshape(d, k, 1, h) for w in ws[1:])
        return np.concatenate([q_gate[:, :, :, 0], q_gate[:, :, :, 1], key, value], axis=2)

    def attention_kernel_to_hf(w: np.ndarray) -> list[np.ndarray]:
        q_gate = np.stack([w[:, :, :g], w[:, :, g : 2 * g]], axis=3).reshape(d, n * 2 * h)
        return [q_gate.T, w[:, :, 2 * g].reshape(d, k * h).T, w[:, :, 2 * g + 1].reshape(d, k * h).T]

    gate_up = (lambda ws: np.stack([w.T for w in ws], axis=1), lambda w: [w[:, 0].T, w[:, 1].T])
    layer = "model.layers.{i}."
    table: TensorTable = {
        ("embed",): (("model.embed_tokens.weight",), identity, False, None),
        ("final_norm", "weight"): (("model.norm.weight",), identity, False, None),
    }
    if not cfg.tie_word_embeddings:
        table[("lm_head",)] = (("lm_head.weight",), transpose, False, None)
    stacks: tuple[tuple[str, LayerType], ...] = (
        ("linear_layers", "linear_attention"),
        ("full_layers", "full_attention"),
    )
    for stack, kind in stacks:
        ids = hy.layer_ids(kind)
        if not ids:
            continue
        common: dict[tuple[str, ...], tuple[tuple[str, ...], tuple]] = {
            ("input_norm", "weight"): ((layer + "input_layernorm.weight",), identity),
            ("post_attention_norm", "weight"): ((layer + "post_attention_layernorm.weight",), identity),
        }
        if cfg.moe is None:
            common[("mlp", "gate_up")] = ((layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"), gate_up)
            common[("mlp", "down")] = ((layer + "mlp.down_proj.weight",), transpose)
        else:  # Qwen3.5-MoE: every layer's feed-forward is the experts
            common.update({("moe", *path): entry for path, entry in moe_tensor_table(cfg.moe, layer + "mlp.").items()})
        if kind == "linear_attention":
            mixer = layer + "linear_attn."
            own: dict[tuple[str, ...], tuple[tuple[str, ...], tuple]] = {
                ("mixer", "qkv"): ((mixer + "in_proj_qkv.weight",), in_proj_qkv),
                ("mixer", "conv"): ((mixer + "conv1d.weight",), conv),
                ("mixer", "z"): ((mixer + "in_proj_z.weight",), z),
                ("mixer", "b"): ((mixer + "in_proj_b.weight",), transpose),
                ("mixer", "a"): ((mixer + "in_proj_a.weight",), transpose),
                ("mixer", "a_log"): ((mixer + "A_log",), identity),
                ("mixer", "dt_bias"): ((mixer + "dt_bias",), identity),
                ("mixer", "norm", "weight"): ((mixer + "norm.weight",), identity),
                ("mixer", "out"): ((mixer + "out_proj.weight",), out),
            }
        else:
            attn = layer + "self_attn."
            qkv_names = (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight")
            own = {
                ("attn", "kernel"): (qkv_names, (attention_kernel, attention_kernel_to_hf)),
                ("attn", "q_norm", "weight"): ((attn + "q_norm.weight",), identity),
                ("attn", "k_norm", "weight"): ((attn + "k_norm.weight",), identity),
                ("attn", "o"): (
                    (attn + "o_proj.weight",),
                    _one(lambda w: w.T.reshape(n, h, d), lambda w: w.reshape(n * h, d).T),
                ),
            }
        for path, (names, fns) in {**common, **own}.items():
            table[(stack, *path)] = (names, fns, True, ids)
    return table

"""LoRA adapters to and from HF PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

PEFT names a Linear's adapter `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]), scales it by lora_alpha / r, and flattens every projection's input and output as
HF's Linear does (q's output index n * H + h with query head n = k * G + g): our a [*in, r] and b [r, *out]
(`lora.py`) are those tensors transposed and reshaped, nothing permuted. Written atomically like `hf_io`'s
checkpoints (a temporary directory, then one rename).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_config import CheckpointError
from areal_jax.models.hf_io import _NUMPY_DTYPES, _to_host
from areal_jax.models.lora import ADAPTER_PATHS, adapter_free, adapter_state, target_layout
from areal_jax.models.lora_config import TARGETS, LoRAConfig
from areal_jax.sharding import state_shardings

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
# our target -> the HF module it adapts, below model.layers.{i}
MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def peft_name(target: str, layer: int, matrix: str) -> str:
    """The PEFT tensor name of `target`'s lora_A or lora_B (`matrix`) in `layer`."""
    return f"{PREFIX}model.layers.{layer}.{MODULES[target]}.lora_{matrix}.weight"


def peft_config(lora: LoRAConfig, base_model_name_or_path: str | None) -> dict[str, Any]:
    """The `adapter_config.json` of `lora` (PEFT's LoraConfig fields, defaults where we have no such option)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": [MODULES[t].split(".")[-1] for t in TARGETS if t in lora.targets],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True if lora.init == "kaiming" else "gaussian",
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
        "revision": None,
    }


def lora_config_from_peft(config: dict[str, Any]) -> LoRAConfig:
    """Our `LoRAConfig` of a PEFT `adapter_config.json`; refuses what we cannot serve as PEFT would."""
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{ADAPTER_CONFIG}: peft_type {config.get('peft_type')!r} is not supported; only 'LORA'")
    for key, plain in (("use_rslora", False), ("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if config.get(key, plain) != plain:
            raise CheckpointError(f"{ADAPTER_CONFIG}: {key}={config[key]!r} is not supported (only {plain!r})")
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save"):
        if config.get(key):
            raise CheckpointError(f"{ADAPTER_CONFIG}: {key}={config[key]!r} is not supported")
    by_module = {module.split(".")[-1]: target for target, module in MODULES.items()}
    modules = config.get("target_modules") or []
    if isinstance(modules, str):
        raise CheckpointError(f"{ADAPTER_CONFIG}: target_modules as a pattern ({modules!r}) is not supported")
    unknown = [m for m in modules if m not in by_module]
    if unknown:
        raise CheckpointError(f"{ADAPTER_CONFIG}: target_modules {unknown} are not supported; known: {list(by_module)}")
    targets = tuple(t for t in TARGETS if MODULES[t].split(".")[-1] in modules)
    init: Literal["kaiming", "gaussian"] = "gaussian" if config.get("init_lora_weights") == "gaussian" else "kaiming"
    dropout = float(config.get("lora_dropout") or 0.0)  # training only: serving and evaluation never drop out
    return LoRAConfig(
        rank=int(config["r"]), alpha=float(config["lora_alpha"]), targets=targets, init=init, dropout=dropout
    )


def iter_peft_tensors(cfg: ModelConfig, state: nnx.State) -> Any:
    """(PEFT name, array) of every adapter tensor of a LoRA model's state, in `cfg`'s export dtype."""
    assert cfg.lora is not None
    flat = dict(nnx.to_flat_state(adapter_state(state)))
    dtype = _NUMPY_DTYPES[cfg.resolved_export_dtype]
    for target in cfg.lora.targets:
        where, _ = ADAPTER_PATHS[target]
        a_YxIxR = _to_host(flat[("layers", *where, "a")].get_value()).astype(dtype, copy=False)
        b_YxRxO = _to_host(flat[("layers", *where, "b")].get_value()).astype(dtype, copy=False)
        for layer in range(cfg.num_layers):
            a, b = a_YxIxR[layer], b_YxRxO[layer]
            yield peft_name(target, layer, "A"), np.ascontiguousarray(a.reshape(-1, a.shape[-1]).T)
            yield peft_name(target, layer, "B"), np.ascontiguousarray(b.reshape(b.shape[0], -1).T)


def save_peft_adapter(
    cfg: ModelConfig, state: nnx.State, directory: str | Path, base_model_name_or_path: str | None
) -> Path:
    """Write the adapters of `state` (a LoRA model's state, or its adapters alone) as a PEFT adapter directory.
    Every process gathers; process 0 writes."""
    if cfg.lora is None:
        raise ValueError("save_peft_adapter: the model has no LoRA adapters (model.lora is null)")
    directory = Path(directory)
    tensors = dict(iter_peft_tensors(cfg, state))
    if jax.process_index() != 0:
        return directory
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config(cfg.lora, base_model_name_or_path), indent=2) + "\n")
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)
    return directory


def read_adapter_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        raise CheckpointError(f"{path} not found: not a PEFT adapter directory")
    return json.loads(path.read_text())


def load_peft_adapter(directory: str | Path, base: Decoder) -> Decoder:
    """`base` (a decoder with or without adapters) with the PEFT adapter in `directory`: a LoRA decoder of the
    adapter's rank, alpha and targets over `base`'s weights (its arrays, not copies), each adapter placed like
    `base`'s parameters are (on its mesh by the logical rules, or on its device)."""
    directory = Path(directory)
    lora = lora_config_from_peft(read_adapter_config(directory))
    try:
        cfg = base.config.replace(lora=lora)
    except Exception as err:  # a rank above a projection's width: the adapter does not fit this base
        raise CheckpointError(f"{directory}: the adapter does not fit the base model: {err}") from None
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
    base_state = adapter_free(nnx.state(base))
    flat = dict(nnx.to_flat_state(adapter_state(abstract)))
    placement = _adapter_shardings(adapter_state(abstract), base_state)
    with safe_open(str(directory / ADAPTER_WEIGHTS), framework="numpy") as handle:
        names = set(handle.keys())
        dtype = _NUMPY_DTYPES[cfg.param_dtype]
        for target in lora.targets:
            where, _ = ADAPTER_PATHS[target]
            in_shape, _, out_shape, _ = target_layout(cfg, target)
            want = {"A": (lora.rank, math.prod(in_shape)), "B": (math.prod(out_shape), lora.rank)}
            per_layer: dict[str, list[np.ndarray]] = {"A": [], "B": []}
            for layer in range(cfg.num_layers):
                for matrix in ("A", "B"):
                    name = peft_name(target, layer, matrix)
                    if name not in names:
                        raise CheckpointError(f"{directory}: tensor {name!r} is missing from {ADAPTER_WEIGHTS}")
                    tensor = handle.get_tensor(name)
                    if tensor.shape != want[matrix]:
                        raise CheckpointError(
                            f"{directory}: tensor {name!r} has shape {tensor.shape}, expected {want[matrix]}"
                        )
                    per_layer[matrix].append(tensor.astype(dtype))
            a = np.stack([t.T.reshape(*in_shape, lora.rank) for t in per_layer["A"]])
            b = np.stack([t.T.reshape(lora.rank, *out_shape) for t in per_layer["B"]])
            for key, value in (("a", a), ("b", b)):
                path = ("layers", *where, key)
                flat[path] = flat[path].replace(jax.device_put(value, placement[path].get_value()))
    return nnx.merge(graphdef, nnx.merge_state(base_state, nnx.from_flat_state(flat)))


def _adapter_shardings(abstract_adapters: nnx.State, base_state: nnx.State) -> dict[tuple[Any, ...], Any]:
    """Where each adapter goes beside `base_state`: by the logical rules on its mesh, or on its one device."""
    sharding = jax.tree.leaves(base_state)[0].sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        shardings = state_shardings(abstract_adapters, sharding.mesh)
    else:
        shardings = jax.tree.map(lambda _: sharding, abstract_adapters)
    return dict(nnx.to_flat_state(shardings))

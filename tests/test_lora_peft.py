"""LoRA adapters in HF PEFT's format: names, shapes and config as PEFT writes them, their meaning checked against
transformers with PEFT's merge rule (W + B A alpha / r) applied by hand, and a load back with equal logits."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from areal_jax.config import load_experiment
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_config import CheckpointError
from areal_jax.models.hf_io import load_hf_checkpoint
from areal_jax.models.lora_config import LoRAConfig
from areal_jax.models.peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_peft_adapter, save_peft_adapter
from areal_jax.system.assembly import export_policy
from tests.hf_fixtures import TINY, hf_logits, make_hf_checkpoint
from tests.test_lora_model import with_random_adapters

LORA = LoRAConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
TOKENS = [3, 14, 15, 92, 65, 35, 8, 9]
MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def _ours(model: Decoder) -> np.ndarray:
    n = len(TOKENS)
    tokens = jnp.asarray([TOKENS])
    return np.asarray(model.logits(tokens, jnp.ones((1, n), jnp.int32), jnp.arange(n)[None])[0])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A transformers Qwen2 base, our LoRA model over it with random adapters, and the adapter exported."""
    root = tmp_path_factory.mktemp("peft")
    base_model = make_hf_checkpoint("qwen2-untied", root / "base")
    cfg, model = load_hf_checkpoint(root / "base", lora=LORA)
    model = nnx.merge(nnx.graphdef(model), with_random_adapters(model, seed=2, std=0.1))
    save_peft_adapter(cfg, nnx.state(model), root / "adapter", str(root / "base"))
    return root, base_model, cfg, model


def test_the_adapter_directory_is_peft_s(exported):
    root, _, _cfg, _ = exported
    assert sorted(p.name for p in (root / "adapter").iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    config = json.loads((root / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, str(root / "base"))
    assert config["target_modules"] == list(MODULES)
    tensors = load_file(str(root / "adapter" / ADAPTER_WEIGHTS))
    d, f = TINY["hidden_size"], TINY["intermediate_size"]
    h = d // TINY["num_attention_heads"]
    width = {"q_proj": (d, d), "k_proj": (d, 2 * h), "v_proj": (d, 2 * h), "o_proj": (d, d)}
    width |= {"gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
    expected = {}
    for layer in range(TINY["num_hidden_layers"]):
        for module, parent in MODULES.items():
            stem = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            fan_in, fan_out = width[module]
            expected[f"{stem}.lora_A.weight"] = (4, fan_in)
            expected[f"{stem}.lora_B.weight"] = (fan_out, 4)
    assert {name: t.shape for name, t in tensors.items()} == expected


def test_the_adapter_means_what_peft_means_against_transformers(exported):
    """transformers' base with PEFT's merge W += B @ A * lora_alpha / r done by hand from the file gives our
    model's logits (our adapters applied in the matmul)."""
    import torch

    root, base_model, _, model = exported
    tensors = load_file(str(root / "adapter" / ADAPTER_WEIGHTS))
    config = json.loads((root / "adapter" / ADAPTER_CONFIG).read_text())
    scale = config["lora_alpha"] / config["r"]
    with torch.no_grad():
        for name, param in base_model.named_parameters():
            stem = "base_model.model." + name.removesuffix(".weight")
            if f"{stem}.lora_A.weight" in tensors:
                a, b = tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"]
                param.add_(torch.from_numpy(b @ a * scale))
    reference = hf_logits(base_model, TOKENS)
    np.testing.assert_allclose(_ours(model), reference, atol=2e-4, rtol=1e-4)
    plain_logits = hf_logits(type(base_model).from_pretrained(root / "base", dtype=torch.float32), TOKENS)
    assert np.abs(reference - plain_logits).max() > 1e-2  # the adapters change the model


def test_the_export_loads_back_with_equal_logits(exported):
    root, _, _cfg, model = exported
    _, plain = load_hf_checkpoint(root / "base")
    assert plain.config.lora is None
    reloaded = load_peft_adapter(root / "adapter", plain)
    assert reloaded.config.lora == LORA.replace(init="kaiming")
    np.testing.assert_array_equal(_ours(reloaded), _ours(model))


def test_a_missing_tensor_and_an_unknown_target_are_refused(exported, tmp_path):
    root, _, _, _ = exported
    _, plain = load_hf_checkpoint(root / "base")
    tensors = load_file(str(root / "adapter" / ADAPTER_WEIGHTS))
    missing = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    del tensors[missing]
    config = json.loads((root / "adapter" / ADAPTER_CONFIG).read_text())
    for name, changed in (("cut", config), ("unknown", {**config, "target_modules": ["q_proj", "lm_head"]})):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / ADAPTER_WEIGHTS))
        (tmp_path / name / ADAPTER_CONFIG).write_text(json.dumps(changed))
    with pytest.raises(CheckpointError, match=f"tensor '{missing}' is missing"):
        load_peft_adapter(tmp_path / "cut", plain)
    with pytest.raises(CheckpointError, match=r"target_modules \['lm_head'\] are not supported"):
        load_peft_adapter(tmp_path / "unknown", plain)


def test_a_lora_run_exports_the_adapter_its_base_and_merged_weights(tmp_path: Path):
    cfg = load_experiment(
        None,
        [
            "model.lora.rank=2",
            "model.lora.targets=[q,v,down]",
            "model.lora.export_merged=true",
            "model.lora.dropout=0.1",
        ],
    )
    model = Decoder(cfg.model, nnx.Rngs(0))
    model = nnx.merge(nnx.graphdef(model), with_random_adapters(model, seed=4, std=0.3))
    out = export_policy(cfg, model, tmp_path / "final")
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "final" / "base").absolute())
    assert config["target_modules"] == ["q_proj", "v_proj", "down_proj"]
    assert config["lora_dropout"] == 0.1  # the run's, as PEFT would train on with it
    _, base = load_hf_checkpoint(out / "base")
    _, merged = load_hf_checkpoint(out / "merged")
    assert merged.config.lora is None
    want = _ours(model)
    np.testing.assert_allclose(_ours(merged), want, atol=2e-5)
    reloaded = load_peft_adapter(out, base)
    assert reloaded.config.lora.dropout == 0.1
    np.testing.assert_array_equal(_ours(reloaded), want)  # scoring never drops out

"""HF checkpoint I/O: bit-exact round trips, transformers loading our export, clear refusals."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from areal_jax.models.hf_config import CheckpointError
from areal_jax.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
from tests.hf_fixtures import hf_logits, make_hf_checkpoint


def _all_tensors(directory):
    index = directory / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else {"model.safetensors"}
    tensors = {}
    for fname in files:
        tensors.update(load_file(str(directory / fname)))
    return tensors


@pytest.mark.parametrize("variant,dtype", [("qwen2-untied", "float32"), ("qwen3-tied", "bfloat16")])
def test_round_trip_is_bit_exact_and_transformers_loads_export(variant, dtype, tmp_path):
    import torch
    import transformers

    make_hf_checkpoint(variant, tmp_path / "src", dtype=dtype)
    cfg, model = load_hf_checkpoint(tmp_path / "src")
    assert cfg.param_dtype == "float32" and cfg.export_dtype == dtype  # fp32 master params, exported as stored
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(nnx.state(model)))
    save_hf_checkpoint(cfg, model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == dtype
    original, exported = _all_tensors(tmp_path / "src"), _all_tensors(tmp_path / "out")
    assert set(exported) <= set(original)
    for name, array in exported.items():
        assert array.dtype == original[name].dtype, name
        assert np.array_equal(array.view(np.uint8), original[name].view(np.uint8)), name

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    tokens = [3, 14, 15, 92, 65, 35]
    source = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32)
    np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(source, tokens))


def test_sharded_index_export_and_load(tmp_path):
    make_hf_checkpoint("qwen2-untied", tmp_path / "src")
    cfg, model = load_hf_checkpoint(tmp_path / "src")
    save_hf_checkpoint(cfg, model, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    assert not list(tmp_path.glob(".sharded.tmp-*"))
    _, again = load_hf_checkpoint(tmp_path / "sharded")
    tokens = jnp.asarray([[5, 6, 7, 8]])
    seg, pos = jnp.ones((1, 4), jnp.int32), jnp.arange(4)[None]
    np.testing.assert_array_equal(model.logits(tokens, seg, pos), again.logits(tokens, seg, pos))


def test_export_replaces_previous_directory(tmp_path):
    make_hf_checkpoint("qwen2-untied", tmp_path / "src")
    cfg, model = load_hf_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    save_hf_checkpoint(cfg, model, out)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_unsupported_architecture_is_refused(tmp_path):
    make_hf_checkpoint("qwen2-untied", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["MixtralForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="MixtralForCausalLM"):
        load_hf_checkpoint(tmp_path)


def test_shape_mismatch_names_the_tensor(tmp_path):
    make_hf_checkpoint("qwen2-untied", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*shape \(79, 48\)"):
        load_hf_checkpoint(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    make_hf_checkpoint("qwen2-untied", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.0.self_attn.k_proj.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias.*missing"):
        load_hf_checkpoint(tmp_path)


def test_missing_files_are_reported(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_hf_checkpoint(tmp_path)
    make_hf_checkpoint("qwen2-untied", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_hf_checkpoint(tmp_path)

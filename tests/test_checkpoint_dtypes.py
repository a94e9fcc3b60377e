"""HF checkpoints in the dtype real ones ship in (bf16): loaded into fp32 master params, trained, exported back
in bf16; `model.*` run-time choices apply over a checkpoint and architecture overrides it contradicts are
refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from areal_jax.cli import main
from areal_jax.config import load_experiment
from areal_jax.configuration import ConfigError
from areal_jax.jobs.evaluate import restore_trained_params
from areal_jax.jobs.starting_policy import load_policy
from areal_jax.models.hf_io import load_hf_checkpoint
from areal_jax.system.assembly import build_tokenizer, policy_config
from tests.tiny_hf_run import make_tiny_hf_run

RECIPE = "configs/recipes/qwen25_05b_gsm8k_smoke.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_run(tmp_path_factory.mktemp("bf16-run"))


def digit_share(completion: str, task) -> tuple[float, dict[str, float]]:
    """A reward that differs between the samples of a group (so the update is not zero): the share of digits."""
    share = sum(c.isdigit() for c in completion) / max(len(completion), 1)
    return share, {"correct": float(share > 0.5)}


def _overrides(tmp_path: Path, tiny, *extra: str) -> list[str]:
    return [
        f"output_dir={tmp_path}",
        f"hf_checkpoint={tiny.checkpoint}",
        f"dataset.files=[{{path: '{tiny.gsm8k}', mapping: gsm8k}}]",
        *extra,
    ]


def _logits(model, tokens: list[int]) -> np.ndarray:
    ids = jnp.asarray([tokens])
    return np.asarray(model.logits(ids, jnp.ones_like(ids), jnp.arange(len(tokens))[None]))


def test_the_tiny_checkpoint_is_stored_in_bf16(tiny):
    assert json.loads((tiny.checkpoint / "config.json").read_text())["dtype"] == "bfloat16"
    stored = load_file(str(tiny.checkpoint / "model.safetensors"))
    assert {array.dtype for array in stored.values()} == {np.dtype(ml_dtypes.bfloat16)}


def test_bf16_checkpoint_trains_in_fp32_exports_bf16_and_reloads(tmp_path, tiny):
    overrides = _overrides(
        tmp_path,
        tiny,
        "train_steps=2",
        "reward.kind=tests.test_checkpoint_dtypes:digit_share",
        "rollout.workflow.truncation=keep",
    )
    assert main(["train", RECIPE, *overrides]) == 0
    cfg = load_experiment(RECIPE, overrides)
    export = cfg.run_dir / "hf_final"
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    assert {a.dtype for a in load_file(str(export / "model.safetensors")).values()} == {np.dtype(ml_dtypes.bfloat16)}

    _, initial = load_hf_checkpoint(tiny.checkpoint)
    _, reloaded = load_hf_checkpoint(export)
    trained, _ = restore_trained_params(cfg.run_dir / "checkpoints", nnx.state(initial), 2)
    trained_leaves = jax.tree.leaves(trained)
    assert {leaf.dtype for leaf in trained_leaves} == {jnp.dtype(jnp.float32)}  # the master params stayed fp32
    # training moved the fp32 master params off the bf16 grid of the checkpoint it started from
    off_grid = [np.asarray(x) != np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32) for x in trained_leaves]
    assert any(mask.any() for mask in off_grid)
    # the export is the trained params rounded to bf16, exactly
    for exported, master in zip(jax.tree.leaves(nnx.state(reloaded)), trained_leaves, strict=True):
        rounded = np.asarray(master).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(exported), rounded)
    # so its logits are the trained policy's within bf16 rounding of the weights
    trained_model = nnx.merge(nnx.graphdef(initial), trained)
    tokens = [5, 17, 40, 2, 99, 63, 8]
    want, got = _logits(trained_model, tokens), _logits(reloaded, tokens)
    assert not np.array_equal(want, _logits(initial, tokens))
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())


def test_model_run_time_choices_apply_over_an_hf_checkpoint(tmp_path, tiny):
    cfg = load_experiment(RECIPE, _overrides(tmp_path, tiny))
    tokenizer = build_tokenizer(cfg)
    default = load_policy(cfg, None, tokenizer)
    assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(default))} == {jnp.dtype(jnp.float32)}
    chosen = cfg.replace(
        model=cfg.model.replace(param_dtype="bfloat16", compute_dtype="bfloat16", remat="dots", scan_layers=False)
    )
    model = load_policy(chosen, None, tokenizer)
    assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(model))} == {jnp.dtype(jnp.bfloat16)}
    assert (model.config.compute_dtype, model.config.remat, model.config.scan_layers) == ("bfloat16", "dots", False)
    assert model.config.export_dtype == "bfloat16"  # the checkpoint's own
    assert policy_config(chosen, tokenizer) == model.config
    exported_as = cfg.replace(model=cfg.model.replace(export_dtype="float32"))
    assert policy_config(exported_as, tokenizer).export_dtype == "float32"


def test_an_architecture_override_the_checkpoint_contradicts_is_refused_naming_the_key(tmp_path, tiny, capsys):
    cfg = load_experiment(RECIPE, _overrides(tmp_path, tiny, "model.num_layers=5"))
    with pytest.raises(ConfigError, match=r"model\.num_layers: value 5 contradicts the HF checkpoint") as err:
        policy_config(cfg, build_tokenizer(cfg))
    assert "num_layers is 2" in str(err.value)
    capsys.readouterr()
    assert main(["train", RECIPE, *_overrides(tmp_path, tiny, "model.hidden_size=48")]) == 2
    printed = capsys.readouterr().err.strip().splitlines()
    assert len(printed) == 1 and "model.hidden_size: value 48 contradicts the HF checkpoint" in printed[0]
    # a value equal to the checkpoint's is no contradiction
    same = load_experiment(RECIPE, _overrides(tmp_path, tiny, "model.num_layers=2"))
    assert policy_config(same, build_tokenizer(same)).num_layers == 2


def test_a_checkpoint_dtype_that_cannot_load_is_one_line_and_exit_2(tmp_path, tiny, capsys):
    broken = tmp_path / "fp8"
    broken.mkdir()
    for path in tiny.checkpoint.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    config = json.loads((broken / "config.json").read_text())
    config["dtype"] = "float8_e4m3fn"
    (broken / "config.json").write_text(json.dumps(config))
    overrides = _overrides(tmp_path, tiny)
    overrides[1] = f"hf_checkpoint={broken}"
    assert main(["train", RECIPE, *overrides]) == 2
    printed = capsys.readouterr().err.strip().splitlines()
    assert len(printed) == 1 and "'float8_e4m3fn' is not supported" in printed[0]


def test_compute_dtype_auto_is_bf16_on_accelerators_and_fp32_on_cpu(caplog):
    from areal_jax.inference.engine import Engine, EngineConfig
    from areal_jax.models.config import ModelConfig
    from areal_jax.models.decoder import Decoder

    auto = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    assert auto.compute_dtype == "auto"
    assert [auto.compute_dtype_on(p) for p in ("tpu", "gpu", "cpu")] == ["bfloat16", "bfloat16", "float32"]
    assert jax.default_backend() == "cpu" and auto.compute_jnp_dtype == jnp.float32
    Engine(Decoder(auto, nnx.Rngs(0)), EngineConfig(max_slots=2, max_length=32))
    assert "XLA:CPU converts" not in caplog.text
    # bf16 set by hand on CPU is honoured, with the cost named
    Engine(Decoder(auto.replace(compute_dtype="bfloat16"), nnx.Rngs(0)), EngineConfig(max_slots=2, max_length=32))
    assert "compute_dtype is bfloat16 on CPU: XLA:CPU converts" in caplog.text

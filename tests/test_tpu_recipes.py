"""The `_tpu` recipes fit their slices and the `_gpu` recipes fit one 8 x 80 GiB host, by the memory plan from
the checkpoints' config.json copies in configs/sizing (no checkpoint, no tokenizer).

The compiles are `benchmarks/tpu_compile.py --recipe NAME [--layers N]` (docs/tpu.md): at the recipes' rows of
up to 32,768 tokens they are too heavy for the suite (docs/tpu.md, "Recipes")."""

from pathlib import Path

import pytest

from areal_jax.cli import main
from areal_jax.config import load_experiment
from areal_jax.planning.architecture import SIZING, architecture, config_json
from areal_jax.planning.hardware import hardware, mesh_warnings, plan_for_hardware
from areal_jax.planning.memory import GIB, USABLE_SHARE

RECIPES = Path(__file__).resolve().parents[1] / "configs" / "recipes"
# the `_tpu` recipes and the slice each is sized for (benchmarks/tpu_compile.py's RECIPES)
TPU = {
    "r1_distill_qwen_1p5b_deepscaler_tpu": "v5p-8",
    "r1_distill_qwen_1p5b_deepscaler_tpu_v6e": "v6e-8",
    "qwen25_05b_gsm8k_tpu": "v5e-8",
    "deepcoder_code_tpu": "v5p-16",
    "deepcoder_14b_code_tpu": "v5p-64",
    "qwen3_30b_a3b_deepscaler_tpu": "v5p-64",
    "qwen3_5_35b_a3b_deepscaler_tpu": "v5p-128",
    "qwen3_5_27b_deepscaler_tpu": "v5p-128",
}
# (layers, width, KV heads, params in billions) of each checkpoint: its config.json, read back
SHAPES = {
    "DeepSeek-R1-Distill-Qwen-1.5B": (28, 1536, 2, 1.78),
    "Qwen2.5-0.5B-Instruct": (24, 896, 2, 0.49),
    "DeepSeek-R1-Distill-Qwen-7B": (28, 3584, 4, 7.62),
    "DeepCoder-14B-Preview": (48, 5120, 8, 14.77),
    "Qwen3-30B-A3B": (48, 2048, 4, 30.53),
    # the text model only: the published 35B also counts the vision tower and the multi-token-prediction layer,
    # which the loader skips (models/hybrid_io.py)
    "Qwen3.5-35B-A3B": (40, 2048, 2, 34.66),
    "Qwen3.5-27B": (64, 5120, 4, 26.90),
}


def test_the_tpu_recipes_are_there():
    assert set(TPU) <= {p.stem for p in RECIPES.glob("*_tpu*.yaml")}


@pytest.mark.parametrize("recipe", sorted(TPU))
def test_tpu_recipe_fits_its_slice_by_the_plan(recipe):
    cfg = load_experiment(str(RECIPES / f"{recipe}.yaml"), [])
    source = config_json(cfg)
    # the checkpoint is not here: the shapes come from its config.json's copy, a real checkpoint's
    assert source is not None and source.parent.parent == SIZING, source
    layers, width, kv_heads, billions = SHAPES[source.parent.name]
    model = architecture(cfg)
    assert (model.num_layers, model.hidden_size, model.num_kv_heads) == (layers, width, kv_heads)
    assert model.num_params() / 1e9 == pytest.approx(billions, abs=0.01)
    where = hardware(TPU[recipe], None, None, None)
    assert not mesh_warnings(cfg, where)  # each side's chips divide the slice's (XLA:TPU's all-reduce groups)
    plan = plan_for_hardware(cfg, where)
    usable = where.device_bytes * USABLE_SHARE
    for side in plan.sides:
        assert side.per_device <= usable, (recipe, side.side, side.per_device / GIB)
    # the dense cache splits its slots over the rollout's chips (else each chip holds every slot)
    inference = next(side for side in plan.sides if side.side == "inference")
    shards = inference.mesh_shape["data"] * inference.mesh_shape["fsdp"]
    assert cfg.rollout.engine.max_slots % shards == 0, (cfg.rollout.engine.max_slots, inference.mesh_shape)


@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPES.glob("*_gpu.yaml")))
def test_gpu_recipe_fits_one_8x80_host_by_the_plan(recipe, capsys):
    args = ["plan", "--memory", "--devices", "8", "--device-memory-gib", "80", str(RECIPES / f"{recipe}.yaml")]
    assert main(args) == 0, capsys.readouterr().err
    assert "fits:" in capsys.readouterr().out

"""The trainer's activation line for a Qwen3.5 hybrid: each layer is its own remat unit inside a period's scan step
(`models/hybrid.py`), so the plan keeps one input per layer and one layer's intermediates, as for a `Decoder`.

XLA:TPU measured the effect (docs/tpu.md, "Recipes": `benchmarks/tpu_compile.py --recipe qwen3_5_35b_a3b_deepscaler_tpu
--layers 4`, one period of Qwen3.5-35B-A3B on v5p-128, one row of 32,768 tokens a chip): the gradient program's
temporaries fell from 59.16 GiB (the whole period as the remat unit: four layers' intermediates at once) to 30.07 GiB.
The plan's 12.16 GiB line is still below the compiler's (0.44 of the program): the sparse layers' term is low on TPU,
as for Qwen3-30B-A3B (docs/tpu.md); the tests below hold the plan to the model's structure, not to that figure."""

import json
from pathlib import Path

import pytest

from areal_jax.config import load_experiment
from areal_jax.planning.hardware import hardware, plan_for_hardware
from areal_jax.planning.memory import GIB

SIZING = Path(__file__).resolve().parents[1] / "configs" / "sizing" / "Qwen3.5-35B-A3B" / "config.json"
RECIPE = "configs/recipes/qwen3_5_35b_a3b_deepscaler_tpu.yaml"
KEPT_INPUT_GIB = 32768 * 2048 * 2 / GIB  # a layer's input, one row of 32,768 tokens x 2048 in bf16


def _activations_gib(directory: Path, layers: int, *overrides: str) -> float:
    directory.mkdir()
    hf = json.loads(SIZING.read_text())
    hf["text_config"]["num_hidden_layers"] = layers
    hf["text_config"]["layer_types"] = hf["text_config"]["layer_types"][:layers]
    (directory / "config.json").write_text(json.dumps(hf))
    cfg = load_experiment(RECIPE, [f"hf_checkpoint={directory}", *overrides])
    plan = plan_for_hardware(cfg, hardware("v5p-128", None, None, None))
    trainer = next(side for side in plan.sides if side.side == "trainer")
    return next(item.bytes for item in trainer.items if item.name.startswith("activations")) / GIB


def test_a_hybrid_keeps_one_input_per_layer_and_one_layers_intermediates(tmp_path):
    """Ten periods keep 36 more layer inputs than one, nothing else; without remat every layer's intermediates."""
    four, forty = _activations_gib(tmp_path / "4", 4), _activations_gib(tmp_path / "40", 40)
    assert forty - four == pytest.approx(36 * KEPT_INPUT_GIB, rel=1e-6)
    one_layer = four - 4 * KEPT_INPUT_GIB
    assert one_layer > 10 * KEPT_INPUT_GIB  # a sparse layer's dispatch rows dwarf its input
    bare = _activations_gib(tmp_path / "none", 4, "model.remat=none")
    assert bare == pytest.approx(4 * one_layer, rel=1e-6)

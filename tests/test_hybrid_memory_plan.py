"""The trainer's activation line for a Qwen3.5 hybrid: its remat unit is a scan step, one period of the layer
pattern (`models/hybrid.py`), so the backward pass holds all of the period's layers' intermediates at once.

XLA:TPU measured it (docs/tpu.md, "Recipes": `benchmarks/tpu_compile.py --recipe qwen3_5_35b_a3b_deepscaler_tpu
--layers 4`, one period of Qwen3.5-35B-A3B, one row of 32,768 tokens a chip): 58.66 GiB of temporaries a trainer
chip in the gradient program, where the plan, counting one layer, said 12.16 GiB of activations."""

import json
from pathlib import Path

import pytest

from areal_jax.config import load_experiment
from areal_jax.planning.hardware import hardware, plan_for_hardware
from areal_jax.planning.memory import GIB

SIZING = Path(__file__).resolve().parents[1] / "configs" / "sizing" / "Qwen3.5-35B-A3B" / "config.json"
RECIPE = "configs/recipes/qwen3_5_35b_a3b_deepscaler_tpu.yaml"
COMPILER_GRADIENT_TEMPORARIES_GIB = 58.66  # v5p, 4 layers (3 linear + 1 full), 32,768 tokens a chip


def _activations_gib(tmp_path: Path, layers: int) -> float:
    hf = json.loads(SIZING.read_text())
    hf["text_config"]["num_hidden_layers"] = layers
    hf["text_config"]["layer_types"] = hf["text_config"]["layer_types"][:layers]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = load_experiment(RECIPE, [f"hf_checkpoint={tmp_path}"])
    plan = plan_for_hardware(cfg, hardware("v5p-128", None, None, None))
    trainer = next(side for side in plan.sides if side.side == "trainer")
    return next(item.bytes for item in trainer.items if item.name.startswith("activations")) / GIB


def test_a_hybrids_activations_count_one_period_of_layers_as_the_compiler_did(tmp_path):
    planned = _activations_gib(tmp_path, 4)
    assert planned == pytest.approx(COMPILER_GRADIENT_TEMPORARIES_GIB, rel=0.25), planned


def test_a_hybrids_activations_grow_by_the_kept_period_inputs_only(tmp_path):
    """Ten periods keep nine more period inputs (32,768 x 2048 in bf16: 0.125 GiB each), nothing else."""
    four, forty = _activations_gib(_dir(tmp_path, "4"), 4), _activations_gib(_dir(tmp_path, "40"), 40)
    assert forty - four == pytest.approx(9 * 32768 * 2048 * 2 / GIB, rel=1e-6)


def _dir(parent: Path, name: str) -> Path:
    (parent / name).mkdir()
    return parent / name

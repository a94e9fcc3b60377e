"""The trainer's activation line for a Qwen3.5 hybrid: each layer is its own remat unit inside a period's scan step
(`models/hybrid.py`), so the plan keeps one input per layer and one layer's intermediates, as for a `Decoder`.

XLA:TPU measured the effect (docs/tpu.md, "Recipes": `benchmarks/tpu_compile.py --recipe qwen3_5_35b_a3b_deepscaler_tpu
--layers 4`, one period of Qwen3.5-35B-A3B on v5p-128, one row of 32,768 tokens a chip): the gradient program's
temporaries fell from 59.16 GiB (the whole period as the remat unit: four layers' intermediates at once) to 30.07 GiB.
A linear layer's intermediates are its own term (`memory_terms._linear_layer_activations`): the delta rule's fp32
arrays, which XLA:TPU's peak breakdown of Qwen3.5-27B showed beside the projections. Below, the term is checked
against XLA:CPU's temporaries for one layer's gradient as the tokens, value heads and chunk length change.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from areal_jax.config import load_experiment
from areal_jax.planning.hardware import hardware, plan_for_hardware
from areal_jax.planning.memory import GIB
from areal_jax.planning.memory_terms import _linear_layer_activations

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


def _linear_layer_plan_over_compiler(tokens: int, value_heads: int, chunk: int) -> float:
    """The plan's term for one linear layer (mixer and MLP, fp32 compute) over XLA:CPU's temporaries for its
    gradient (the backward of one remat unit: its forward recomputed, then its cotangents)."""
    from areal_jax.models.hybrid import LinearAttentionLayer

    hidden, intermediate = 512, 1024
    model = load_experiment(
        "configs/train_cpu.yaml",
        [
            "model.family=qwen3_5",
            "model.qkv_bias=false",
            f"model.hidden_size={hidden}",
            f"model.intermediate_size={intermediate}",
            "model.num_heads=4",
            "model.num_kv_heads=2",
            "model.num_layers=2",
            "model.compute_dtype=float32",
            "model.hybrid={layer_types: [linear_attention, full_attention], "
            f"linear_num_key_heads: {value_heads // 2}, linear_num_value_heads: {value_heads}, "
            f"linear_key_head_dim: 128, linear_value_head_dim: 128, chunk: {chunk}}}",
        ],
    ).model
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(LinearAttentionLayer(model, nnx.Rngs(0)))
    reset = jnp.zeros((1, tokens), bool).at[:, 0].set(True)

    def loss(state: nnx.State, x: jax.Array) -> jax.Array:
        y, _ = nnx.merge(graphdef, state)(x, reset)
        return jnp.sum(y * y)

    x = jax.ShapeDtypeStruct((1, tokens, hidden), jnp.float32)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).compile()
    planned = _linear_layer_activations(model, tokens, 4, 4 * hidden + 3 * intermediate)
    return planned / compiled.memory_analysis().temp_size_in_bytes


def test_a_linear_layers_term_scales_with_its_tokens_heads_and_chunk_as_the_compilers_temporaries():
    """Doubling the tokens or the value heads, halving or doubling the chunk: the plan's term keeps the same share of
    XLA:CPU's temporaries (within 8%), so each of its parts grows as the compiled program's does. XLA:CPU holds
    about 1.3x the count (it fuses less than XLA:TPU, whose peak the count matched)."""
    base = _linear_layer_plan_over_compiler(2048, 8, 64)
    assert 0.6 < base <= 1.0, base
    for tokens, heads, chunk in ((4096, 8, 64), (2048, 16, 64), (2048, 8, 32), (2048, 8, 128)):
        ratio = _linear_layer_plan_over_compiler(tokens, heads, chunk)
        assert ratio == pytest.approx(base, rel=0.08), (tokens, heads, chunk, ratio, base)

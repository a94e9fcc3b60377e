"""`areal-jax compile` of a Qwen3.5 (hybrid) policy for a Cloud TPU slice on this CPU machine: the trainer's
programs (the chunked delta rule's scans, forward and backward) and the engine's (prefill building the recurrent
states, their insert into the slots, the decode step moving them on) all compile for 2 + 2 v5e chips, and the
recurrent states a chip holds between decode steps show in the report beside the plan's line for them. Without
compiling: the engine's resident lines and a decode step's HBM bytes on a mesh of this machine's devices."""

import json
from pathlib import Path

import jax
import pytest

from areal_jax.cli import main
from areal_jax.compile.engine_programs import EngineOnMesh
from areal_jax.config import load_experiment
from areal_jax.planning.memory import plan_memory
from areal_jax.sharding import MeshConfig, make_mesh

ROOT = Path(__file__).resolve().parents[1]
SLOTS, LENGTH, CHIPS = 64, 32, 2  # the engine's slots and length (configs/train_cpu.yaml), chips per side
VALUE_HEADS, KEY_DIM, VALUE_DIM = 4, 128, 128  # a state [4, 128, 128] fp32 fills TPU tiles: no padding
TINY = [
    "model.family=qwen3_5",
    "model.qkv_bias=false",
    "model.hidden_size=128",
    "model.num_heads=1",  # head dim 128: the full layer's KV cache fills its tiles as well
    "model.num_kv_heads=1",
    "model.num_layers=2",
    "model.vocab_size=512",
    "model.max_position_embeddings=128",
    "model.scan_layers=true",
    "model.remat=none",
    "model.hybrid={layer_types: [linear_attention, full_attention], linear_num_key_heads: 2, "
    f"linear_num_value_heads: {VALUE_HEADS}, linear_key_head_dim: {KEY_DIM}, "
    f"linear_value_head_dim: {VALUE_DIM}, chunk: 16}}",
    "trainer.packing.rows=8",
    "trainer.packing.token_budget=384",
    "rollout.staleness.batch_prompts=1",
    "rollout.inference_share=1",
    "rollout.trainer_share=1",
]


def _states_per_chip(compute_bytes: int) -> int:
    """A chip's share (64 slots over 2 chips) of the one linear layer's fp32 states [4, 128, 128] and its
    convolution windows [3, 2 x (2 x 128 + 2 x 128)] in the compute dtype (bf16 on TPU, float32 on CPU)."""
    state = VALUE_HEADS * KEY_DIM * VALUE_DIM * 4
    window = 3 * 2 * (2 * KEY_DIM + 2 * VALUE_DIM) * compute_bytes
    return SLOTS // CHIPS * (state + window)


def test_engine_lines_count_the_recurrent_states_per_slot():
    """On 2 + 2 of this machine's devices, nothing compiled: the decode state's recurrent states are a resident
    line of their own equal to the plan's and to their count, apart from the full layer's KV cache; a decode step
    attending half the positions reads half the KV cache but every state whole."""
    cfg = load_experiment(str(ROOT / "configs/train_cpu.yaml"), TINY)
    devices = jax.devices()[: 2 * CHIPS]
    trainer_mesh, mesh = (
        make_mesh(MeshConfig(data=1, fsdp=CHIPS, tensor=1), d) for d in (devices[:CHIPS], devices[CHIPS:])
    )
    engine = EngineOnMesh(cfg, cfg.model, mesh)
    resident = dict(engine.resident_lines())
    states = _states_per_chip(4)
    assert resident["recurrent states"] == states, resident
    kv = 2 * SLOTS // CHIPS * 128 * LENGTH * 4  # keys and values [32 slots, 1 head, 128, 32 positions], float32
    assert resident["KV cache"] == kv, resident
    plan = plan_memory(cfg, cfg.model, trainer_mesh, mesh).sides[1]
    assert [item.bytes for item in plan.items if item.name.startswith("recurrent states")] == [states]
    assert engine._cache_read(LENGTH) == kv + states
    assert engine._cache_read(LENGTH // 2) == kv // 2 + states
    # over 1 x 2 tensor chips the states split by value heads (the windows stay whole): the plan's line follows
    split = make_mesh(MeshConfig(data=1, fsdp=1, tensor=2), devices[CHIPS:])
    by_heads = dict(EngineOnMesh(cfg, cfg.model, split).resident_lines())["recurrent states"]
    plan = plan_memory(cfg, cfg.model, trainer_mesh, split).sides[1]
    assert [item.bytes for item in plan.items if item.name.startswith("recurrent states")] == [by_heads]
    assert by_heads < 2 * states  # not every slot's whole state on each chip


@pytest.mark.slow  # ~50 s on a 2-core machine, most of it XLA:TPU compiling the gradient program
def test_compile_command_compiles_a_hybrid_policy_for_a_tpu_slice(capsys):
    pytest.importorskip("libtpu")
    config = str(ROOT / "configs/train_cpu.yaml")
    assert main(["compile", config, "--topology", "v5e-4", "--json", *TINY]) == 0
    report = json.loads(capsys.readouterr().out)
    trainer, inference = report["trainer"], report["inference"]
    assert report["topology_name"] == "v5e:2x2" and not report["shared_chips"]
    assert trainer["chips"] == inference["chips"] == CHIPS and trainer["fits"] and inference["fits"]
    names = [p["name"].split(" ")[0] for p in trainer["programs"]]
    assert names == ["proximal", "gradient", "AdamW"], names
    names = [p["name"].split(" ")[0] for p in inference["programs"]]
    assert names == ["prefill", "insert", "decode"], names
    for program in trainer["programs"] + inference["programs"]:
        assert program["seconds"] > 0 and program["arguments"] > 0 and program["code"] > 0, program["name"]
    # per chip: the states and bf16 windows of 32 slots; the compiler's bytes beside the plan's line and this count
    states = _states_per_chip(2)
    resident = {line["line"]: line["bytes"] for line in inference["resident"]}
    planned = [line["bytes"] for line in inference["plan"] if line["line"].startswith("recurrent states")]
    assert planned == [states], inference["plan"]
    assert states <= resident["recurrent states"] <= 1.05 * states, resident
    # the full layer's dense cache beside them: keys and values [32 slots, 1 head, 128, 32 positions] in bf16
    assert resident["KV cache"] == 2 * SLOTS // CHIPS * 128 * LENGTH * 2, resident
    # the resident state (weights, cache, recurrent states) plan against compiler, the states counted on both sides
    agreement = {a["line"]: a for a in inference["plan_agreement"]}
    assert agreement["resident state"]["ratio"] > 0.9, agreement
    decode = next(p for p in inference["programs"] if p["name"].startswith("decode"))
    # the step updates the states in place (donated), and reads them whole whatever positions it attends
    assert decode["aliased"] >= resident["KV cache"] + resident["recurrent states"], decode
    assert decode["hbm_bytes"] > states, decode


def test_a_prefill_of_fewer_rows_than_chips_keeps_its_chunks_whole():
    """One row of 128 tokens (8 chunks of 16) of a mixture prefilled over 4 v5e chips: the expert dispatch splits
    the row's tokens over the chips, propagation carried that split into the linear layers' sequence (and so their
    chunks), and the chunk scan all-gathered every chunk at each step (on
    Qwen3.5-35B-A3B's prefill over 32 chips: 1.7 TB a call at 4 layers). With the chunk axis whole, no step
    gathers."""
    pytest.importorskip("libtpu")
    from areal_jax.compile import hlo
    from areal_jax.compile.topology import slice_devices

    overrides = [
        *TINY,
        "model.family=qwen3_5_moe",  # the experts split the row's tokens over the chips (all-to-all dispatch)
        "model.moe={num_experts: 8, experts_per_token: 2, expert_intermediate_size: 128, norm_topk_prob: true, "
        "shared_expert_intermediate_size: 128}",
        "rollout.engine.max_length=128",
        "rollout.engine.min_prefill_bucket=128",
        "rollout.engine.max_prefill_batch=1",
        "rollout.engine.max_slots=8",
    ]
    cfg = load_experiment(str(ROOT / "configs/train_cpu.yaml"), overrides)
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=1), list(slice_devices("v5e-4")))
    engine = EngineOnMesh(cfg, cfg.model, mesh)
    state = engine.engine  # the real engine's prefill, lowered under its mesh
    i32 = jax.numpy.int32
    lowered = state._prefill_batch.lower(
        engine.params, jax.ShapeDtypeStruct((1, 128), i32), jax.ShapeDtypeStruct((1,), i32)
    )
    text = lowered.compile().as_text()
    # a scan step's slice of a split array: an all-gather made by `dynamic_index_in_dim` in the loop body
    stepwise = [line.split(" = ")[0].strip() for line in text.splitlines() if _gathers_a_step(line)]
    assert not stepwise, stepwise
    gathers = [c for c in hlo.collectives(text) if c.kind == "all-gather"]
    assert gathers and all(c.runs <= 8 for c in gathers)  # none in the scan more often than the projections' loop


def _gathers_a_step(line: str) -> bool:
    return " all-gather(" in line and "dynamic_index_in_dim" in line


def test_the_proximal_pass_of_a_hybrid_keeps_activations_on_their_chips():
    """fsdp 4 x tensor 2 over 8 v5p chips, one row a chip's pair: no floating-point collective of the hybrid's
    forward (the proximal pass) carries the whole batch's rows. Unpinned, the pass ran every row on every chip over
    its slice of the hidden axis and all-reduced the MLP's activations (here 114 MiB a call; Qwen3.5-27B at 4
    layers over 32 chips: 3.9 TB a call and 25.7 GiB of temporaries, pinned 0.19 TB and 5.9 GiB). Widths at which
    XLA:TPU makes that choice; at TINY's it does not."""
    pytest.importorskip("libtpu")
    from areal_jax.compile import hlo
    from areal_jax.compile.topology import slice_devices
    from areal_jax.compile.trainer_programs import trainer_programs

    rows, length = 4, 1024
    overrides = [
        *TINY,
        "model.hidden_size=1024",
        "model.intermediate_size=4096",
        "model.num_heads=8",
        "model.num_kv_heads=2",
        "model.num_layers=4",
        "model.vocab_size=32768",
        "model.max_position_embeddings=4096",
        "model.remat=full",
        "model.hybrid={layer_types: [linear_attention, linear_attention, linear_attention, full_attention], "
        "linear_num_key_heads: 4, linear_num_value_heads: 8, linear_key_head_dim: 128, linear_value_head_dim: 128}",
        f"trainer.packing.rows={rows}",
        f"trainer.packing.token_budget={rows * length}",
        "rollout.engine.max_length=1024",
        "rollout.staleness.batch_prompts=16",
    ]
    cfg = load_experiment(str(ROOT / "configs/train_cpu.yaml"), overrides)
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2), list(slice_devices("v5p-16")))
    spec = next(spec for spec in trainer_programs(cfg, cfg.model, mesh) if spec.name.startswith("proximal"))
    found = hlo.collectives(spec.jitted.lower(*spec.args).compile().as_text())
    whole_batch = [
        c for c in found for dtype, dims in c.shapes if dtype in ("bf16", "f32") and dims[:2] == (rows, length)
    ]
    assert not whole_batch, whole_batch

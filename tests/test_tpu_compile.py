"""Ahead-of-time compiles for Cloud TPU slices on this CPU machine (libtpu from requirements-dev.txt): slice
names, real FSDP in the compiled gradient program, the engine's programs with the TPU paged kernel, and
`areal-jax compile` (its report and its refusal)."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from areal_jax.cli import main
from areal_jax.compile import hlo
from areal_jax.compile.engine_programs import EngineOnMesh
from areal_jax.compile.topology import parse_slice, slice_devices
from areal_jax.compile.trainer_programs import trainer_programs
from areal_jax.config import ExperimentConfig, load_experiment
from areal_jax.configuration import ConfigError
from areal_jax.exit_codes import EXIT_USER_ERROR
from areal_jax.sharding import MeshConfig, make_mesh

ROOT = Path(__file__).resolve().parents[1]
ROWS, LENGTH, HIDDEN, INTERMEDIATE = 8, 48, 128, 320
# one micro-batch of 8 rows x 48 tokens; widths that no activation shares with a weight
TINY = [
    "model.hidden_size=128",
    f"model.intermediate_size={INTERMEDIATE}",
    "model.num_layers=2",
    "model.vocab_size=512",
    "model.max_position_embeddings=128",
    "model.remat=full",
    "model.scan_layers=true",
    f"trainer.packing.rows={ROWS}",
    f"trainer.packing.token_budget={ROWS * LENGTH}",
    "rollout.staleness.batch_prompts=1",
    "rollout.inference_share=1",
    "rollout.trainer_share=1",
]


def test_slice_names_map_to_topologies():
    assert parse_slice("v5p-8").topology_name == "v5p:2x2x1"  # v5p counts 2 cores a chip: 4 chips
    assert parse_slice("v5litepod-16").topology_name == "v5e:4x4"
    assert parse_slice("v6e-8").chips == 8
    assert len(slice_devices("v5p-8")) == 4
    for bad in ("v5p-6", "v7x-8", "tpu"):
        with pytest.raises(ConfigError, match="--topology"):
            parse_slice(bad)


def test_gradient_program_keeps_activations_on_their_chips():
    """FSDP over 4 v5p chips: the rows stay split (2 a chip), each layer's weights are all-gathered, and no
    floating-point collective carries the whole batch's rows (the whole-batch all-reduces of issue 35)."""
    cfg = load_experiment(str(ROOT / "configs/train_cpu.yaml"), [*TINY, "model.logprob_chunk=64"])  # 6 chunks
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=1), list(slice_devices("v5p-8")))
    gradient = next(spec for spec in trainer_programs(cfg, cfg.model, mesh) if spec.name.startswith("gradient"))
    compiled = gradient.jitted.lower(*gradient.args).compile()
    found = hlo.collectives(compiled.as_text())
    whole_batch = [
        c
        for c in found
        for dtype, dims in c.shapes
        if dtype in ("bf16", "f32") and ((ROWS in dims and LENGTH in dims) or ROWS * LENGTH in dims)
    ]
    assert not whole_batch, whole_batch
    gathers = [c for c in found if c.kind == "all-gather" and any(HIDDEN in dims for _, dims in c.shapes)]
    assert any(c.runs == cfg.model.num_layers for c in gathers), found  # a layer's weights, once a layer
    # and each layer's MLP and q/k/v gradients reduce-scattered to their quarters (XLA:TPU's all-reduce-scatter
    # fusion), once a layer: no MLP weight's gradient is all-reduced whole
    scattered = [c for c in found if c.kind == "reduce-scatter" and c.runs == cfg.model.num_layers]
    assert scattered and all(HIDDEN // 4 in dims for c in scattered for _, dims in c.shapes), found
    assert any(dims == (INTERMEDIATE, HIDDEN // 4) for c in scattered for _, dims in c.shapes), scattered
    whole = [c for c in found if c.kind == "all-reduce" and any(INTERMEDIATE in dims for _, dims in c.shapes)]
    assert not whole, whole
    summary = hlo.summarize(found)
    assert summary["all-reduce"]["bytes"] < summary["reduce-scatter"]["bytes"], summary
    # the output head gathered once a call, not once a log-prob chunk (it was 6 gathers here, 16,384 a call of
    # the 1.5B recipe's gradient program)
    head = [c for c in found if any(dims == (HIDDEN, 512) for _, dims in c.shapes)]
    assert head and all(c.runs == 1 for c in head if c.kind == "all-gather"), head


def test_compile_command_reports_and_refuses(capsys):
    config = str(ROOT / "configs/train_cpu.yaml")
    assert main(["compile", config, "--topology", "v5e-8", "--json", *TINY]) == 0
    report = json.loads(capsys.readouterr().out)
    trainer = report["trainer"]
    assert report["topology_name"] == "v5e:2x4" and trainer["chips"] == 4 and trainer["fits"]
    names = [p["name"] for p in trainer["programs"]]
    assert names[0].startswith("proximal") and names[1].startswith("gradient") and names[2] == "AdamW apply"
    inference = report["inference"]  # the engine on the slice's other 4 chips: dense KV cache, XLA attention
    assert inference["chips"] == 4 and inference["fits"] and not report["shared_chips"]
    names = [p["name"] for p in inference["programs"]]
    assert [name.split(" ")[0] for name in names] == ["prefill", "insert", "decode"], names
    assert "KV cache" in [line["line"] for line in inference["resident"]]
    assert any(line["line"].startswith("KV cache (dense") for line in inference["plan"])
    for program in trainer["programs"] + inference["programs"]:
        assert program["arguments"] > 0 and program["roofline"]["roofline_s"] > 0
    # the plan against XLA:TPU's memory_analysis, per side and chip: the resident state (in TPU's tiled layouts:
    # head dim 32 pads to 128), the largest program's needs (gradient buffers, activations, logits, compiled code;
    # the decode step's logits and code) and the total, each within 25% (ratio 0.8)
    for side in ("trainer", "inference"):
        lines = {a["line"].split(" (")[0]: a for a in report[side]["plan_agreement"]}
        assert set(lines) == {"resident state", "largest program", "total"}, lines
        off = [
            f"{a['line']}: plan {a['plan']} B, compiler {a['compiler']} B" for a in lines.values() if a["ratio"] < 0.8
        ]
        assert not off, (side, off, report[side]["plan"])
    # the mini-batch inputs line is the gradient program's arguments beside the params (its batch, the proximal
    # log-probs, the trainer version), to within the version scalar's tile
    gradient = next(p for p in trainer["programs"] if p["name"].startswith("gradient"))
    inputs = [line["bytes"] for line in trainer["plan"] if line["line"].startswith("mini-batch inputs")]
    assert len(inputs) == 1 and 0 <= gradient["arguments"] - gradient["resident"] - inputs[0] <= 4096, (
        inputs,
        gradient,
    )
    # the dense cache (2 layers of 64 slots x 32 positions, 2 KV heads of 32, bf16, slots over 4 chips) in the
    # compiler's layout: head dim and positions both 32, so 4x its bytes; the plan's tiles say the same
    logical = 2 * 64 * 32 * 2 * 32 * 2 * 2 // 4
    cache = {line["line"]: line["bytes"] for line in inference["resident"]}["KV cache"]
    assert cache == 4 * logical, cache
    assert [line["bytes"] for line in inference["plan"] if line["line"].startswith("KV cache")] == [cache]
    # 2 x 524288 x 8192 f32 embeddings with their Adam moments over 4 v5e chips of 16 GiB: refused before compiling
    big = [*TINY, "model.vocab_size=524288", "model.hidden_size=8192", "model.num_layers=1", "model.num_heads=64"]
    assert main(["compile", config, "--topology", "v5e-8", *big]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "GiB a chip by the compiler" in err and "mesh.fsdp" in err and "larger --topology" in err


def test_memory_plan_for_hardware_this_machine_lacks(tmp_path, capsys):
    """`plan --memory` for a TPU slice and for 8 GPUs of 80 GiB: the checkpoint's config.json alone (no
    tokenizer, no weights) and no such devices here."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    hf = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 64,  # configs/train_cpu.yaml's model.* (a checkpoint contradicting them is refused)
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 27,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    (checkpoint / "config.json").write_text(json.dumps(hf))
    config = str(ROOT / "configs/train_cpu.yaml")
    run = [config, f"hf_checkpoint={checkpoint}", "tokenizer=null"]
    assert main(["plan", "--memory", "--topology", "v5p-8", *run]) == 0
    out, err = capsys.readouterr()
    # v5p-8 is 4 chips: 3 for the rollout, 1 for the trainer (the config's 3:1 shares); 3 is a group size XLA:TPU
    # all-reduces over in no program
    assert "memory plan on v5p-8:" in out and "inference: 3 device(s)" in out and "of 87.4 GiB usable" in out
    assert "warning: the rollout's mesh splits fsdp over 3 chips" in err and "rollout.inference_share" in err
    assert main(["plan", "--memory", "--topology", "v5p-16", *run]) == 0
    assert "warning: the rollout's mesh splits fsdp over 6 chips" in capsys.readouterr().err  # 6 of 8
    even = ["rollout.inference_share=1", "rollout.trainer_share=1"]
    assert main(["plan", "--memory", "--topology", "v5p-16", *run, *even]) == 0
    assert "warning" not in capsys.readouterr().err  # 4 and 4 chips
    assert main(["plan", "--memory", "--devices", "8", "--device-memory-gib", "80", *run]) == 0
    out = capsys.readouterr().out
    assert "memory plan on 8 x 80 GiB GPUs:" in out and "trainer: 2 device(s)" in out and "of 73.6 GiB usable" in out
    assert main(["plan", "--memory", "--devices", "8", "--device-memory-gib", "0.01", *run]) == EXIT_USER_ERROR
    assert "GiB of a trainer device but 0.0 GiB are usable" in capsys.readouterr().err
    assert main(["plan", "--memory", "--device-memory-gib", "80", *run]) == EXIT_USER_ERROR
    assert "--device-memory-gib" in capsys.readouterr().err


@pytest.mark.parametrize("topology, rollout_chips", [("v5p-8", 3), ("v5e-8", 6)])
def test_a_mesh_that_does_not_divide_the_slice_is_refused_before_compiling(capsys, topology, rollout_chips):
    """XLA:TPU refused an all-reduce over 3 of v5p-8's 4 chips (the 1.5B recipe's decode step) and aborted the process
    on one over 6 of v5e-8's 8 (the 0.5B recipe's): the compile command refuses such a mesh before compiling, naming
    the side's share key."""
    shares = [o for o in TINY if not o.startswith(("rollout.inference_share", "rollout.trainer_share"))]
    config = str(ROOT / "configs/train_cpu.yaml")
    run = [config, *shares, "rollout.inference_share=3", "rollout.trainer_share=1", "--topology", topology]
    assert main(["compile", *run]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert f"rollout.inference_share: the rollout's mesh splits fsdp over {rollout_chips} chips" in err, err


def _engine_on_v5e_4(*overrides: str) -> tuple[ExperimentConfig, EngineOnMesh]:
    """The engine of the tiny shape at head dim 128 (TPU kernels' tiling; one head) and prefill buckets from 32,
    on 4 v5e chips (fsdp 4), with `overrides`."""
    extra = ["model.num_heads=1", "model.num_kv_heads=1", "rollout.engine.min_prefill_bucket=32", *overrides]
    cfg = load_experiment(str(ROOT / "configs/train_cpu.yaml"), [*TINY, *extra])
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=1), list(slice_devices("v5e-4")))
    return cfg, EngineOnMesh(cfg, cfg.model, mesh)


@pytest.mark.parametrize(
    ("layout", "kernel", "pools"),
    [("auto", "ragged_paged_attention_kernel", 1), ("split", "paged_attention", 2)],
    ids=["auto-ragged", "split-paged"],
)
def test_paged_engine_compiles_with_the_tpu_kernel_per_shard(layout, kernel, pools):
    """The paged engine on 4 v5e chips: its decode step calls the Pallas kernel of its pools' layout (auto at head
    dim 128: the combined layout and JAX's ragged paged attention; split: `paged_attention`; the mesh's platform
    picks them, though this machine's backend is the CPU), once per shard of the slots; the decode state is
    donated, so the step's new cache reuses the old one's buffers."""
    cfg, engine = _engine_on_v5e_4(
        "rollout.engine.kv_cache=paged",
        "rollout.engine.max_slots=8",
        "rollout.engine.max_length=64",
        f"rollout.engine.page_layout={layout}",
    )
    programs = {p.name.split(" ")[0]: p for p in engine.compile()}
    assert set(programs) == {"prefill", "insert", "decode"}
    assert kernel in programs["decode"].kernels, programs["decode"].kernels
    assert not programs["prefill"].kernels
    assert len(jax.tree.leaves(engine.decode_state.cache.pools[0])) == pools
    resident = dict(engine.resident_lines())
    pool = cfg.rollout.engine.pool_pages * cfg.rollout.engine.page_size * 128 * 4  # f32 K or V, 1 KV head
    assert resident["KV cache"] >= 2 * cfg.model.num_layers * pool  # pools whole on every chip
    assert programs["decode"].aliased >= resident["KV cache"]


def test_a_combined_layout_the_ragged_kernel_cannot_take_is_refused_naming_the_key(capsys):
    """Head dim 64 (the tiny shape's) with `page_layout: combined` on a TPU slice: exit 2 before compiling, naming
    rollout.engine.page_layout."""
    run = [str(ROOT / "configs/train_cpu.yaml"), *TINY, "rollout.engine.kv_cache=paged"]
    run += ["rollout.engine.page_layout=combined", "--topology", "v5e-4"]
    assert main(["compile", *run]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "rollout.engine.page_layout" in err and "head dim" in err, err


def test_an_insert_writes_each_slot_on_its_chip():
    """One prefix row inserted into the dense cache split over 4 v5e chips by slot: left to the partitioner, the
    scatter at a traced slot all-gathered every cache segment on every chip (R1-Distill-1.5B over 4 v6e chips:
    92 GB a call, docs/tpu.md); written on the slot's own chip (`activation_sharding.put_rows_locally`), no
    collective carries a cache segment."""
    _, engine = _engine_on_v5e_4(
        "rollout.engine.max_slots=64", "rollout.engine.max_length=128", "rollout.engine.max_prefill_batch=1"
    )
    programs = {p.name.split(" ")[0]: p for p in engine.compile()}
    segment = 64 // 4 * 128 * 32 * 4  # a chip's 16 slots of the first segment's keys (1 head of 128, 32 positions)
    moved = {kind: c for kind, c in programs["insert"].collectives.items() if c["bytes"] >= segment}
    assert not moved, programs["insert"].collectives


def _scan_gradient_on_one_v5e(tokens: int):
    """The gradient of a chunked linear-attention scan (the Gated DeltaNet rule's: 24 heads, chunks of 64, states
    of 128 x 128) over `tokens` tokens, as a `ProgramSpec` for one v5e chip."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from areal_jax.compile.programs import ProgramSpec

    mesh = Mesh(list(slice_devices("v5e-4"))[:1], ("chip",))
    heads, chunk, width = 24, 64, 128
    chunks = tokens // chunk

    def arg(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))

    def loss(*xs):
        def step(state, x):
            values, keys, attn, queries, ends, decay = x
            new = values - jnp.einsum("hck,hkv->hcv", keys, state)
            out = jnp.einsum("hck,hkv->hcv", queries, state) + jnp.einsum("hcs,hsv->hcv", attn, new)
            return state * decay[:, None, None] + jnp.einsum("hck,hcv->hkv", ends, new), out

        state, out = jax.lax.scan(step, jnp.zeros((heads, width, width)), xs)
        return jnp.sum(out**2) + jnp.sum(state)

    block = arg(chunks, heads, chunk, width)
    args = (block, block, arg(chunks, heads, chunk, chunk), block, block, arg(chunks, heads))
    jitted = jax.jit(jax.grad(loss, argnums=tuple(range(6))))
    return ProgramSpec("scan gradient", jitted, args, (), tokens, 0.0, 0.0, lower_context=lambda: jax.set_mesh(mesh))


def test_a_program_fits_by_xlas_heap_not_by_its_reported_temporaries():
    """XLA:TPU's own out-of-memory check counts the program's peak heap (`peak_memory_in_bytes`), not its arguments
    + outputs + `temp_size_in_bytes`: the gradient of a Gated DeltaNet-like chunk scan over 90,112 tokens compiles
    for one v5e chip (15.75 GiB available) with a heap of ~15.5 GiB, though those three add to ~17.5 GiB; at 131,072
    tokens the compiler refuses it. So a program's need beside the resident state is its heap (`transient`)."""
    from areal_jax.compile.programs import compile_program

    gib = 2**30
    program = compile_program(_scan_gradient_on_one_v5e(90112))
    assert program.heap < 15.75 * gib < program.arguments + program.outputs + program.temporaries
    assert program.transient == program.heap + program.code  # nothing resident
    with pytest.raises(jax.errors.JaxRuntimeError, match="exceeds available HBM"):
        compile_program(_scan_gradient_on_one_v5e(131072))

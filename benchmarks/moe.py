"""Mixture of experts: the trainer-vs-engine mismatch with and without routing replay, and the dropless experts'
throughput.

- mismatch: a random-weights Qwen3-MoE samples sequences on the engine in float32 (the sampler's numerics); the
  trainer scores them in bfloat16 (its numerics differ, so some near-tied routers pick other experts). Printed
  per replay mode (`trainer.moe.routing_replay` none / rollout): the mean |log p_trainer - log p_engine| over the
  sampled tokens, and the routing agreement, the share of (token, sparse layer) pairs the trainer computed through
  the experts the engine recorded. Replay leaves only the bfloat16 rounding of the same experts.
- throughput: one MoE layer's forward (router, top-k, experts) over M tokens, tokens/s, with the grouped matmuls
  (`jax.lax.ragged_dot`, dropless) against the dense one-hot reference (every expert on every token).

CPU only (bfloat16 compute on XLA:CPU). `--quick` runs in under a minute. Prints `name: value unit` lines; the last
is `ratio mismatch_off_vs_on: X` (the mismatch without replay over the mismatch with it).

`--compile TOPOLOGY [--layers N]` instead compiles the Qwen3-30B-A3B DeepScaleR recipe's programs for a Cloud TPU
slice (libtpu, no chip, no weights: `areal-jax compile` over Qwen3-30B-A3B's config.json, at N of its 48 layers)
and prints each program's compile time and temporaries and each side's per-chip memory by the compiler and by the
plan; the last line is `ratio compiler_vs_plan:`, the larger side's compiler total over its plan total.

`--dispatch TOPOLOGY [--tokens M]` compiles one Qwen3-30B-A3B sparse layer (router, top-8 of 128 experts, the
experts of width 768 in bf16, megablox), its forward and gradient, for the slice's chips (experts over all of
them, M tokens a chip), under each expert dispatch (`model.moe.dispatch`): the per-chip temporaries, and the
collectives' bytes a chip sends per layer (the all-gather's and reduce-scatter's by their sizes; the ragged
all-to-all's for balanced routing, each chip's M x 8 picks once per instruction); the last line is
`ratio temporaries_all_gather_vs_all_to_all:`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.inference.engine import Engine
from areal_jax.inference.engine_config import EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.requests import GenerationResult
from areal_jax.inference.sampling import SamplingParams
from areal_jax.models.config import ModelConfig, MoEConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.moe import dropless_experts, one_hot_experts, route

MODEL = ModelConfig(
    family="qwen3_moe",
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    qkv_bias=False,
    qk_norm=True,
    initializer_range=0.1,
    compute_dtype="float32",
    moe=MoEConfig(num_experts=16, experts_per_token=2, expert_intermediate_size=64, norm_topk_prob=True),
)


SIZING = Path(__file__).resolve().parents[1] / "configs/sizing"
# Qwen/Qwen3-30B-A3B's config.json as published (transformers 4.51.0)
QWEN3_30B_A3B = json.loads((SIZING / "Qwen3-30B-A3B/config.json").read_text())
RECIPE = SIZING.parent / "recipes/qwen3_30b_a3b_deepscaler_tpu.yaml"
MIB = 2**20


def compile_recipe(topology: str, layers: int) -> None:
    """The 30B recipe's programs compiled for `topology` at `layers` layers; per-chip memory against the plan."""
    from areal_jax.compile.report import compile_for_slice
    from areal_jax.config import load_experiment

    with tempfile.TemporaryDirectory() as checkpoint:
        (Path(checkpoint) / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "num_hidden_layers": layers}))
        cfg = load_experiment(RECIPE, [f"hf_checkpoint={checkpoint}", "tokenizer=null"])
        started = time.perf_counter()
        compiled = compile_for_slice(cfg, topology)
        seconds = time.perf_counter() - started
    report("layers", layers, "layers")
    worst = 0.0
    for side in compiled.sides:
        for program in side.programs:
            name = program.name.split(" (")[0].replace(" ", "_")
            report(f"{side.side}_{name}_compile", program.seconds, "s")
            report(f"{side.side}_{name}_temporaries", program.temporaries / MIB, "MiB")
        report(f"{side.side}_resident_compiler", side.resident / MIB, "MiB")
        report(f"{side.side}_per_chip_compiler", side.peak / MIB, "MiB")
        report(f"{side.side}_per_chip_plan", side.plan_total / MIB, "MiB")
        worst = max(worst, side.peak / side.plan_total)
    report("compile_total", seconds, "s")
    report("ratio compiler_vs_plan", worst, "x")


def compare_dispatch(topology: str, tokens: int) -> None:
    """One 30B sparse layer's forward and gradient compiled for `topology` under each dispatch (module doc)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from areal_jax.activation_sharding import activations_on
    from areal_jax.compile.hlo import collectives
    from areal_jax.compile.topology import slice_devices

    devices = slice_devices(topology)
    chips = len(devices)
    mesh = jax.sharding.Mesh(np.asarray(devices).reshape(1, chips, 1), ("data", "fsdp", "tensor"))
    d, e = QWEN3_30B_A3B["hidden_size"], QWEN3_30B_A3B["num_experts"]
    k, f = QWEN3_30B_A3B["num_experts_per_tok"], QWEN3_30B_A3B["moe_intermediate_size"]
    shapes = [
        ((chips * tokens, d), P(("data", "fsdp"))),
        ((d, e), P()),
        ((e, d, 2, f), P("fsdp")),
        ((e, f, d), P("fsdp")),
    ]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, p)) for s, p in shapes]
    temporaries = {}
    for dispatch in ("all_gather", "all_to_all"):

        def layer(x, router, gate_up, down, dispatch=dispatch):
            weights, ids = route(jnp.einsum("md,de->me", x, router, preferred_element_type=jnp.float32), k, True)
            return dropless_experts(x, weights, ids, gate_up, down, "megablox", dispatch)

        def step(x, router, gate_up, down, cotangent, layer=layer):
            out, vjp = jax.vjp(layer, x, router, gate_up, down)
            return out, vjp(cotangent)

        started = time.perf_counter()
        with activations_on(mesh):
            compiled = jax.jit(step).lower(*args, args[0]).compile()
        report(f"compile {dispatch}", time.perf_counter() - started, "s")
        temporaries[dispatch] = compiled.memory_analysis().temp_size_in_bytes
        report(f"layer_temporaries {dispatch}", temporaries[dispatch] / MIB, "MiB")
        sent = 0.0
        for c in collectives(compiled.as_text()):
            if c.kind == "ragged-all-to-all":  # its bytes are the buffer's; it moves each chip's picks once
                sent += c.runs / chips * tokens * k * d * 2 * (chips - 1) / chips
            elif c.kind in ("all-gather", "all-reduce", "reduce-scatter"):
                full = c.bytes * (chips if c.kind == "reduce-scatter" else 1)  # a ring sends (n - 1) / n of it
                sent += c.runs * full * (chips - 1) / chips * (2 if c.kind == "all-reduce" else 1)
        report(f"layer_collective_bytes_sent {dispatch}", sent / MIB, "MiB")
    report("ratio temporaries_all_gather_vs_all_to_all", temporaries["all_gather"] / temporaries["all_to_all"], "x")


def report(name: str, value: float, unit: str) -> None:
    print(f"{name}: {value:.4g} {unit}", flush=True)


def sample(model: Decoder, prompts: int, new_tokens: int) -> list[GenerationResult]:
    engine = Engine(model, EngineConfig(max_slots=8, max_length=128))
    rng = np.random.default_rng(0)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=0)
    with Generator(engine, engine.load_params(nnx.state(model), 0)) as gen:
        futures = [gen.submit(rng.integers(0, MODEL.vocab_size, 16).tolist(), sampling, n=2) for _ in range(prompts)]
        return [r for f in futures for r in f.result(timeout=600)]


def mismatch(model: Decoder, results: list[GenerationResult], replay: bool) -> tuple[float, float]:
    """(mean |trainer - engine| log-prob over sampled tokens, routing agreement) with the trainer in bfloat16."""
    graphdef, state = nnx.split(Decoder(MODEL.replace(compute_dtype="bfloat16"), nnx.Rngs(0)))

    @jax.jit
    def score(state: nnx.State, tokens_1xT: jax.Array, routing_1xTxYmxK: jax.Array | None):
        trainer = nnx.merge(graphdef, state)
        ones, positions = jnp.ones_like(tokens_1xT), jnp.arange(tokens_1xT.shape[1])[None]
        logp, _, router = trainer.token_logprobs_routed(
            tokens_1xT[:, :-1], tokens_1xT[:, 1:], ones[:, :-1], positions[:, :-1], 1.0, None, routing_1xTxYmxK
        )
        return logp[0], router.used[:, 0]

    gaps, agree = [], []
    for r in results:
        assert r.routing is not None
        tokens = jnp.asarray([[*r.prompt_ids, *r.output_ids]])
        recorded_TxYmxK = r.routing[:-1]
        replayed = jnp.asarray(recorded_TxYmxK[None]) if replay else None
        logp_T, used_YmxTxK = score(nnx.state(model), tokens, replayed)
        p = len(r.prompt_ids)
        gaps.append(np.abs(np.asarray(logp_T)[p - 1 :] - np.asarray(r.output_logprobs)))
        used_TxYmxK = np.sort(np.moveaxis(np.asarray(used_YmxTxK), 0, 1), axis=-1)
        same = np.all(used_TxYmxK == np.sort(recorded_TxYmxK, axis=-1), axis=-1)[p - 1 :]
        agree.append(same.reshape(-1))
    del state
    return float(np.concatenate(gaps).mean()), float(np.concatenate(agree).mean())


def layer_throughput(tokens: int, repeats: int) -> dict[str, float]:
    """tokens/s of one MoE layer's forward (bf16 activations and weights), ragged_dot vs one-hot reference."""
    moe, d = MODEL.moe, MODEL.hidden_size
    assert moe is not None
    e, f, k = moe.num_experts, moe.expert_intermediate_size, moe.experts_per_token
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (tokens, d), jnp.bfloat16)
    router = 0.05 * jax.random.normal(keys[1], (d, e), jnp.bfloat16)
    gate_up = 0.05 * jax.random.normal(keys[2], (e, d, 2, f), jnp.bfloat16)
    down = 0.05 * jax.random.normal(keys[3], (e, f, d), jnp.bfloat16)
    out = {}
    for name, experts in (("ragged_dot", dropless_experts), ("one_hot", one_hot_experts)):

        @jax.jit
        def layer(x, router, gate_up, down, experts=experts):
            weights, ids = route(jnp.einsum("md,de->me", x, router, preferred_element_type=jnp.float32), k, True)
            return experts(x, weights, ids, gate_up, down)

        layer(x, router, gate_up, down).block_until_ready()
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            layer(x, router, gate_up, down).block_until_ready()
            best = min(best, time.perf_counter() - started)
        out[name] = tokens / best
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sequences and tokens: under a minute")
    parser.add_argument("--compile", metavar="TOPOLOGY", help="compile the Qwen3-30B-A3B recipe for this TPU slice")
    parser.add_argument("--layers", type=int, default=48, help="with --compile: layers of the model (48: all)")
    parser.add_argument("--dispatch", metavar="TOPOLOGY", help="compare the dispatches on one 30B layer for a slice")
    parser.add_argument("--tokens", type=int, default=32768, help="with --dispatch: tokens a chip (the recipe's)")
    args = parser.parse_args()
    if args.dispatch:
        compare_dispatch(args.dispatch, args.tokens)
        return
    if args.compile:
        compile_recipe(args.compile, args.layers)
        return
    model = Decoder(MODEL, nnx.Rngs(0))
    results = sample(model, prompts=4 if args.quick else 16, new_tokens=24 if args.quick else 64)
    report("sampled_tokens", sum(len(r.output_ids) for r in results), "tokens")
    gap = {}
    for replay in (False, True):
        name = "on" if replay else "off"
        gap[name], agreement = mismatch(model, results, replay)
        report(f"logp_abs_diff replay_{name}", gap[name], "nats")
        report(f"routing_agreement replay_{name}", agreement, "share")
    throughput = layer_throughput(tokens=1024 if args.quick else 4096, repeats=3 if args.quick else 10)
    for name, rate in throughput.items():
        report(f"moe_layer_tokens_per_s {name}", rate, "tokens/s")
    report("ratio ragged_dot_vs_one_hot", throughput["ragged_dot"] / throughput["one_hot"], "x")
    report("ratio mismatch_off_vs_on", gap["off"] / gap["on"], "x")


if __name__ == "__main__":
    main()

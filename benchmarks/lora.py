"""LoRA vs full training on the same model: what a published weight version costs, what a train step holds, and
how the engine serves an adapter (merged into the weights once per version, or applied inside each matmul).

- publish: one version through the Orbax store on local disk (synchronous save: written and committed), its
  bytes on disk and seconds, then its load onto the reader (seconds), and the engine's in-process load of it
  (`Engine.load_params`: placement, serving cast, per-layer copies). Full: every parameter; LoRA: the adapters
  alone (the engine keeps its base).
- train-step memory: the trainer's persistent state (params, frozen base, Adam moments) and the compiled update's
  two programs (gradient; AdamW) from XLA's memory analysis: arguments + outputs + temporaries, the larger of
  the two is the step's peak.
- serving: the decode step of all slots with the adapters in the matmul vs the same step of the plain model (what
  merging gives), and the per-version cost of merging (W + a b alpha/r for every targeted weight, then the
  engine's load of the merged full state) vs loading the adapters alone.

Random weights (NumPy normals on host: values do not matter here). `--quick`: a 4-layer model of width 512;
the default is Qwen2.5-0.5B's exact shape. Prints `name: value unit` lines; the last is
`ratio full_vs_lora_publish_bytes: X`.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.data.packing import PackingConfig
from areal_jax.data.trajectory import Trajectory
from areal_jax.inference.engine import Engine
from areal_jax.inference.engine_config import EngineConfig
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_config import model_config_from_hf
from areal_jax.models.lora import merged_state, split_trainable
from areal_jax.models.lora_config import TARGETS, LoRAConfig
from areal_jax.sharding import MeshConfig, make_mesh
from areal_jax.trainer.batching import build_batch
from areal_jax.trainer.config import OptimizerConfig, TrainerConfig
from areal_jax.trainer.train_step import TrainStep
from areal_jax.weights import OrbaxWeightPublisher, OrbaxWeightSubscriber, abstract_target, tree_nbytes

QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}
QUICK = ModelConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8, num_kv_heads=2)
MIB = 2**20


def report(name: str, value: float, unit: str) -> None:
    print(f"{name}: {value:.4g} {unit}", flush=True)


def random_state(cfg: ModelConfig, seed: int = 0) -> nnx.State:
    """Every parameter of `cfg`'s decoder as NumPy normals (scaled by the init std) on the default device."""
    abstract = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    std = cfg.initializer_range
    return jax.tree.map(
        lambda a: jnp.asarray((std * rng.standard_normal(a.shape, np.float32)).astype(a.dtype)), abstract
    )


def best(fn: Any, repeats: int) -> float:
    """The best of `repeats` timed calls of `fn`, after one untimed call (its compiles)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - started)
    return min(times)


def publish_costs(name: str, params: nnx.State, directory: Path, repeats: int) -> int:
    """Bytes on disk and seconds of one version through the Orbax store, and of its load back."""
    publisher = OrbaxWeightPublisher(directory, async_save=False, max_to_keep=1)
    seconds = []
    try:
        for version in range(1, repeats + 2):
            started = time.perf_counter()
            publisher.publish(params, version)
            seconds.append(time.perf_counter() - started)
    finally:
        publisher.close()
    last = repeats + 1
    written = sum(f.stat().st_size for f in (directory / str(last)).rglob("*") if f.is_file())
    subscriber = OrbaxWeightSubscriber(directory)
    try:
        target = abstract_target(params)
        load = best(lambda: subscriber.load(last, target).params, repeats)
    finally:
        subscriber.close()
    report(f"{name}_publish_array_bytes", tree_nbytes(params) / MIB, "MiB")
    report(f"{name}_publish_disk_bytes", written / MIB, "MiB")
    report(f"{name}_publish_seconds", min(seconds[1:]), "s")
    report(f"{name}_store_load_seconds", load, "s")
    return written


def train_memory(name: str, cfg: ModelConfig, state: nnx.State, mesh: Any) -> None:
    """The trainer's persistent state and the compiled update's two programs (XLA's memory analysis)."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
    trainable, frozen = split_trainable(cfg, state)
    config = TrainerConfig(
        optimizer=OptimizerConfig(lr=1e-5), packing=PackingConfig(token_budget=512, rows=2, microbatch_rounding="pow2")
    )
    config = config.replace(ppo=config.ppo.replace(decoupled=False))
    step = TrainStep(graphdef, trainable, config, mesh, temperature=1.0, frozen=frozen)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), trainable)  # compiled, never run
    opt_state = step._init.lower(step.program, params).out_info
    rng = np.random.default_rng(0)
    trajectories = []
    for i in range(4):
        tokens = rng.integers(0, cfg.vocab_size, 200).astype(np.int32)
        mask = np.arange(200) >= 40
        trajectories.append(
            Trajectory(
                token_ids=tokens,
                behav_logprobs=np.where(mask, -3.0, 0.0).astype(np.float32),
                versions=np.where(mask, 0, -1).astype(np.int32),
                loss_mask=mask,
                prompt_length=40,
                reward=float(i % 2),
                prompt_id="p0",
                group_id=0,
                sample_index=i,
            )
        )
    (mb,) = build_batch(trajectories, config, None, None).minibatches
    batch = step.put_batch(mb)
    lowered = step._update_gradients.lower(step.program, params, step.frozen, batch, None, None, jnp.int32(0), None)
    grads = lowered.out_info[0]
    gradient = lowered.compile()
    apply = step._apply.lower(step.program, params, opt_state, grads).compile()
    state_bytes = tree_nbytes(params) + tree_nbytes(step.frozen) + tree_nbytes(opt_state)
    report(f"{name}_train_state_bytes", state_bytes / MIB, "MiB")
    report(f"{name}_optimizer_state_bytes", tree_nbytes(opt_state) / MIB, "MiB")
    report(f"{name}_gradient_bytes", tree_nbytes(grads) / MIB, "MiB")
    peaks = []
    for program, compiled in (("gradient", gradient), ("apply", apply)):
        memory = compiled.memory_analysis()
        total = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
        total -= memory.alias_size_in_bytes
        peaks.append(total)
        report(f"{name}_train_{program}_program_temp_bytes", memory.temp_size_in_bytes / MIB, "MiB")
    report(f"{name}_train_step_peak_bytes", max(peaks) / MIB, "MiB")


def serving(cfg: ModelConfig, plain: ModelConfig, state: nnx.State, slots: int, steps: int, rounds: int) -> None:
    """Decode-step time with the adapters in the matmul vs merged weights (the two engines take turns, round after
    round, so they see the same background load; each keeps its best), and each way's cost per version."""
    engine_cfg = EngineConfig(max_slots=slots, max_length=256, min_prefill_bucket=256)
    adapters, _ = split_trainable(cfg, state)
    merge = jax.jit(functools.partial(merged_state, cfg))
    ways = {}
    for name, model_cfg, served in (("in_matmul", cfg, state), ("merged", plain, merge(state))):
        engine = Engine(nnx.eval_shape(lambda c=model_cfg: Decoder(c, nnx.Rngs(0))), engine_cfg)
        loaded = engine.load_params(served, 0)
        decode, _ = engine.generate(loaded, engine.init_decode_state(), max_position=200)  # compiles
        ways[name] = (engine, loaded, {"decode": jax.block_until_ready(decode)})  # the state each step donates

    def run(name: str) -> Any:
        engine, loaded, held = ways[name]
        for _ in range(steps):
            held["decode"], out = engine.generate(loaded, held["decode"], max_position=200)
        return out.tokens

    seconds = {name: [] for name in ways}
    for _ in range(rounds):
        for name in ways:
            seconds[name].append(best(lambda name=name: run(name), 1) / steps)
    for name in ways:
        report(f"decode_step_{name}_ms", 1e3 * min(seconds[name]), "ms")
    in_matmul, merged = ways["in_matmul"][0], ways["merged"][0]
    report("version_in_matmul_load_adapters_ms", 1e3 * best(lambda: in_matmul.load_params(adapters, 1).state, 2), "ms")
    report("version_merge_and_load_ms", 1e3 * best(lambda: merged.load_params(merge(state), 1).state, 2), "ms")
    report("merged_extra_weight_bytes", tree_nbytes(ways["merged"][1].state) / MIB, "MiB")
    report("in_matmul_vs_merged_decode_step", min(seconds["in_matmul"]) / min(seconds["merged"]), "x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 4-layer width-512 model instead of Qwen2.5-0.5B")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated, among " + ",".join(TARGETS))
    parser.add_argument("--slots", type=int, default=16, help="decode slots of the serving comparison")
    parser.add_argument("--skip-train", action="store_true", help="skip the train-step memory (compiles the update)")
    args = parser.parse_args()
    plain = QUICK if args.quick else model_config_from_hf(QWEN25_05B).replace(remat="full", logprob_chunk=256)
    lora = LoRAConfig(rank=args.rank, alpha=2.0 * args.rank, targets=tuple(args.targets.split(",")))
    cfg = plain.replace(lora=lora)
    repeats = 2 if args.quick else 1
    print(
        f"model: {plain.num_params() / 1e6:.0f}M params (width {plain.hidden_size}, {plain.num_layers} layers), "
        f"LoRA rank {lora.rank} on {','.join(lora.targets)}: {cfg.num_lora_params() / 1e6:.2f}M adapter params",
        flush=True,
    )
    state = random_state(cfg)
    adapters, base = split_trainable(cfg, state)
    adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # a trained adapter: b no longer zero
    state = nnx.merge_state(base, adapters)
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    root = Path(tempfile.mkdtemp(prefix="areal-lora-bench-"))
    try:
        full_bytes = publish_costs("full", base, root / "full", repeats)
        lora_bytes = publish_costs("lora", adapters, root / "lora", repeats)
        engine = Engine(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), EngineConfig(max_slots=2, max_length=64))
        full_load = best(lambda: engine.load_params(state, 0).state, repeats)
        lora_load = best(lambda: engine.load_params(adapters, 1).state, repeats)
        report("full_engine_load_seconds", full_load, "s")
        report("lora_engine_load_seconds", lora_load, "s")
        serving(cfg, plain, state, args.slots, steps=4 if args.quick else 2, rounds=3)
        if not args.skip_train:
            train_memory("lora", cfg, state, mesh)
            train_memory("full", plain, base, mesh)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report("ratio full_vs_lora_publish_bytes", full_bytes / lora_bytes, "x")


if __name__ == "__main__":
    main()

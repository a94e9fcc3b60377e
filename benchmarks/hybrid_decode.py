"""Qwen3.5 decode at growing context: a hybrid model (3 Gated DeltaNet layers to 1 full-attention layer) against an
all-full-attention model of the same width and depth, through the engine's own decode step.

Both are `HybridDecoder`s (qwen3_5) built alike except `layer_types`. Each engine holds `--slots` slots and a dense
cache of the longest context; every slot sits at the same position, just below a context length L, and
`Engine.generate(max_position=...)` runs the decode program the generator would at that position: the full-attention
layers read the cache segments up to the prefill bucket covering it (L), the linear layers their fixed-size
recurrent state and convolution window. The cache's contents are whatever the slots hold (zeros here, not a
prefilled prompt): a decode step's cost depends on the positions and the cache length it reads, not on the values.

At each L the two engines alternate `--repeats` timed runs of `--steps` steps (the first call of each program,
which compiles it, is untimed); the best run of each counts. A decode step of the full model reads every layer's
keys and values up to L, the hybrid's only one layer in four: its tokens/s should fall far less with L.

Prints `name: value unit` lines; the last is `ratio hybrid_vs_full_long_context: X.XX` (tokens/s at the longest
context).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np
from flax import nnx

from areal_jax.inference.engine import DecodeState, Engine, EngineConfig, VersionedParams
from areal_jax.models.config import ModelConfig
from areal_jax.models.hybrid import HybridDecoder
from areal_jax.models.hybrid_config import HybridConfig

LINEAR, FULL = "linear_attention", "full_attention"


def model_config(layer_types: tuple[str, ...], max_length: int) -> ModelConfig:
    """A Qwen3.5-shaped decoder of width 256 (~7M parameters at 8 layers), fp32."""
    return ModelConfig(
        family="qwen3_5",
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=704,
        num_layers=len(layer_types),
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        qkv_bias=False,
        tie_word_embeddings=True,
        max_position_embeddings=max_length,
        compute_dtype="float32",
        hybrid=HybridConfig(
            layer_types=layer_types,  # type: ignore[arg-type]
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
        ),
    )


def decode_rate(
    engine: Engine, params: VersionedParams, state: DecodeState, context: int, steps: int
) -> tuple[float, DecodeState]:
    """Tokens/s of `steps` decode steps of every slot, the slots starting at `context - steps - 1` (so the
    last step writes position `context - 2` and reads the cache up to the bucket `context`), and the decode
    state after them (each step donates the one before)."""
    slots = engine.config.max_slots
    start = context - steps - 1
    state = dataclasses.replace(state, positions=jax.device_put(np.full(slots, start, np.int32), engine.device))
    jax.block_until_ready(state)
    started = time.perf_counter()
    for step in range(steps):
        state, emitted = engine.generate(params, state, max_position=start + step)
    jax.block_until_ready(emitted.tokens)
    return slots * steps / (time.perf_counter() - started), state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="4 layers, contexts 256 and 2048, 16 steps (< 60 s on 2 cores)"
    )
    parser.add_argument("--slots", type=int, default=32, help="decode slots (sequences decoded together)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per model and context (the best counts)")
    args = parser.parse_args()
    contexts = (256, 2048) if args.quick else (512, 1024, 2048, 4096, 8192)
    steps, periods = (16, 1) if args.quick else (32, 2)
    longest = contexts[-1]
    print(f"backend: {jax.default_backend()}")
    started = time.perf_counter()
    engines, params, states = {}, {}, {}
    kinds = {"hybrid": (LINEAR, LINEAR, LINEAR, FULL) * periods, "full": (FULL,) * (4 * periods)}
    for name, layer_types in kinds.items():
        cfg = model_config(layer_types, longest)
        # Random weights from NumPy: a step's cost does not depend on them, and JAX's initialisation compiles for
        # ~30 s on 2 CPU cores.
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda cfg=cfg: HybridDecoder(cfg, nnx.Rngs(0))))
        rng = np.random.default_rng(0)
        weights = jax.tree.map(lambda a, rng=rng: 0.05 * rng.standard_normal(a.shape, np.float32), abstract)
        model = nnx.merge(graphdef, weights)
        config = EngineConfig(max_slots=args.slots, max_length=longest, min_prefill_bucket=contexts[0])
        engines[name] = Engine(model, config)
        params[name] = engines[name].load_params(nnx.state(model), 0)
        states[name] = engines[name].init_decode_state()  # reused: each run sets the positions
        print(f"{name}_setup: {time.perf_counter() - started:.1f} s")
        print(f"{name}_params: {cfg.num_params() / 1e6:.2f} M")
        print(f"{name}_decode_cache: {sum(a.nbytes for a in jax.tree.leaves(states[name].cache)) / 2**20:.1f} MiB")
    rates: dict[str, dict[int, float]] = {name: {} for name in kinds}
    for context in contexts:
        compile_started = time.perf_counter()
        for name in kinds:  # compiles this context's decode program (untimed)
            states[name] = decode_rate(engines[name], params[name], states[name], context, 2)[1]
        print(f"compile_and_first_steps_at_{context}: {time.perf_counter() - compile_started:.1f} s")
        for _ in range(args.repeats):
            for name in kinds:
                rate, states[name] = decode_rate(engines[name], params[name], states[name], context, steps)
                rates[name][context] = max(rates[name].get(context, 0.0), rate)
        for name in kinds:
            print(f"{name}_decode_at_{context}: {rates[name][context]:.0f} tokens/s")
        print(f"hybrid_vs_full_at_{context}: {rates['hybrid'][context] / rates['full'][context]:.2f}")
    print(f"elapsed: {time.perf_counter() - started:.1f} s")
    for name in kinds:
        print(f"{name}_slowdown_{contexts[0]}_to_{longest}: {rates[name][contexts[0]] / rates[name][longest]:.2f}")
    print(f"ratio hybrid_vs_full_long_context: {rates['hybrid'][longest] / rates['full'][longest]:.2f}")


if __name__ == "__main__":
    main()

"""Continuous vs static batching of one engine on long-tailed output lengths.

Static batching admits a new batch of requests only when every slot of the last one has finished, so a
batch waits for its longest member; continuous batching refills a slot as soon as its request ends. Both
serve the same stream of requests (many times the slot count, as a rollout controller keeps the queue full,
so the one-off drain at the end does not dominate) with the same engine and compiled programs. Each mode
runs `--repeats` times, alternating, after one untimed pass each; the best run of each counts.

Prints `name: value unit` lines; the last is `ratio continuous_vs_static: X.XX` (tokens/s).
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from common import QWEN2_3M, long_tailed_lengths, prompts_for, run_requests, warm_engine
from flax import nnx

from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.models.decoder import Decoder


def continuous_vs_static(slots: int, count: int, cap: int, repeats: int) -> float:
    model = Decoder(QWEN2_3M, nnx.Rngs(0))
    # the cache holds a prompt (8-24 tokens) and `cap` new ones: fewer length buckets to compile than 2 x cap
    max_length = 1 << (24 + cap - 1).bit_length()
    config = EngineConfig(max_slots=slots, max_length=max_length, min_prefill_bucket=16, max_prefill_batch=8)
    engine = Engine(model, config)
    params = engine.load_params(nnx.state(model), 0)
    prompts = prompts_for(count, QWEN2_3M.vocab_size, seed=1)
    lengths = long_tailed_lengths(count, cap, seed=2)
    print(f"engine_warmup: {warm_engine(engine, params):.1f} s")
    modes = ("static", "continuous")
    for admission in modes:
        with Generator(engine, params, admission=admission) as gen:
            run_requests(gen, prompts[:slots], lengths[:slots], 1.0)
    results = dict.fromkeys(modes, 0.0)
    stats = {}
    for _ in range(repeats):
        for admission in modes:
            with Generator(engine, params, admission=admission) as gen:
                results[admission] = max(results[admission], run_requests(gen, prompts, lengths, 1.0))
            stats[admission] = gen.stats
    for admission in modes:
        one = stats[admission]
        print(f"{admission}_throughput: {results[admission]:.1f} tokens/s")
        print(f"{admission}_slot_utilisation: {one.busy_slot_steps / (one.decode_steps * slots):.2f}")
        print(f"{admission}_prompts_per_prefill_call: {one.prefills / one.prefill_calls:.1f} prompts")
    print(f"output_length_mean_max: {np.mean(lengths):.1f} / {max(lengths)} tokens")
    ratio = results["continuous"] / results["static"]
    print(f"ratio continuous_vs_static: {ratio:.2f}")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 slots, 320 requests, cap 96 (< 60 s on 2 cores)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each mode (the best counts)")
    args = parser.parse_args()
    print(f"backend: {jax.default_backend()}")
    slots, count, cap = (16, 320, 96) if args.quick else (16, 640, 192)
    continuous_vs_static(slots, count, cap, args.repeats)


if __name__ == "__main__":
    main()

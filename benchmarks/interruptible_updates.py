"""Interruptible vs non-interruptible weight updates while long-tailed generations run.

A trainer stand-in publishes a new version every `period` seconds (the time of `every` full decode steps),
the same schedule for both modes. Without interruption an update waits until every in-flight sample has
finished (admission stops, slots idle meanwhile); with interruption in-flight samples are re-prefilled
under the new weights (batched per length bucket).

A decode step's duration is measured by a run without updates (its throughput is the ceiling both modes
approach). The headline regime (every = 128 steps) is the paper's: an update period shorter than the
longest generation (cap 200 tokens) yet long against one re-prefill of every slot, as on accelerators
where a prefilled token is far cheaper than a decoded one. The full run adds every = 32, which updates so
often that on a CPU, where a prefilled token costs about a quarter of a decoded one, re-prefills take a
large share of each period: it shows where the gain shrinks.

Prints `name: value unit` lines; the last is `ratio interruptible_vs_not: X.XX` (tokens/s, every = 128).
"""

from __future__ import annotations

import argparse
import threading
import time

import jax
import numpy as np
from common import QWEN2_3M, long_tailed_lengths, prompts_for, run_requests, warm_engine
from flax import nnx

from areal_jax.inference.engine import Engine, EngineConfig, VersionedParams
from areal_jax.inference.generator import Generator
from areal_jax.models.decoder import Decoder

HEADLINE_EVERY = 128


def run_with_trainer(
    engine: Engine,
    params: VersionedParams,
    new_state: nnx.State,
    prompts: list[list[int]],
    lengths: list[int],
    period: float,
    interrupt: bool,
) -> tuple[float, int, Generator]:
    """Generate while a trainer stand-in publishes a new version every `period` seconds; returns
    (tokens/s, versions published, the closed generator for its stats)."""
    with Generator(engine, params) as gen:
        stop = threading.Event()
        published = [0]

        def trainer() -> None:
            while not stop.wait(period):  # a steady trainer: it never waits for the rollout side
                published[0] += 1
                gen.update_params(new_state, published[0], interrupt=interrupt)

        thread = threading.Thread(target=trainer, daemon=True)
        thread.start()
        throughput = run_requests(gen, prompts, lengths, 1.0)
        stop.set()
        thread.join()
    return throughput, published[0], gen


def interruptible_vs_not(slots: int, count: int, periods: tuple[int, ...]) -> float:
    model = Decoder(QWEN2_3M, nnx.Rngs(0))
    new_state = nnx.state(Decoder(QWEN2_3M, nnx.Rngs(1)))
    config = EngineConfig(
        max_slots=slots, max_length=256, min_prefill_bucket=32, max_prefill_batch=8, row_bucket_growth=4
    )
    engine = Engine(model, config)
    params = engine.load_params(nnx.state(model), 0)
    prompts = prompts_for(count, QWEN2_3M.vocab_size, seed=4)
    lengths = long_tailed_lengths(count, 200, seed=5, mean_log=3.0)
    print(f"engine_warmup: {warm_engine(engine, params):.1f} s")
    with Generator(engine, params) as gen:
        started = time.perf_counter()
        ceiling = run_requests(gen, prompts, lengths, 1.0)
        step_seconds = (time.perf_counter() - started) / gen.stats.decode_steps
    print(f"no_updates_throughput: {ceiling:.1f} tokens/s")
    print(f"decode_step_with_admission: {step_seconds * 1e3:.2f} ms")
    print(f"output_length_mean_max: {np.mean(lengths):.1f} / {max(lengths)} tokens")
    ratios = {}
    for every in periods:
        results = {}
        for interrupt in (False, True):
            throughput, published, gen = run_with_trainer(
                engine, params, new_state, prompts, lengths, every * step_seconds, interrupt
            )
            results[interrupt] = throughput
            name = f"{'interruptible' if interrupt else 'non_interruptible'}_every_{every}"
            print(f"{name}_throughput: {throughput:.1f} tokens/s")
            print(f"{name}_updates_published_applied: {published} / {gen.stats.updates} updates")
            print(f"{name}_reprefills: {gen.stats.interruptions} samples")
            print(f"{name}_slot_utilisation: {gen.stats.busy_slot_steps / (gen.stats.decode_steps * slots):.2f}")
        ratios[every] = results[True] / results[False]
        print(f"interruptible_vs_not_every_{every}_steps: {ratios[every]:.2f} x")
    print(f"ratio interruptible_vs_not: {ratios[HEADLINE_EVERY]:.2f}")
    return ratios[HEADLINE_EVERY]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="16 slots, 288 requests, the headline regime only (< 60 s on 2 cores)"
    )
    args = parser.parse_args()
    print(f"backend: {jax.default_backend()}")
    if args.quick:
        interruptible_vs_not(16, 288, (HEADLINE_EVERY,))
    else:
        interruptible_vs_not(32, 1024, (32, HEADLINE_EVERY))


if __name__ == "__main__":
    main()

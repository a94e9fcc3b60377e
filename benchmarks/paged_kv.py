"""Paged vs dense KV cache: decode throughput of one engine on the same stream of requests.

The dense cache holds max_slots x max_length entries per layer whatever the tokens in flight; the paged
cache hands out pages of `--page-size` tokens as sequences grow (`rollout.engine.kv_cache: paged`). Both
serve the same long-tailed stream of requests (many times the slot count) with the same model, through
the generator; each mode runs `--repeats` times, alternating, after one untimed pass each (which compiles
the programs the stream reaches); the best run of each counts. The paged pool is the default size (the
dense footprint, so nothing waits or is preempted); its peak pages in use give the memory a pool sized to
this workload would need.

Prints `name: value unit` lines; the last is `ratio paged_vs_dense: X.XX` (tokens/s).
"""

from __future__ import annotations

import argparse
import time

import jax
from common import QWEN2_3M, long_tailed_lengths, prompts_for, run_requests
from flax import nnx

from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.models.decoder import Decoder


def paged_vs_dense(slots: int, count: int, cap: int, page_size: int, repeats: int) -> float:
    model = Decoder(QWEN2_3M, nnx.Rngs(0))
    max_length = 1 << (24 + cap - 1).bit_length()  # a prompt (8-24 tokens) and `cap` new ones
    common = {"max_slots": slots, "max_length": max_length, "min_prefill_bucket": 32, "max_prefill_batch": 4}
    modes = ("dense", "paged")
    engines = {
        "dense": Engine(model, EngineConfig(**common)),
        "paged": Engine(model, EngineConfig(kv_cache="paged", page_size=page_size, **common)),
    }
    params = {mode: engine.load_params(nnx.state(model), 0) for mode, engine in engines.items()}
    prompts = prompts_for(count, QWEN2_3M.vocab_size, seed=1)
    lengths = long_tailed_lengths(count, cap, seed=2)
    for mode in modes:  # the untimed pass compiles what the stream reaches (fewer programs than a warm-up)
        started = time.perf_counter()
        with Generator(engines[mode], params[mode]) as gen:
            run_requests(gen, prompts, lengths, 1.0)
        print(f"{mode}_first_pass: {time.perf_counter() - started:.1f} s")
    results = dict.fromkeys(modes, 0.0)
    stats = {}
    for _ in range(repeats):
        for mode in modes:
            with Generator(engines[mode], params[mode]) as gen:
                results[mode] = max(results[mode], run_requests(gen, prompts, lengths, 1.0))
            stats[mode] = gen.stats
    dense_cache = engines["dense"].init_decode_state().cache
    dense_bytes = sum(a.nbytes for a in jax.tree.leaves(dense_cache))
    paged_cache = engines["paged"].init_decode_state().cache
    page_bytes = paged_cache.pool_bytes // paged_cache.num_pages
    peak = stats["paged"].peak_pages_in_use
    for mode in modes:
        print(f"{mode}_throughput: {results[mode]:.1f} tokens/s")
    print(f"dense_cache_memory: {dense_bytes / 2**20:.1f} MiB")
    print(f"paged_peak_pages_in_use: {peak} pages of {page_size} tokens")
    print(f"paged_memory_needed: {peak * page_bytes / 2**20:.1f} MiB")
    print(f"paged_memory_vs_dense: {peak * page_bytes / dense_bytes:.2f}")
    print(f"paged_preemptions: {stats['paged'].preemptions}")
    ratio = results["paged"] / results["dense"]
    print(f"ratio paged_vs_dense: {ratio:.2f}")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 slots, 160 requests, cap 96 (< 60 s on 2 cores)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each mode (the best counts)")
    args = parser.parse_args()
    print(f"backend: {jax.default_backend()}")
    slots, count, cap = (16, 160, 96) if args.quick else (32, 640, 480)
    paged_vs_dense(slots, count, cap, args.page_size, args.repeats)


if __name__ == "__main__":
    main()

"""Forward+backward throughput of a ~100M-parameter decoder on packed 2k-token rows, and its model
FLOP utilisation against the matmul peak measured in the same run, on this machine.

The peak is measured between the timed steps (so a machine shared with other work loads both alike), and
both are best observed: the fastest step against the fastest matmul chain.
Prints `name: value unit` lines; the last line is `ratio mfu: X.XX` (a fraction of the peak).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import MODEL_100M, measure_matmul_peak
from flax import nnx

from areal_jax.models.decoder import Decoder


def packed_batch(rows: int, length: int, vocab: int, seed: int) -> tuple[jax.Array, ...]:
    """Rows filled with sequences of random lengths (64..1024), each with its own segment id."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (rows, length)).astype(np.int32)
    segments = np.zeros((rows, length), np.int32)
    positions = np.zeros((rows, length), np.int32)
    for row in range(rows):
        offset, segment = 0, 1
        while offset < length:
            n = min(int(rng.integers(64, 1025)), length - offset)
            segments[row, offset : offset + n] = segment
            positions[row, offset : offset + n] = np.arange(n)
            offset, segment = offset + n, segment + 1
    return tuple(jnp.asarray(x) for x in (tokens, np.roll(tokens, -1, 1), segments, positions))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="2 of the 12 layers, one row, three timed steps (< 60 s on 2 cores)"
    )
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--unrolled", action="store_true", help="layers unrolled (model.scan_layers=false)")
    args = parser.parse_args()
    rows, steps = (1, 3) if args.quick else (args.rows, args.steps)
    cfg = MODEL_100M.replace(param_dtype=args.dtype, compute_dtype=args.dtype, scan_layers=not args.unrolled)
    if args.quick:
        cfg = cfg.replace(num_layers=2)
    dtype = cfg.compute_jnp_dtype

    peak_size = 1024 if args.quick else 2048
    peaks = [measure_matmul_peak(peak_size, 3, dtype)]
    model = Decoder(cfg, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    batch = packed_batch(rows, args.length, cfg.vocab_size, seed=0)

    @jax.jit
    def grad_step(state: nnx.State, tokens, targets, segments, positions):
        def loss(state: nnx.State) -> jax.Array:
            logp, _ = nnx.merge(graphdef, state).token_logprobs(tokens, targets, segments, positions)
            return -jnp.mean(logp)

        return jax.value_and_grad(loss)(state)

    started = time.perf_counter()
    jax.block_until_ready(grad_step(state, *batch))
    compile_seconds = time.perf_counter() - started
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        jax.block_until_ready(grad_step(state, *batch))
        times.append(time.perf_counter() - started)
        peaks.append(measure_matmul_peak(peak_size, 2, dtype))
    step_seconds, peak = min(times), max(peaks)
    tokens = rows * args.length
    # fwd + bwd = 3x the forward matmul FLOPs; attention context = the average packed sequence
    mean_segment = float(np.mean([np.bincount(np.asarray(batch[2][r]))[1:].mean() for r in range(rows)]))
    flops = 3 * cfg.matmul_flops_per_token(int(mean_segment)) * tokens
    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind})")
    print(f"matmul_peak: {peak / 1e9:.1f} GFLOP/s")
    print(f"parameters: {cfg.num_params() / 1e6:.1f} M")
    print(f"tokens_per_step: {tokens} tokens")
    print(f"first_step_with_compile: {compile_seconds:.2f} s")
    print(f"step_time: {step_seconds:.3f} s (fastest of {steps}; median {np.median(times):.3f} s)")
    print(f"train_throughput: {tokens / step_seconds:.1f} tokens/s")
    print(f"model_flops: {flops / step_seconds / 1e9:.1f} GFLOP/s")
    print(f"ratio mfu: {flops / step_seconds / peak:.2f}")


if __name__ == "__main__":
    main()

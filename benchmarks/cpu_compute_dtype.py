"""bf16 vs fp32 compute on XLA:CPU at Qwen2.5-0.5B's widths: what `model.compute_dtype: auto` chooses on CPU.

XLA:CPU computes a bf16 matmul in f32: it converts the operands, and where the weights are loop-invariant (the
stacked layers of a scanned decoder) it converts every layer's weights once per program call. An engine
serving bf16 weights therefore writes an f32 copy of them at every decode step: the programs' temporaries
hold ~4 bytes per parameter, and the conversion costs the step its time.

Both dtypes serve the same requests through the generator (8 slots, 32-token prompts, greedy), after an
untimed pass that compiles what the stream reaches; the best of `--repeats` runs counts. Also printed: the
largest decode-step temporary (`memory_analysis()` of the compiled program) and one train step's time on a
[1, 1, 192] mini-batch. `--quick`: 2 of the 24 layers, one timed run. Prints `name: value unit` lines; the last is
`ratio f32_vs_bf16_decode: X.XX` (tokens/s of float32 compute over bfloat16 compute).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from common import prompts_for, run_requests
from flax import nnx
from scale import SHAPES

from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_config import model_config_from_hf
from areal_jax.sharding import MeshConfig, make_mesh
from areal_jax.trainer.batching import PackedBatch
from areal_jax.trainer.config import TrainerConfig
from areal_jax.trainer.train_step import TrainStep

GIB = 2**30
QWEN25_05B = model_config_from_hf(SHAPES["qwen25-0.5b"]).replace(remat="full")  # its exact config.json


def decode_temporaries(engine: Engine, params) -> float:
    """GiB of temporaries of the decode step at the longest cache bucket."""
    state, layers = params.state, params.layers
    lowered = engine._generate.lower(state, layers, engine.init_decode_state(), engine.buckets[-1])
    return lowered.compile().memory_analysis().temp_size_in_bytes / GIB


def train_step_seconds(model: Decoder, repeats: int) -> float:
    """Best wall time of one PPO update of a [1, 1, 192] mini-batch (after its compile)."""
    graphdef, state = nnx.split(model)
    mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1))
    step = TrainStep(graphdef, state, TrainerConfig(), mesh, temperature=1.0)
    params, opt_state = step.init(state)
    rng = np.random.default_rng(0)
    shape = (1, 1, 192)
    ids = rng.integers(0, 1000, shape).astype(np.int32)
    batch = step.put_batch(
        PackedBatch(
            tokens=ids,
            targets=np.roll(ids, -1, axis=-1),
            segment_ids=np.ones(shape, np.int32),
            positions=np.broadcast_to(np.arange(192, dtype=np.int32), shape).copy(),
            loss_mask=np.ones(shape, bool),
            logp_behav=np.full(shape, -3.0, np.float32),
            versions=np.zeros(shape, np.int32),
            advantages=rng.standard_normal(shape).astype(np.float32),
        )
    )
    best = float("inf")
    for _ in range(repeats + 1):  # the first call compiles
        started = time.perf_counter()
        prox = step.logprobs(params, batch) if step.needs_prox_pass else None
        params, opt_state, stats = step.update(params, opt_state, batch, prox, 0)
        jax.block_until_ready(stats)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 16 new tokens per request")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    layers, new_tokens = (2, 16) if args.quick else (24, 48)
    repeats = 1 if args.quick else args.repeats
    print(f"backend: {jax.default_backend()} ({len(jax.devices())} device)")
    prompts = prompts_for(8, 1000, seed=1, low=32, high=33)
    engine_config = EngineConfig(max_slots=8, max_length=128, min_prefill_bucket=64, max_prefill_batch=8)
    decode = {}
    for dtype in ("float32", "bfloat16"):
        model = Decoder(QWEN25_05B.replace(num_layers=layers, compute_dtype=dtype), nnx.Rngs(0))
        engine = Engine(model, engine_config)
        params = engine.load_params(nnx.state(model), 0)
        print(f"{dtype}_decode_temporaries: {decode_temporaries(engine, params):.3f} GiB")
        with Generator(engine, params) as gen:
            run_requests(gen, prompts, [new_tokens] * 8, 0.0)  # compiles what the stream reaches
            decode[dtype] = max(run_requests(gen, prompts, [new_tokens] * 8, 0.0) for _ in range(repeats))
        print(f"{dtype}_decode_throughput: {decode[dtype]:.1f} tokens/s")
        del gen, engine, params
        print(f"{dtype}_train_step: {train_step_seconds(model, repeats):.2f} s")
    print(f"ratio f32_vs_bf16_decode: {decode['float32'] / decode['bfloat16']:.2f}")


if __name__ == "__main__":
    main()

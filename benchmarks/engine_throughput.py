"""The engine's decode throughput against HF transformers and against this machine's ceiling.

The same ~3M-parameter Qwen2-shaped checkpoint (saved as HF safetensors, loaded by both sides) generates
64 sequences x 64 new tokens with sampling: by this engine (generator with its pipelined host loop, and
with the loop unpipelined, `pipelined_vs_not`) and by HF `generate` (torch, CPU). Also the engine's model
FLOP/s as a fraction of the matmul peak measured in the same run, and the ceiling: tokens/s if a decode
step cost only its weight matmuls (no attention, norms, sampling, cache writes or host loop).

Where torch and transformers are not installed (the main job's environment; the test command installs them)
the HF side is skipped with a line saying so. Prints `name: value unit` lines; `ratio engine_vs_hf`, then
last `ratio engine_vs_ceiling: X.XX` (engine tokens/s over the weight-matmul ceiling's).
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import QWEN2_3M, measure_matmul_peak, prompts_for, run_requests, warm_engine
from flax import nnx

from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_io import load_hf_checkpoint, save_hf_checkpoint

SEQUENCES, NEW_TOKENS, PROMPT_TOKENS = 64, 64, 16


def engine_vs_ceiling(repeats: int) -> float:
    tmp = tempfile.TemporaryDirectory()
    checkpoint = Path(tmp.name) / "ckpt"
    save_hf_checkpoint(QWEN2_3M, Decoder(QWEN2_3M, nnx.Rngs(0)), checkpoint)
    cfg, model = load_hf_checkpoint(checkpoint)
    prompts = prompts_for(SEQUENCES, cfg.vocab_size, seed=3, low=PROMPT_TOKENS, high=PROMPT_TOKENS + 1)

    # every prompt is 16 tokens and all arrive at once: one prefill length bucket, batches of 16 prompts
    config = EngineConfig(
        max_slots=SEQUENCES, max_length=128, min_prefill_bucket=32, max_prefill_batch=16, row_bucket_growth=4
    )
    engine = Engine(model, config)
    params = engine.load_params(nnx.state(model), 0)
    print(f"engine_warmup: {warm_engine(engine, params):.1f} s")
    seconds = {True: float("inf"), False: float("inf")}
    for _ in range(repeats):  # best of `repeats` for both sides: this machine's timings swing run to run
        for pipelined in (False, True):  # the unpipelined host loop (handles a step's tokens before the next)
            with Generator(engine, params, pipelined=pipelined) as gen:
                started = time.perf_counter()
                run_requests(gen, prompts, [NEW_TOKENS] * SEQUENCES, 1.0)
                seconds[pipelined] = min(seconds[pipelined], time.perf_counter() - started)
    engine_seconds = seconds[True]
    engine_tps = SEQUENCES * NEW_TOKENS / engine_seconds
    hf_tps = hf_generate_throughput(checkpoint, prompts, repeats) if _hf_installed() else None
    tmp.cleanup()

    peak = measure_matmul_peak()
    context = PROMPT_TOKENS + NEW_TOKENS / 2
    engine_flops = cfg.matmul_flops_per_token(int(2 * context)) * SEQUENCES * NEW_TOKENS / engine_seconds
    print(f"model_parameters: {cfg.num_params() / 1e6:.2f} M")
    print(f"matmul_peak: {peak / 1e9:.1f} GFLOP/s")
    print(f"engine_throughput: {engine_tps:.1f} tokens/s")
    print(f"engine_unpipelined_throughput: {SEQUENCES * NEW_TOKENS / seconds[False]:.1f} tokens/s")
    print(f"pipelined_vs_not: {seconds[False] / seconds[True]:.2f} x")
    if hf_tps is None:
        print("hf_generate: skipped (torch and transformers not installed: pip install -r requirements-dev.txt)")
    else:
        print(f"hf_generate_throughput: {hf_tps:.1f} tokens/s")
    print(f"engine_flops_fraction_of_peak: {engine_flops / peak:.3f} fraction")
    # A target above the ceiling is out of reach for any XLA engine on this machine.
    decode_floor = weight_matmul_floor_seconds(cfg, SEQUENCES)
    floor_tps = SEQUENCES / decode_floor
    print(f"weight_matmul_floor_throughput: {floor_tps:.1f} tokens/s")
    # The ceiling leaves out the prompts, which any engine must also run through the weights: with the
    # prefill's weight matmuls counted too (all prompt tokens as one matmul batch) the workload's bound is
    prefill_floor = weight_matmul_floor_seconds(cfg, SEQUENCES * PROMPT_TOKENS)
    workload_floor = NEW_TOKENS * decode_floor + prefill_floor
    print(f"prefill_share_of_workload_floor: {prefill_floor / workload_floor:.2f} fraction")
    print(f"engine_vs_workload_floor: {workload_floor / engine_seconds:.2f} x")
    if hf_tps is not None:
        print(f"ceiling_engine_vs_hf: {floor_tps / hf_tps:.2f} x")
        print(f"ratio engine_vs_hf: {engine_tps / hf_tps:.2f}")
    ratio = engine_tps / floor_tps
    print(f"ratio engine_vs_ceiling: {ratio:.2f}")
    return ratio


def _hf_installed() -> bool:
    """Whether the HF baseline can run: torch and transformers come with requirements-dev.txt (the test command's
    environment), not with the main job's."""
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers"))


def hf_generate_throughput(checkpoint: Path, prompts: list[list[int]], repeats: int) -> float:
    """HF `generate` tokens/s on the same checkpoint and prompts, sampling, exactly NEW_TOKENS each."""
    # torch is imported only now: its OpenMP worker threads would otherwise compete with XLA's
    import torch
    import transformers

    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    hf_model.eval()
    input_ids = torch.tensor(prompts)
    hf_kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        pad_token_id=0,
    )
    with torch.no_grad():
        hf_model.generate(input_ids[:4], **{**hf_kwargs, "max_new_tokens": 3, "min_new_tokens": 3})
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            out = hf_model.generate(input_ids, **hf_kwargs)
            best = min(best, time.perf_counter() - started)
    return (out.shape[1] - PROMPT_TOKENS) * len(prompts) / best


def weight_matmul_floor_seconds(cfg: ModelConfig, rows: int, repeats: int = 30) -> float:
    """Best time of one decode step's weight matmuls alone (q, k, v, o, gate, up, down per layer and the
    vocabulary projection) for `rows` tokens, with the model's shapes, in one XLA program: a lower bound
    on any XLA decode step here, before attention, norms, sampling and cache writes."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.resolved_head_dim, cfg.num_kv_heads * cfg.resolved_head_dim
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal((cfg.num_layers, *shape)) / shape[0] ** 0.5, jnp.float32)

    weights = [weight(d, q + 2 * kv), weight(q, d), weight(d, 2 * f), weight(f, d)]
    head = jnp.asarray(rng.standard_normal((d, cfg.vocab_size)) / d**0.5, jnp.float32)

    @jax.jit
    def step(x: jax.Array, weights: list[jax.Array], head: jax.Array) -> jax.Array:
        qkv_w, o_w, up_w, down_w = weights
        for layer in range(cfg.num_layers):  # unrolled: no per-layer weight slicing inside a loop
            x = x + (x @ qkv_w[layer])[:, :q] @ o_w[layer]
            x = x + (x @ up_w[layer])[:, :f] @ down_w[layer]
        return x @ head

    x = jnp.ones((rows, d), jnp.float32)
    step(x, weights, head).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        step(x, weights, head).block_until_ready()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 timed runs of each side, not 5 (< 60 s on 2 cores)")
    args = parser.parse_args()
    print(f"backend: {jax.default_backend()}")
    engine_vs_ceiling(repeats=2 if args.quick else 5)


if __name__ == "__main__":
    main()

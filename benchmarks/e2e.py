"""The whole RL loop against the compute bound of this machine, at default settings and hand-tuned.

One `areal-jax train` run per staleness bound (eta = 0, the synchronous baseline, and eta = 2) and per
variant, each assembled from `configs/train_cpu.yaml` plus the workload below, exactly as a user's command
line would: engine + generator + workflow + rollout log + Grain pipeline + train step + in-process weight
update. Variant "defaults" adds nothing; "tuned" adds the overrides this benchmark needed before the
defaults chose them (`TUNED`). The workload is issue 14's: a 2.9M-parameter Qwen2-shaped policy (hidden 256,
4 layers, 4 heads, 2 KV heads, intermediate 688, tied embeddings), two-digit additions (`NN+NN` in the char
tokenizer's template), 8 prompts x 8 samples per step, exactly 64 new tokens per sample (no stop token),
temperature 1.

samples/s is the steady state (the first steps, which compile and warm up, are left out). The model FLOPs
of a sample of L tokens are its generation and prompt prefill (one forward over L tokens) plus the
trainer's forward and backward (3 forwards over the L - 1 packed positions), attention included
(`ModelConfig.matmul_flops_per_token`); the proximal pass is not counted (at defaults, `prox_logp_method:
auto` skips it at eta 0, where every token is on-policy, and runs it at eta 2; tuned skips it by AReaL's
interpolation). The bound is the matmul peak measured in the same run, before and after the runs (best of
both).

Prints `name: value unit` lines, then `ratio defaults_vs_tuned: X.XX` (the best samples/s at defaults over
the best tuned, either eta) and last `ratio e2e_vs_bound: X.XX` (achieved FLOP/s / peak of the best run at
defaults). Extra `key=value` arguments override the config of every run.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import numpy as np
from common import measure_matmul_peak

from areal_jax.compilation_cache import enable_compilation_cache
from areal_jax.config import load_experiment
from areal_jax.jobs.train import run_async
from areal_jax.jsonl import read_jsonl
from areal_jax.models.config import ModelConfig

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "train_cpu.yaml"
NEW_TOKENS = 64
SAMPLES = 8
PROMPTS = 8
WORKLOAD = [
    "model.vocab_size=27",
    "model.hidden_size=256",
    "model.intermediate_size=688",
    "model.num_layers=4",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.tie_word_embeddings=true",
    "model.max_position_embeddings=128",
    "dataset.arithmetic.min_operand=10",
    "dataset.arithmetic.max_operand=99",
    "dataset.arithmetic.operators=+",
    "dataset.heldout=0",
    "eval.every_steps=0",
    f"rollout.workflow.n_samples={SAMPLES}",
    f"rollout.staleness.batch_prompts={PROMPTS}",
    "rollout.staleness.max_concurrent=16",
    "rollout.engine.max_slots=64",
    "rollout.engine.max_length=96",
    f"rollout.workflow.sampling.max_new_tokens={NEW_TOKENS}",
    "rollout.workflow.sampling.temperature=1.0",
    "rollout.workflow.stop_at_tokenizer_stops=false",
    "train_checkpoint.every_steps=100000",  # no checkpoint inside the timing
    "report.plots=false",
    "report.live=never",
]
# The overrides the loop needed for its speed before the defaults chose them (issue 25): the layers unrolled,
# the proximal pass skipped by AReaL's interpolation, micro-batches of ~1k tokens.
TUNED = [
    "model.scan_layers=false",
    "trainer.ppo.prox_logp_method=loglinear",
    "trainer.packing.token_budget=1024",
    "trainer.packing.rows=8",
]
VARIANTS = {"defaults": [], "tuned": TUNED}


def flops_per_sample(model: ModelConfig, length: float) -> float:
    """Generation + prefill (one forward over `length` tokens) and the trainer's forward and backward
    (three forwards over the `length - 1` packed positions)."""
    n = round(length)
    return n * model.matmul_flops_per_token(n) + 3 * (n - 1) * model.matmul_flops_per_token(n - 1)


def run(variant: str, eta: int, steps: int, warmup: int, output_dir: str, extra: list[str]) -> dict[str, float]:
    cfg = load_experiment(
        CONFIG,
        [
            *WORKLOAD,
            *VARIANTS[variant],
            f"output_dir={output_dir}",
            f"name=e2e-{variant}-eta{eta}",
            f"train_steps={steps}",
            f"rollout.staleness.max_head_offpolicyness={eta}",
            f"compilation_cache_dir={output_dir}/xla_cache",  # the second run loads the first's programs
            *extra,
        ],
    )
    enable_compilation_cache(cfg.compilation_cache_dir)  # as the CLI does (`run_async` leaves it to its caller)
    metrics = read_jsonl(run_async(cfg).metrics_file)
    wall = np.array([m["time/wall"] for m in metrics])
    timed = metrics[warmup:]
    samples = sum(m["batch/sequences"] for m in timed)
    length = sum(m["batch/tokens"] for m in timed) / samples + 1  # a sample of L tokens packs L - 1 positions
    return {
        "samples_per_second": samples / (wall[-1] - wall[warmup - 1]),
        "warmup_seconds": float(wall[warmup - 1]),
        "sample_length": length,
        "flops_per_sample": flops_per_sample(cfg.model, length),
        "step_time": float(np.median(np.diff(wall[warmup - 1 :]))),
        "train_step_time": float(np.median([m["train/step_time"] for m in timed])),
        "pack_efficiency": float(np.mean([m["batch/pack_efficiency"] for m in timed])),
        "parameters": float(cfg.model.num_params()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="3 steps per run, 1 for warm-up")
    parser.add_argument("overrides", nargs="*", help="extra key=value config overrides for every run")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("areal_jax").setLevel(logging.ERROR)  # every sample hits max_new_tokens by design
    steps, warmup = (3, 1) if args.quick else (24, 4)
    peaks = [measure_matmul_peak(1024, 5)]
    results = {}
    with tempfile.TemporaryDirectory() as output_dir:
        for eta in (0, 2):
            for variant in VARIANTS:  # side by side at each eta: the machine's noise hits both alike
                results[variant, eta] = run(variant, eta, steps, warmup, output_dir, args.overrides)
        peaks.append(measure_matmul_peak(1024, 5))
    peak = max(peaks)
    print(f"parameters: {results['defaults', 0]['parameters'] / 1e6:.2f} M")
    print(f"matmul_peak: {peak / 1e9:.1f} GFLOP/s")
    bound = {}
    for (variant, eta), result in results.items():
        name = f"{variant}_eta{eta}"
        achieved = result["samples_per_second"] * result["flops_per_sample"]
        bound[variant, eta] = achieved / peak
        print(f"{name}_samples_per_second: {result['samples_per_second']:.1f} samples/s")
        print(f"{name}_warmup: {result['warmup_seconds']:.1f} s")
        print(f"{name}_step_time: {result['step_time']:.2f} s")
        print(f"{name}_train_step_time: {result['train_step_time']:.2f} s")
        print(f"{name}_pack_efficiency: {result['pack_efficiency']:.2f} fraction")
        print(f"{name}_sample_length: {result['sample_length']:.1f} tokens")
        print(f"{name}_model_flops_per_sample: {result['flops_per_sample'] / 1e6:.1f} MFLOP")
        print(f"{name}_achieved: {achieved / 1e9:.1f} GFLOP/s")
        print(f"{name}_e2e_vs_bound: {bound[variant, eta]:.2f} fraction")
    for eta in (0, 2):
        same_eta = results["defaults", eta]["samples_per_second"] / results["tuned", eta]["samples_per_second"]
        print(f"eta{eta}_defaults_vs_tuned: {same_eta:.2f} ratio")
    best = {v: max(results[v, eta]["samples_per_second"] for eta in (0, 2)) for v in VARIANTS}
    print(f"ratio defaults_vs_tuned: {best['defaults'] / best['tuned']:.2f}")
    print(f"ratio e2e_vs_bound: {max(bound['defaults', eta] for eta in (0, 2)):.2f}")


if __name__ == "__main__":
    main()

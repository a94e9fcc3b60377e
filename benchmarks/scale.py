"""Real shapes on this machine: random-weight bf16 checkpoints with the exact config.json of Qwen2.5-0.5B and
Qwen2.5-1.5B (no download), trained through the GSM8K recipe at a small batch (2 prompts x 2 samples, 64 new
tokens, 8 slots) as `areal-jax train` processes.

Prints per shape: time to the first step (checkpoint load, warm-up, generation, the train step's compile),
step times, peak RSS of the process against the memory plan, generation and training tokens/s. A shape the plan
refuses is reported as refused (exit 2 of the run, before anything loads). The headline is the measured peak
over the plan of the last shape run. `--quick`: the 0.5B shape, 2 steps (minutes with a warm compilation
cache, `--cache`; the first run compiles for several minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the offline tokenizer and dataset builders of tests/tiny_hf_run.py

from areal_jax.models.hf_config import model_config_from_hf  # noqa: E402
from areal_jax.models.hf_io import save_hf_checkpoint  # noqa: E402
from areal_jax.models.init import create_decoder  # noqa: E402
from tests.tiny_hf_run import make_bpe_tokenizer_dir, write_gsm8k_jsonl  # noqa: E402

_QWEN25 = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 32768,
    "model_type": "qwen2",
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
SHAPES = {
    "qwen25-0.5b": {
        **_QWEN25,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "max_window_layers": 21,
    },
    "qwen25-1.5b": {
        **_QWEN25,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_attention_heads": 12,
        "num_hidden_layers": 28,
        "max_window_layers": 21,
    },
}
SMALL_BATCH = [
    "rollout.workflow.n_samples=2",
    "rollout.staleness.batch_prompts=2",
    "rollout.workflow.sampling.max_new_tokens=64",
    "rollout.engine.max_slots=8",
    "eval.every_steps=0",
    "report.live=never",
    "report.plots=false",
]
GIB = 2**30


def write_checkpoint(name: str, directory: Path, tokenizer_dir: Path) -> Path:
    """A random-weight checkpoint with `name`'s exact config.json, stored in bf16, with the tokenizer files."""
    if (directory / "config.json").exists():
        return directory
    hf = SHAPES[name]
    cfg = model_config_from_hf(hf)
    save_hf_checkpoint(cfg, create_decoder(cfg, seed=0), directory, tokenizer_dir=tokenizer_dir)
    (directory / "config.json").write_text(json.dumps(hf, indent=2))  # the real file, byte for byte ours
    return directory


def planned_bytes(overrides: list[str]) -> tuple[float | None, str]:
    """The plan's host total (GiB) from `areal-jax plan --memory`, or None and its refusal."""
    command = [sys.executable, "-m", "areal_jax.cli", "plan", "--memory", *overrides]
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    for line in out.stdout.splitlines():
        if line.startswith("host memory in all"):
            return float(line.split()[4]), ""
    return None, out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "no plan printed"


def run_shape(name: str, work: Path, steps: int, cache: Path) -> dict[str, float] | None:
    tokenizer_dir = make_bpe_tokenizer_dir(work / "tokenizer")
    data = write_gsm8k_jsonl(work / "gsm8k.jsonl", rows=600)
    checkpoint = write_checkpoint(name, work / name, tokenizer_dir)
    overrides = [
        "configs/recipes/qwen25_05b_gsm8k.yaml",
        f"hf_checkpoint={checkpoint}",
        f"dataset.files=[{{path: '{data}', mapping: gsm8k}}]",
        f"output_dir={work / 'runs'}",
        f"name={name}",
        f"compilation_cache_dir={cache}",
        f"train_steps={steps}",
        *SMALL_BATCH,
    ]
    planned, refusal = planned_bytes(overrides)
    if planned is None:
        print(f"{name}_refused_by_plan: 1 ({refusal})")
        return None
    started = time.time()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out = subprocess.run([sys.executable, "-m", "areal_jax.cli", "train", "--overwrite", *overrides], cwd=ROOT)
    wall = time.time() - started
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    if out.returncode == 2:  # a user error: the plan's check at the run's start refuses what cannot fit
        print(f"{name}_refused_by_plan: 1 (exit status 2 before anything loaded)")
        return None
    if out.returncode != 0:
        print(f"{name}_run_failed: {out.returncode} exit status")
        return None
    if peak <= before * 1024:
        print(f"{name}_note: an earlier child was larger; peak RSS below is an upper bound")
    metrics = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    unix = [m["time/unix"] for m in metrics]
    gen_tokens = metrics[-1]["generator/emitted_tokens"]
    result = {
        "time_to_first_step": unix[0] - started,
        "step_time_after_first": (unix[-1] - unix[0]) / max(1, len(unix) - 1),
        "peak_rss": peak / GIB,
        "planned": planned,
        "generation_tokens_per_s": gen_tokens / (unix[-1] - started),
        "train_tokens_per_s": sum(m["batch/tokens"] for m in metrics) / sum(m["train/step_time"] for m in metrics),
        "wall": wall,
    }
    print(f"{name}_time_to_first_step: {result['time_to_first_step']:.0f} s")
    print(f"{name}_step_time_after_first: {result['step_time_after_first']:.0f} s")
    print(f"{name}_peak_rss: {result['peak_rss']:.2f} GiB")
    print(f"{name}_planned: {planned:.2f} GiB")
    print(f"{name}_generation_throughput: {result['generation_tokens_per_s']:.1f} tokens/s")
    print(f"{name}_train_throughput: {result['train_tokens_per_s']:.1f} tokens/s")
    print(f"{name}_wall: {wall:.0f} s")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 0.5B shape, 2 steps")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("runs/scale-benchmark"), help="checkpoints, data, runs")
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/areal-jax/xla_cache").expanduser())
    args = parser.parse_args()
    shapes = ["qwen25-0.5b"] if args.quick else list(SHAPES)
    steps = 2 if args.quick else args.steps
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    last = None
    for name in shapes:
        last = run_shape(name, work, steps, args.cache) or last
    if last is not None:
        print(f"ratio measured_vs_plan: {last['peak_rss'] / last['planned']:.2f}")


if __name__ == "__main__":
    main()

"""Does it learn: the one-minute job (`configs/train_cpu.yaml`, RL from a random init), fully fine-tuned and as
LoRA adapters over the frozen random base, each checked for what its first steps reliably teach. These were
suite tests (`test_the_main_job_learns`, `test_a_lora_run_of_the_main_job_learns`); as whole learning runs they
belong here, beside `benchmarks/main_job.py` (the README's job, to its accuracy targets).

- full fine-tuning, 50 steps: the mean reward and the exactly-correct fraction of the last 10 steps exceed
  those of the first 10 by at least 0.08 and 0.03 (session 6: 0.013 -> 0.142 and 0.008 -> 0.072);
- LoRA rank 16 on every projection, 30 steps: the greedy held-out answers (200 prompts) all hit the 4-token
  limit before training, and at most a quarter do after it (the length penalty is what adapters learn first
  from a random base; greedy pass@1 is bimodal between runs of one seed, docs/lora.md); the final export is a
  PEFT adapter over the exported base, which loads back.

`--quick` runs the LoRA part alone (about a minute). Prints `name: value unit` lines; the last is
`ratio checks_passed: X.XX` (the fraction of the checks that held; 1.00 expected), and the exit status is 1
when a check failed.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np

from areal_jax.config import load_experiment
from areal_jax.jobs.train import run_async
from areal_jax.jsonl import read_jsonl
from areal_jax.models.hf_io import load_hf_checkpoint
from areal_jax.models.peft_io import ADAPTER_CONFIG, load_peft_adapter
from areal_jax.reporting.metric_keys import is_evaluation

CONFIG = "configs/train_cpu.yaml"
LORA = [
    "model.lora.rank=16",
    "model.lora.alpha=32",
    "model.lora.targets=[q,k,v,o,gate,up,down]",
    "trainer.optimizer.lr=3e-3",
]


def full_fine_tuning(output_dir: str) -> dict[str, bool]:
    cfg = load_experiment(
        CONFIG, ["train_steps=50", "report.plots=false", "eval.every_steps=0", f"output_dir={output_dir}/full"]
    )
    metrics = [m for m in read_jsonl(run_async(cfg).metrics_file) if not is_evaluation(m)]
    first, last = metrics[:10], metrics[-10:]
    checks = {}
    for key, gain in (("rollout/reward_mean", 0.08), ("rollout/correct_mean", 0.03)):
        before, after = (float(np.mean([m[key] for m in rows])) for rows in (first, last))
        name = key.split("/")[1]
        print(f"full_{name}_first10: {before:.3f}")
        print(f"full_{name}_last10: {after:.3f}")
        checks[f"full: {name} rises by {gain}"] = after >= before + gain
    return checks


def lora(output_dir: str) -> dict[str, bool]:
    steps = 30
    overrides = [f"train_steps={steps}", f"eval.every_steps={steps}", "report.plots=false"]
    cfg = load_experiment(CONFIG, [*overrides, f"output_dir={output_dir}/lora", *LORA])
    summary = run_async(cfg)

    def heldout(version: int) -> dict:
        return json.loads((cfg.layout.eval_dir / f"step-{version}" / "eval.json").read_text())["overall"]

    before, after = heldout(0), heldout(steps)
    for stage, report in (("before", before), ("after", after)):
        print(f"lora_truncated_fraction_{stage}: {report['truncated_fraction']:.3f}")
        print(f"lora_response_length_{stage}: {report['response_length_mean']:.2f} tokens")
        print(f"lora_greedy_pass_at_1_{stage}: {report['pass@1']:.3f}")
    config = json.loads((cfg.layout.hf_final / ADAPTER_CONFIG).read_text())
    _, base = load_hf_checkpoint(config["base_model_name_or_path"])
    loaded = load_peft_adapter(summary.final_hf_checkpoint, base)
    return {
        "lora: every greedy answer truncated before": before["truncated_fraction"] == 1.0,
        "lora: at most a quarter truncated after": after["truncated_fraction"] <= 0.25,
        "lora: answers shorter after": after["response_length_mean"] <= 3.0,
        "lora: the PEFT export loads back": loaded.config.lora.targets == ("q", "k", "v", "o", "gate", "up", "down"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the LoRA run alone")
    args = parser.parse_args()
    output_dir = tempfile.mkdtemp(prefix="learning-bench-")
    checks = lora(output_dir)
    if not args.quick:
        checks.update(full_fine_tuning(output_dir))
    for name, held in checks.items():
        print(f"check {name}: {'held' if held else 'FAILED'}")
    print(f"ratio checks_passed: {sum(checks.values()) / len(checks):.2f}")
    raise SystemExit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()

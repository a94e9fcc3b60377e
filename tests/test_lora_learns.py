"""A LoRA run of the main job (configs/train_cpu.yaml, adapters of rank 16 on every projection, the random base
frozen) learns: its greedy held-out accuracy (200 prompts) rises from 0.0 before training to 0.17 after 30 steps
(seed 0, lr 3e-3, alpha 32; with held-out evaluations every 10 steps, which change the rollouts' interleaving: 0.11
after 20, 30 and 40; seed 1: 0.17 after 30; docs/lora.md); the final export is a PEFT adapter over the exported
base, which loads back."""

import json

from areal_jax.config import load_experiment
from areal_jax.jobs.train import run_async
from areal_jax.models.hf_io import load_hf_checkpoint
from areal_jax.models.peft_io import ADAPTER_CONFIG, load_peft_adapter

LORA = [
    "model.lora.rank=16",
    "model.lora.alpha=32",
    "model.lora.targets=[q,k,v,o,gate,up,down]",
    "trainer.optimizer.lr=3e-3",
]


def _heldout_pass_at_1(cfg, version: int) -> float:
    report = json.loads((cfg.layout.eval_dir / f"step-{version}" / "eval.json").read_text())
    return float(report["overall"]["pass@1"])


def test_a_lora_run_of_the_main_job_learns(tmp_path):
    steps = 30
    overrides = [f"train_steps={steps}", f"eval.every_steps={steps}", "report.plots=false", f"output_dir={tmp_path}"]
    cfg = load_experiment("configs/train_cpu.yaml", [*overrides, *LORA])
    summary = run_async(cfg)
    assert summary.version == steps
    before, after = _heldout_pass_at_1(cfg, 0), _heldout_pass_at_1(cfg, steps)
    assert after >= before + 0.08, (before, after)
    final = summary.final_hf_checkpoint
    config = json.loads((cfg.layout.hf_final / ADAPTER_CONFIG).read_text())
    assert final == str(cfg.layout.hf_final) and config["r"] == 16
    _, base = load_hf_checkpoint(config["base_model_name_or_path"])
    assert load_peft_adapter(final, base).config.lora.targets == ("q", "k", "v", "o", "gate", "up", "down")

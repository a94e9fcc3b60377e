"""A LoRA run of the main job (configs/train_cpu.yaml, adapters of rank 16 on every projection, the random base
frozen) learns what its reward teaches first: to stop inside the length limit (rollout.workflow.truncation
'penalize'). Its greedy held-out answers (200 prompts) all hit the 4-token limit before training and none do
after 30 steps. Greedy pass@1 after 30 steps is not asserted: it is bimodal between runs of the same seed (0.0 or
0.03 in 5 of 12 runs, 0.125-0.195 in the others, session 17), because the async interleaving differs and the barely
trained model answers most prompts with one digit; the sampled correct fraction barely moves in 100 steps
(0.005 -> 0.009; full fine-tuning 0.008 -> 0.089 in 50; docs/lora.md). The final export is a PEFT adapter over the
exported base, which loads back."""

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


def _heldout(cfg, version: int) -> dict:
    return json.loads((cfg.layout.eval_dir / f"step-{version}" / "eval.json").read_text())["overall"]


def test_a_lora_run_of_the_main_job_learns(tmp_path):
    steps = 30
    overrides = [f"train_steps={steps}", f"eval.every_steps={steps}", "report.plots=false", f"output_dir={tmp_path}"]
    cfg = load_experiment("configs/train_cpu.yaml", [*overrides, *LORA])
    summary = run_async(cfg)
    assert summary.version == steps
    before, after = _heldout(cfg, 0), _heldout(cfg, steps)
    assert before["truncated_fraction"] == 1.0 and before["response_length_mean"] == 4.0, before
    assert after["truncated_fraction"] <= 0.25 and after["response_length_mean"] <= 3.0, after
    final = summary.final_hf_checkpoint
    config = json.loads((cfg.layout.hf_final / ADAPTER_CONFIG).read_text())
    assert final == str(cfg.layout.hf_final) and config["r"] == 16
    _, base = load_hf_checkpoint(config["base_model_name_or_path"])
    assert load_peft_adapter(final, base).config.lora.targets == ("q", "k", "v", "o", "gate", "up", "down")

"""The demo end to end on a small config (assembled like a run: the configured dataset and reward), and
the CLI's config commands."""

import json

from areal_jax.cli import main
from areal_jax.config import load_experiment
from areal_jax.jobs.demo import run_demo


def test_demo_generates_scores_and_checks_logprobs(tmp_path):
    cfg = load_experiment(
        "configs/demo.yaml",
        [
            f"output_dir={tmp_path}",
            "dataset.max_prompt_tokens=32",
            "rollout.workflow.sampling.max_new_tokens=8",
            "dataset.arithmetic.operators=*",  # not the default task: the demo must score this one
            "dataset.arithmetic.min_operand=2",
            "generation.num_prompts=3",
            "generation.samples_per_prompt=2",
            "generation.max_new_tokens=4",
        ],
    )
    summary = run_demo(cfg)
    assert summary["samples"] == 6
    assert 0 < summary["generated_tokens"] <= 24
    assert summary["max_logprob_gap_generation_vs_scoring"] < 1e-5
    assert (tmp_path / "demo" / "hf_init" / "model.safetensors").exists()
    records = [json.loads(line) for line in (tmp_path / "demo" / "demo_completions.jsonl").read_text().splitlines()]
    assert len(records) == 6 and all(len(r["logprobs"]) == len(r["output_ids"]) for r in records)
    for r in records:
        left, right = r["prompt"].split("*")
        assert r["answer"] == str(int(left) * int(right))
        assert r["components"]["correct"] == float(r["completion"].strip() == r["answer"])


def test_cli_config_prints_yaml_and_reports_bad_keys(capsys):
    assert main(["config", "configs/train_cpu.yaml", "model.num_layers=3"]) == 0
    assert "num_layers: 3" in capsys.readouterr().out
    assert main(["config", "model.num_layyers=3"]) == 2
    assert "model.num_layyers: unknown key" in capsys.readouterr().err

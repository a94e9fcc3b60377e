"""`areal-jax eval` of base + LoRA adapter: the same greedy completions as the merged full weights, other than the
base's alone; a LoRA run directory resolves to its hf_final/ adapter over that adapter's base."""

from __future__ import annotations

import json

from flax import nnx

from areal_jax.cli import main
from areal_jax.config import load_experiment
from areal_jax.configuration import to_yaml
from areal_jax.jobs.evaluate import resolve_checkpoint
from areal_jax.jobs.starting_policy import load_policy
from areal_jax.system.assembly import build_tokenizer, export_policy
from tests.test_lora_model import with_random_adapters

OVERRIDES = [
    "compilation_cache_dir=null",
    "dataset.heldout=6",
    "eval.max_prompts=6",
    "rollout.inference_share=1",
    "rollout.trainer_share=7",
]
LORA = ["model.lora.rank=4", "model.lora.targets=[q,v,o,down]", "model.lora.export_merged=true"]


def _completions(path) -> list[str]:
    return [s["completion"] for s in json.loads((path / "eval.json").read_text())["samples"]]


def test_eval_takes_base_and_adapter(tmp_path, capsys):
    cfg = load_experiment("configs/train_cpu.yaml", [*OVERRIDES, *LORA, f"output_dir={tmp_path}"])
    model = load_policy(cfg, None, build_tokenizer(cfg))
    model = nnx.merge(nnx.graphdef(model), with_random_adapters(model, seed=3, std=1.0))
    final = export_policy(cfg, model, tmp_path / "final")
    common = ["eval", "configs/train_cpu.yaml", *OVERRIDES]
    runs = {
        "adapter": ["--checkpoint", str(final / "base"), "--adapter", str(final)],
        "merged": ["--checkpoint", str(final / "merged")],
        "base": ["--checkpoint", str(final / "base")],
    }
    for name, args in runs.items():
        assert main([*common, *args, "--output", str(tmp_path / name)]) == 0
    assert "LoRA adapter" in json.loads((tmp_path / "adapter" / "eval.json").read_text())["checkpoint"]
    assert _completions(tmp_path / "adapter") == _completions(tmp_path / "merged")
    assert _completions(tmp_path / "adapter") != _completions(tmp_path / "base")

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    export_policy(cfg, model, run_dir / "hf_final")
    source = resolve_checkpoint(run_dir)
    assert (source.adapter, source.hf_dir) == (run_dir / "hf_final", (run_dir / "hf_final" / "base").absolute())

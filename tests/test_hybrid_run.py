"""`areal-jax train` on a Qwen3.5 policy: the mixture's smoke recipe (`qwen3_5_moe`) on a tiny HF checkpoint (two
periods of [linear, full] layers) with the BPE tokenizer of the other smoke runs trains three steps and evaluates;
the engine serves it from recurrent states beside the full layers' KV cache, its log-probs the trainer's, under
routing replay: the only run of the whole system (engine recording, rollout log, trainer replaying) through the
hybrid stack. The dense family's run would repeat it layer for layer but the experts (one whole-system run per
path): its recipe loads in tests/test_recipes.py, its engine and trainer agree in tests/test_hybrid_engine.py and
test_hybrid_train.py, its export loads in transformers in tests/test_hybrid_parity.py."""

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from areal_jax.cli import main
from areal_jax.config import load_experiment
from areal_jax.jsonl import read_jsonl
from areal_jax.models.config import ModelConfig, MoEConfig
from areal_jax.models.hf_io import save_hf_checkpoint
from areal_jax.models.hybrid_config import HybridConfig
from areal_jax.models.init import create_decoder
from areal_jax.reporting.metric_keys import is_evaluation
from tests.tiny_hf_run import TOKENIZER_FILES, TinyRun, make_tiny_hf_run, tiny_qwen2_config

L, F = "linear_attention", "full_attention"
HYBRID = HybridConfig(layer_types=(L, F, L, F), linear_key_head_dim=8, linear_value_head_dim=8, chunk=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyRun:
    return make_tiny_hf_run(tmp_path_factory.mktemp("tiny"))


def _train(tmp_path: Path, tiny: TinyRun, cfg: ModelConfig, recipe: str) -> tuple[Any, list[dict], list[dict]]:
    """Train `recipe` on a fresh checkpoint of `cfg`: the run's config, its training and evaluation metrics."""
    checkpoint = tmp_path / f"tiny-{cfg.family}"
    save_hf_checkpoint(cfg, create_decoder(cfg, 0, mesh=None), checkpoint)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tiny.checkpoint / name, checkpoint / name)
    overrides = [
        f"output_dir={tmp_path / 'runs'}",
        f"hf_checkpoint={checkpoint}",
        f"dataset.files=[{{path: '{tiny.gsm8k}', mapping: gsm8k}}]",
    ]
    assert main(["train", recipe, *overrides]) == 0
    run = load_experiment(recipe, overrides)
    lines = list(read_jsonl(run.run_dir / "metrics.jsonl"))
    metrics = [m for m in lines if not is_evaluation(m)]
    assert [m["train/version"] for m in metrics] == [1, 2, 3]
    # the first step's samples all come from version 0, which its proximal pass scores: the engine's behaviour
    # log-probs against the trainer's, the same weights on both sides (the run's own log-prob monitor)
    assert metrics[0]["staleness/0/n_tokens"] > 0 and metrics[0]["staleness/0/logp_abs_diff_max"] < 1e-4
    evaluations = [m for m in lines if is_evaluation(m)]
    assert any("eval/pass@1" in m for m in evaluations)
    return run, metrics, evaluations


def test_qwen3_5_moe_smoke_recipe_trains_with_replay_and_evaluates(tmp_path, tiny):
    """Every trained token of every layer goes through the experts the engine recorded for it (routing replay),
    and the export is a Qwen3.5-MoE checkpoint."""
    moe = MoEConfig(
        num_experts=4,
        experts_per_token=2,
        expert_intermediate_size=32,
        shared_expert_intermediate_size=32,
        norm_topk_prob=True,
    )
    cfg = tiny_qwen2_config(tiny.model_vocab).replace(
        family="qwen3_5_moe", qkv_bias=False, num_layers=4, hybrid=HYBRID, moe=moe
    )
    run, metrics, _ = _train(tmp_path, tiny, cfg, "configs/recipes/qwen3_5_moe_gsm8k_smoke.yaml")
    assert run.trainer.moe.routing_replay == "rollout"
    for m in metrics:
        assert m["moe/routing_differs/n_tokens"] > 0 and m["moe/routing_differs/mean"] == 0.0, m
        assert all(f"moe/routing_differs/layer{i}" in m for i in range(4)), m
    exported = json.loads((run.run_dir / "hf_final" / "config.json").read_text())
    assert exported["architectures"] == ["Qwen3_5MoeForCausalLM"] and exported["num_experts"] == 4

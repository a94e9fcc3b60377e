"""`areal-jax train` on a Qwen3.5 policy: the smoke recipe on a tiny `qwen3_5` HF checkpoint (two periods of
[linear, full] layers) with the BPE tokenizer of the other smoke runs trains three steps and evaluates; the engine
serves it from recurrent states beside the full layers' KV cache, its log-probs the trainer's."""

import shutil

from areal_jax.cli import main
from areal_jax.config import load_experiment
from areal_jax.jsonl import read_jsonl
from areal_jax.models.hf_io import save_hf_checkpoint
from areal_jax.models.hybrid_config import HybridConfig
from areal_jax.models.init import create_decoder
from areal_jax.reporting.metric_keys import is_evaluation
from tests.tiny_hf_run import TOKENIZER_FILES, make_tiny_hf_run, tiny_qwen2_config

L, F = "linear_attention", "full_attention"


def test_qwen3_5_smoke_recipe_trains_and_evaluates(tmp_path):
    tiny = make_tiny_hf_run(tmp_path / "tiny")
    hybrid = HybridConfig(layer_types=(L, F, L, F), linear_key_head_dim=8, linear_value_head_dim=8, chunk=16)
    cfg = tiny_qwen2_config(tiny.model_vocab).replace(family="qwen3_5", qkv_bias=False, num_layers=4, hybrid=hybrid)
    checkpoint = tmp_path / "tiny-qwen3_5"
    save_hf_checkpoint(cfg, create_decoder(cfg, 0, mesh=None), checkpoint)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tiny.checkpoint / name, checkpoint / name)
    recipe = "configs/recipes/qwen3_5_gsm8k_smoke.yaml"
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
    assert any("eval/pass@1" in m for m in lines if is_evaluation(m))
    assert (run.run_dir / "hf_final" / "config.json").exists()

"""A user's own model and data, end to end: a tiny Qwen2 HF checkpoint with a real BPE tokenizer and chat
template, GSM8K- and DeepCoder-format jsonl files; `areal-jax train` from the recipes' smoke variants with
the math reward, the code reward and the multi-turn math workflow, then `areal-jax eval` on the export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_jax.cli import main
from areal_jax.config import load_experiment
from areal_jax.data.datasets import DatasetConfig, load_prompts
from areal_jax.data.rollout_log_reader import read_shard
from areal_jax.data.rollout_log_shards import list_shards
from areal_jax.jsonl import read_jsonl
from areal_jax.models.tokenizer import load_tokenizer
from areal_jax.reporting.metric_keys import is_evaluation
from tests.dynamic_sampling_rewards import never_rewarded
from tests.tiny_hf_run import make_tiny_hf_run

RECIPES = sorted(Path("configs/recipes").glob("*.yaml"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_run(tmp_path_factory.mktemp("tiny-hf-run"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_loads_and_fits_its_own_limits(recipe):
    cfg = load_experiment(recipe)  # cross-section checks included: prompt + answer fit the cache and a packed row
    longest, _ = cfg.longest_sample()
    assert longest <= cfg.trainer.packing.row_length
    assert cfg.dataset.max_prompt_tokens + cfg.rollout.workflow.sampling.max_new_tokens <= cfg.rollout.engine.max_length
    if recipe.stem.endswith("_cpu"):  # a recipe of the embedded task: its warm start is the checkpoint
        assert not cfg.dataset.files and cfg.warm_start.steps and cfg.rollout.staleness.max_head_offpolicyness >= 2
    elif not recipe.stem.endswith("_smoke"):
        assert cfg.dataset.files and cfg.hf_checkpoint and cfg.rollout.staleness.max_head_offpolicyness >= 2


def _train(tmp_path: Path, recipe: str, checkpoint: Path, data: Path, mapping: str, *extra: str) -> Path:
    overrides = [
        f"output_dir={tmp_path}",
        f"hf_checkpoint={checkpoint}",
        f"dataset.files=[{{path: '{data}', mapping: {mapping}}}]",
        *extra,
    ]
    assert main(["train", f"configs/recipes/{recipe}.yaml", *overrides]) == 0
    cfg = load_experiment(f"configs/recipes/{recipe}.yaml", overrides)
    metrics = [m for m in read_jsonl(cfg.run_dir / "metrics.jsonl") if not is_evaluation(m)]
    assert [m["train/version"] for m in metrics] == [1, 2, 3]
    assert (cfg.run_dir / "hf_final" / "config.json").exists()
    return cfg.run_dir


def test_gsm8k_recipe_trains_with_the_math_reward_and_evaluates(tmp_path, tiny, capsys):
    run_dir = _train(tmp_path, "qwen25_05b_gsm8k_smoke", tiny.checkpoint, tiny.gsm8k, "gsm8k")
    lines = read_jsonl(run_dir / "metrics.jsonl")
    assert all("rollout/correct_mean" in m for m in lines if not is_evaluation(m))
    assert any("eval/pass@1" in m for m in lines if is_evaluation(m))  # the smoke recipe evaluates
    capsys.readouterr()
    out_dir = tmp_path / "eval"
    code = main(
        [
            "eval",
            "configs/recipes/qwen25_05b_gsm8k_smoke.yaml",
            f"dataset.files=[{{path: '{tiny.gsm8k}', mapping: gsm8k}}]",
            f"eval.files=[{{path: '{tiny.gsm8k}', mapping: gsm8k}}]",
            "eval.samples_per_prompt=2",
            "eval.max_prompts=6",
            "eval.temperature=1.0",
            "--checkpoint",
            str(run_dir / "hf_final"),
            "--output",
            str(out_dir),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "pass@1" in printed and "avg@2" in printed
    report = json.loads((out_dir / "eval.json").read_text())
    assert report["overall"]["prompts"] == 6


def test_deepcoder_recipe_trains_with_the_code_reward(tmp_path, tiny):
    run_dir = _train(tmp_path, "deepcoder_code_smoke", tiny.checkpoint, tiny.deepcoder, "deepcoder")
    trained = [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    known = {r.id for r in load_prompts(DatasetConfig(path=str(tiny.deepcoder), mapping="deepcoder"))}
    assert {p for row in trained for _, p in row["groups"]} <= known


def test_dapo_recipe_drops_uniform_groups_and_shapes_overlong_answers(tmp_path, tiny):
    # a tiny random model earns no math reward: a reward that half the prompts can never earn gives both kinds
    reward = "reward.kind=tests.dynamic_sampling_rewards:half_uniform"
    run_dir = _train(
        tmp_path, "r1_distill_qwen_1p5b_deepscaler_dapo_smoke", tiny.checkpoint, tiny.gsm8k, "gsm8k", reward
    )
    log = run_dir / "rollout_log"
    trajectories = [entry.trajectory for shard in list_shards(log) for entry in read_shard(log, shard)[0]]
    untrained = {t.prompt_id for t in trajectories if not t.trains}
    assert untrained and all(never_rewarded(p) for p in untrained)
    trained = {g for row in read_jsonl(run_dir / "trained_groups.jsonl") for g, _ in row["groups"]}
    assert trained and not trained & {t.group_id for t in trajectories if not t.trains}
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    # 16 new tokens at most, the last 8 penalised: a random model's answers run long
    assert all(m["adv/overlong_frac"] > 0 and m["adv/overlong_penalty_mean"] < 0 for m in metrics)


def test_multi_turn_math_recipe_trains(tmp_path, tiny):
    # a random model rarely emits <|im_end|>: a stop string ends its turns early so the environment replies
    run_dir = _train(
        tmp_path,
        "r1_distill_qwen_1p5b_deepscaler_smoke",
        tiny.checkpoint,
        tiny.gsm8k,
        "gsm8k",
        "rollout.workflow.sampling.stop_strings=[e]",
    )
    log = run_dir / "rollout_log"
    trajectories = [entry.trajectory for shard in list_shards(log) for entry in read_shard(log, shard)[0]]
    turns = [t.metadata["num_turns"] for t in trajectories]
    assert max(turns) == 2 and min(turns) >= 1  # retries happened, within max_turns
    second = next(t for t in trajectories if t.metadata["num_turns"] == 2)
    retry = load_tokenizer(str(tiny.checkpoint)).decode(second.token_ids[~second.loss_mask].tolist())
    assert "Try again" in retry

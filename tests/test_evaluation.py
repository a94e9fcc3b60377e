"""`evaluate` and `areal-jax eval` on the embedded arithmetic task with a tiny random model: the metrics
against a hand computation from the per-sample records, greedy determinism, the files written, and the
CLI on an HF checkpoint directory and on a run directory's training checkpoint."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.cli import main
from areal_jax.config import load_experiment
from areal_jax.configuration import ConfigError, to_yaml
from areal_jax.data.datasets import DatasetConfig
from areal_jax.eval_config import EvalConfig
from areal_jax.inference.engine import Engine
from areal_jax.inference.generator import Generator
from areal_jax.jobs.evaluate import (
    CheckpointSource,
    eval_records,
    resolve_checkpoint,
    restore_trained_params,
    run_eval,
)
from areal_jax.jobs.starting_policy import load_policy
from areal_jax.models.hf_io import save_hf_checkpoint
from areal_jax.rollout.evaluation import evaluate, is_correct
from areal_jax.rollout.rewards import Reward
from areal_jax.sharding import make_mesh
from areal_jax.system.assembly import build_prompts, build_tokenizer, build_workflow
from areal_jax.trainer.checkpoint import CheckpointConfig, TrainCheckpointer
from areal_jax.trainer.trainer import Trainer

OVERRIDES = [
    "compilation_cache_dir=null",
    "dataset.heldout=6",
    "rollout.inference_share=1",  # the CLI's inference mesh: one of the 8 test devices
    "rollout.trainer_share=7",
]


def parity_reward(completion: str, task) -> tuple[float, dict[str, float]]:
    """Correct when the completion has an even number of characters; the reward (>= 1 either way) must
    not decide correctness when a `correct` component is reported."""
    correct = float(len(completion) % 2 == 0)
    return 2.0 - correct, {"correct": correct}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    cfg = load_experiment(
        "configs/train_cpu.yaml",
        [*OVERRIDES, f"output_dir={root}", "reward.kind=tests.test_evaluation:parity_reward"],
    )
    tokenizer = build_tokenizer(cfg)
    model = load_policy(cfg, None, tokenizer)
    engine = Engine(model, cfg.rollout.engine)
    with (
        Reward(cfg.reward) as reward,
        build_workflow(cfg.rollout.workflow, tokenizer, reward) as workflow,
        Generator(engine, engine.load_params(nnx.state(model), 7), detokenize=tokenizer.decode) as generator,
    ):
        _, heldout = build_prompts(cfg, workflow)
        yield cfg, generator, workflow, heldout


def _parity(sample) -> bool:
    return len(sample.completion) % 2 == 0


def _hand_metrics(samples, k, correct_of=_parity):
    groups = defaultdict(list)
    for s in samples:
        groups[s.prompt_index].append(s)
    correct = {p: [correct_of(s) for s in sorted(g, key=lambda s: s.sample_index)] for p, g in groups.items()}
    assert all(len(c) == k for c in correct.values())
    n = len(samples)
    return {
        "prompts": len(groups),
        "samples": n,
        "k": k,
        "pass@1": sum(c[0] for c in correct.values()) / len(groups),
        "avg@k": sum(sum(c) for c in correct.values()) / n,
        "pass@k": sum(any(c) for c in correct.values()) / len(groups),
        "reward_mean": sum(s.reward for s in samples) / n,
        "response_length_mean": sum(s.response_length for s in samples) / n,
        "truncated_fraction": sum(s.finish_reason != "stop" for s in samples) / n,
    }


def test_metrics_match_a_hand_computation_per_source_and_overall(setup, tmp_path):
    cfg, generator, workflow, heldout = setup
    records = heldout[:3] + [dataclasses.replace(r, source="other") for r in heldout[3:]]
    report = evaluate(generator, workflow, records, EvalConfig(samples_per_prompt=4, temperature=1.0), seed=3)

    assert len(report.samples) == 6 * 4 and report.policy_version == 7
    assert [s.prompt_id for s in report.samples[::4]] == [r.id for r in records]
    assert all(s.correct == _parity(s) and s.reward == 2.0 - _parity(s) for s in report.samples)
    assert 0 < sum(s.correct for s in report.samples) < len(report.samples), "the stub should split the samples"
    assert all(s.response_length <= cfg.rollout.workflow.sampling.max_new_tokens for s in report.samples)
    assert report.overall.as_dict() == pytest.approx(_hand_metrics(report.samples, 4))
    assert list(report.by_source) == ["arithmetic", "other"]
    for source, metrics in report.by_source.items():
        mine = [s for s in report.samples if s.source == source]
        assert metrics.as_dict() == pytest.approx(_hand_metrics(mine, 4))
    assert report.scalars()["eval/pass@k"] == report.overall.pass_at_k
    assert report.scalars()["eval/other/avg@k"] == report.by_source["other"].avg_at_k

    json_path, md_path = report.write(tmp_path / "out")
    written = json.loads(Path(json_path).read_text())
    assert written["overall"] == pytest.approx(report.overall.as_dict())
    assert written["by_source"]["other"]["prompts"] == 3 and len(written["samples"]) == 24
    assert written["sampling"]["temperature"] == 1.0 and written["sampling"]["max_new_tokens"] == 4
    table = Path(md_path).read_text()
    assert "| source | prompts | samples | pass@1 | avg@4 | pass@4 |" in table
    for source, metrics in [*report.by_source.items(), ("overall", report.overall)]:
        assert f"| {source} | {metrics.prompts} | {metrics.samples} | {metrics.pass_at_1:.3f} |" in table


def test_greedy_evaluation_is_deterministic(setup):
    _, generator, workflow, heldout = setup
    first, second = (evaluate(generator, workflow, heldout, EvalConfig()) for _ in range(2))
    assert [s.completion for s in first.samples] == [s.completion for s in second.samples]
    assert first.overall == second.overall
    assert first.overall.pass_at_1 == first.overall.avg_at_k == first.overall.pass_at_k
    assert first.sampling.temperature == 0 and first.overall.k == 1


def test_multi_turn_workflow_is_evaluated_per_episode(setup):
    cfg, generator, workflow, heldout = setup
    config = cfg.rollout.workflow.replace(kind="multi_turn", max_turns=2)
    with build_workflow(config, workflow.tokenizer, Reward(cfg.reward)) as multi_turn:
        report = evaluate(generator, multi_turn, heldout[:2], EvalConfig(samples_per_prompt=2, temperature=1.0))
    assert len(report.samples) == 4
    # the episode's reward scores its last model turn; the completion also holds earlier turns and replies
    by_component = _hand_metrics(report.samples, 2, correct_of=lambda s: s.components["correct"] == 1)
    assert report.overall.as_dict() == pytest.approx(by_component)


def test_correctness_rule_and_config_refusals():
    assert is_correct(0.0, {"correct": 1.0}) and not is_correct(5.0, {"correct": 0.0})
    assert is_correct(1.0, {"format": 0.0}) and not is_correct(0.9, {})
    with pytest.raises(ConfigError) as err:
        load_experiment("configs/train_cpu.yaml", ["eval.samples_per_prompt=4"])
    assert "eval.samples_per_prompt" in str(err.value) and "temperature" in str(err.value)
    cfg = load_experiment("configs/train_cpu.yaml", ["eval.samples_per_prompt=4", "eval.temperature=0.7"])
    assert cfg.eval.samples_per_prompt == 4


def test_eval_records_read_files_or_the_heldout_split(setup, tmp_path):
    cfg, _, workflow, heldout = setup
    assert eval_records(cfg.replace(eval=EvalConfig(max_prompts=4)), workflow) == heldout[:4]
    rows = [{"prompt": "9" * 40, "answer": "0"}] + [{"prompt": f"{i}+1", "answer": str(i + 1)} for i in range(5)]
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    files = (DatasetConfig(path=str(path), source="sums"), DatasetConfig(path=str(path), source="again", limit=2))
    records = eval_records(cfg.replace(eval=EvalConfig(files=files, max_prompts=3)), workflow)
    # the 40-character prompt is longer than dataset.max_prompt_tokens (16) and is dropped
    assert [(r.source, r.prompt) for r in records] == [
        ("sums", "0+1"),
        ("sums", "1+1"),
        ("sums", "2+1"),
        ("again", "0+1"),
    ]
    with pytest.raises(ConfigError, match=r"eval.files\[0\]: dataset file .*missing.jsonl"):
        eval_records(
            cfg.replace(eval=EvalConfig(files=(DatasetConfig(path=str(tmp_path / "missing.jsonl")),))), workflow
        )
    with pytest.raises(ConfigError, match=r"eval\.files: is empty and dataset\.heldout is 0"):
        eval_records(cfg.replace(dataset=cfg.dataset.replace(heldout=0)), workflow)


def test_an_external_workflow_is_refused_naming_the_key(tmp_path):
    """Outside agents bring their own episodes: `eval` has no agent to run, and says so before loading weights."""
    cfg = load_experiment(
        "configs/train_cpu.yaml", ["rollout.workflow.kind=external", "dataset.heldout=0", "eval.every_steps=0"]
    )
    source = CheckpointSource(tmp_path, hf_dir=None, run_dir=tmp_path, step=None)
    with pytest.raises(ConfigError, match=r"rollout\.workflow\.kind: is external"):
        run_eval(cfg, source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_rejects_an_unknown_checkpoint_with_one_line(tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert "missing" in err and "does not exist" in err and len(err.splitlines()) == 1
    (tmp_path / "empty").mkdir()
    assert main(["eval", "--checkpoint", str(tmp_path / "empty")]) == 2
    assert "neither an HF checkpoint directory" in capsys.readouterr().err


def test_cli_evaluates_an_hf_directory_and_a_run_directory_alike(tmp_path, capsys):
    """The same weights (seed 1, not the config's seed 0) as an HF directory and as a run's training
    checkpoint: equal greedy completions, so the run directory's params were restored."""
    cfg = load_experiment("configs/train_cpu.yaml", [*OVERRIDES, f"output_dir={tmp_path}", "eval.max_prompts=4"])
    tokenizer = build_tokenizer(cfg)
    model = load_policy(cfg.replace(seed=1), None, tokenizer)
    hf_dir = save_hf_checkpoint(model.config, model, tmp_path / "hf")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    trainer = Trainer(model, cfg.trainer, mesh, temperature=cfg.rollout.workflow.sampling.temperature)
    checkpointer = TrainCheckpointer(run_dir / "checkpoints", CheckpointConfig(async_save=False))
    checkpointer.save(3, {"params": trainer.params, "opt_state": trainer.opt_state}, {"version": 3}, wait=True)
    checkpointer.close()
    assert resolve_checkpoint(run_dir).step == 3
    seed0 = nnx.state(load_policy(cfg, mesh, tokenizer))
    restored, metadata = restore_trained_params(run_dir / "checkpoints", seed0, 3)
    assert metadata["version"] == 3
    leaves = (jax.tree.leaves(nnx.state(model)), jax.tree.leaves(restored), jax.tree.leaves(seed0))
    for want, got, other in zip(*leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.sharding == other.sharding
    assert not np.array_equal(np.asarray(jax.tree.leaves(seed0)[0]), np.asarray(jax.tree.leaves(restored)[0]))

    overrides = [*OVERRIDES, f"output_dir={tmp_path}", "eval.max_prompts=4"]
    assert main(["eval", "configs/train_cpu.yaml", *overrides, "--checkpoint", str(hf_dir)]) == 0
    out = capsys.readouterr().out
    assert "pass@1" in out and str(hf_dir / "eval" / "eval.json") in out
    assert main(["eval", "--checkpoint", str(run_dir), "--output", str(tmp_path / "run-eval")]) == 0
    assert "pass@1" in capsys.readouterr().out

    from_hf = json.loads((hf_dir / "eval" / "eval.json").read_text())
    from_run = json.loads((tmp_path / "run-eval" / "eval.json").read_text())
    assert from_hf["overall"]["prompts"] == from_run["overall"]["prompts"] == 4
    assert from_run["policy_version"] == 3 and "training checkpoint 3" in from_run["checkpoint"]
    assert [s["completion"] for s in from_hf["samples"]] == [s["completion"] for s in from_run["samples"]]
    assert [s["prompt_id"] for s in from_hf["samples"]] == [s["prompt_id"] for s in from_run["samples"]]

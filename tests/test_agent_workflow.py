"""`rollout.workflow.kind: agent` end to end: the example agents' smoke recipes train on a tiny checkpoint
(`areal-jax train`: the rollout side starts the proxy, the agents call tools through the real `openai` client),
and a failing agent fails only its own group, counted against `rollout.failures`."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from areal_jax.agents.examples.shop_lookup import calculate, write_tasks
from areal_jax.agents.workflow import AgentWorkflow
from areal_jax.cli import main
from areal_jax.config import load_experiment
from areal_jax.configuration import ConfigError
from areal_jax.data.datasets import PromptRecord
from areal_jax.data.rollout_log_reader import read_shard
from areal_jax.data.rollout_log_shards import list_shards
from areal_jax.eval_config import EvalConfig
from areal_jax.jsonl import read_jsonl
from areal_jax.models.tokenizer import load_tokenizer
from areal_jax.objectives.config import AdvantageConfig
from areal_jax.reporting.metric_keys import is_evaluation
from areal_jax.rollout.agent_config import AgentConfig
from areal_jax.rollout.controller import RolloutController
from areal_jax.rollout.evaluation import evaluate, sampled_workflow
from areal_jax.rollout.failures import FailureBudgetConfig
from areal_jax.rollout.rewards import Reward
from areal_jax.rollout.staleness import StalenessConfig, StalenessManager
from areal_jax.rollout.workflow import WorkflowConfig
from areal_jax.system.assembly import build_prompts, build_workflow
from areal_jax.trainer.batching import build_batch
from tests.test_agent_proxy import TOOL_TEMPLATE, tiny_generator
from tests.tiny_hf_run import make_tiny_hf_run

SHOP_FIELDS = "{prompt: question, answer: answer, id: id, metadata: [prices]}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tests' tiny checkpoint with a chat template that renders tools."""
    run = make_tiny_hf_run(tmp_path_factory.mktemp("tiny-agent-run"))
    config_file = run.checkpoint / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TOOL_TEMPLATE
    config_file.write_text(json.dumps(config))
    return run


def _train(tmp_path: Path, recipe: str, *overrides: str) -> list:
    args = [f"output_dir={tmp_path}", *overrides]
    assert main(["train", f"configs/recipes/{recipe}.yaml", *args]) == 0
    cfg = load_experiment(f"configs/recipes/{recipe}.yaml", args)
    steps = [m for m in read_jsonl(cfg.run_dir / "metrics.jsonl") if not is_evaluation(m)]
    assert [m["train/version"] for m in steps] == [1, 2]
    log = cfg.layout.rollout_log
    return [entry.trajectory for shard in list_shards(log) for entry in read_shard(log, shard)[0]]


def test_the_python_tool_math_agent_trains(tmp_path, tiny):
    trajectories = _train(
        tmp_path,
        "agent_math_python_smoke",
        f"hf_checkpoint={tiny.checkpoint}",
        f"dataset.files=[{{path: '{tiny.gsm8k}', mapping: gsm8k}}]",
    )
    tokenizer = load_tokenizer(str(tiny.checkpoint))
    assert all(t.metadata["num_turns"] >= 2 for t in trajectories)  # the forced python call, then more
    context = tokenizer.decode(trajectories[0].token_ids[~trajectories[0].loss_mask].tolist())
    assert "<tool_response>" in context and '{"name": "python", "arguments": ' in context
    assert all(t.loss_mask.any() and (t.versions[t.loss_mask] >= 0).all() for t in trajectories)
    for version in (0, 2):  # the held-out evaluation runs the agent on the live generator
        report_file = tmp_path / "agent-math-python-smoke" / "eval" / f"step-{version}" / "eval.json"
        report = json.loads(report_file.read_text())
        assert report["policy_version"] == version and report["overall"]["prompts"] == 2, report["overall"]
        assert all(sample["completion"] for sample in report["samples"])


@pytest.fixture(scope="module")
def shop(tmp_path_factory, tiny):
    """The shop smoke recipe's workflow and reward on a tiny generator with the checkpoint's tokenizer."""
    data = write_tasks(tmp_path_factory.mktemp("shop") / "shop.jsonl", rows=6)
    cfg = load_experiment(
        "configs/recipes/agent_shop_lookup_smoke.yaml",
        [f"hf_checkpoint={tiny.checkpoint}", f"dataset.files=[{{path: '{data}', fields: {SHOP_FIELDS}}}]"],
    )
    tokenizer = load_tokenizer(str(tiny.checkpoint))
    generator, _ = tiny_generator(tokenizer, cfg.rollout.engine.max_length)
    with generator, Reward(cfg.reward) as reward, build_workflow(cfg.rollout.workflow, tokenizer, reward) as workflow:
        records, _ = build_prompts(cfg, workflow)
        yield cfg, workflow, generator, records


def test_the_shop_lookup_agent_calls_both_tools_and_scores_its_episodes(shop, tiny):
    _, workflow, generator, records = shop
    assert isinstance(workflow, AgentWorkflow)
    group = asyncio.run(workflow.run(generator, records[0], 7))  # the workflow starts its own proxy here
    assert [t.sample_index for t in group] == [0, 1] and {t.group_id for t in group} == {7}
    tokenizer = load_tokenizer(str(tiny.checkpoint))
    for t in group:
        assert t.metadata["num_turns"] >= 2 and t.reward in (0.0, 1.0) and t.metadata["sequences"] == 1
        context = tokenizer.decode(t.token_ids[~t.loss_mask].tolist())
        assert '"name": "lookup"' in context and '"name": "calculator"' in context and "<tool_response>" in context
        assert (t.versions[t.loss_mask] == generator.version).all()


def _model_spans(mask) -> list[int]:
    """The lengths of the runs of model tokens (one per model turn)."""
    spans, run = [], 0
    for produced in [*mask.tolist(), False]:
        if produced:
            run += 1
        elif run:
            spans, run = [*spans, run], 0
    return spans


def test_a_resampled_agent_workflow_runs_its_episodes_with_its_own_sampling(shop):
    """The held-out evaluation's copy of the workflow: the same agent on the same proxy, each turn sampled with
    the evaluation's settings (greedy here, 4 new tokens a turn), while the rollouts keep theirs (12)."""
    cfg, workflow, generator, records = shop
    eval_sampling = EvalConfig(temperature=0.0, max_new_tokens=4).sampling(workflow.sampling, 0)
    copy = sampled_workflow(workflow, 3, eval_sampling)
    assert isinstance(copy, AgentWorkflow) and copy.config.truncation == "keep"
    greedy = asyncio.run(copy.run(generator, records[0], 0))
    assert [t.sample_index for t in greedy] == [0, 1, 2]
    for t in greedy:
        assert t.metadata["num_turns"] >= 2 and max(_model_spans(t.loss_mask)) <= 4
    assert len({tuple(t.token_ids.tolist()) for t in greedy}) == 1  # greedy: the 3 episodes are the same
    rollouts = asyncio.run(workflow.run(generator, records[0], 1))
    assert max(s for t in rollouts for s in _model_spans(t.loss_mask)) > 4
    assert max(s for t in rollouts for s in _model_spans(t.loss_mask)) <= cfg.rollout.workflow.sampling.max_new_tokens
    report = evaluate(generator, workflow, records[:2], EvalConfig(samples_per_prompt=2, temperature=1.0), seed=3)
    assert report.overall.prompts == 2 and len(report.samples) == 4


_EPISODES = itertools.count()


async def _two_conversations_agent(client, task):
    """Every other episode asks two unrelated conversations (two sequences) and scores 1; the others ask one and
    score 0."""
    two = next(_EPISODES) % 2 == 1
    for prompt in [task.prompt, f"Once more: {task.prompt}"][: 1 + two]:
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": prompt}])
    return float(two)


@pytest.mark.parametrize("extra", ["all", "train_last"])
def test_extra_sequences_all_trains_every_sequence_with_one_advantage_per_episode(shop, monkeypatch, extra):
    cfg, workflow, generator, records = shop
    monkeypatch.setattr(workflow, "agent", _two_conversations_agent)
    monkeypatch.setattr(
        workflow, "config", workflow.config.replace(agent=workflow.config.agent.replace(extra_sequences=extra))
    )
    group = asyncio.run(workflow.run(generator, records[0], 3))
    by_sample = {i: [t for t in group if t.sample_index == i] for i in (0, 1)}
    split = next(i for i, ts in by_sample.items() if ts[0].metadata["sequences"] == 2)
    assert {t.reward for t in by_sample[split]} == {1.0} and {t.reward for t in by_sample[1 - split]} == {0.0}
    if extra == "train_last":
        assert [len(by_sample[split]), by_sample[split][0].num_sequences] == [1, 1]
        assert by_sample[split][0].metadata["untrained_sequence_tokens"] > 0
        return
    assert [(t.sequence_index, t.num_sequences) for t in by_sample[split]] == [(0, 2), (1, 2)]
    assert by_sample[split][0].metadata["untrained_sequence_tokens"] == 0
    assert by_sample[split][0].token_ids.tolist() != by_sample[split][1].token_ids.tolist()
    # GRPO over the two episodes (rewards 1 and 0): +1 and -1, not the 3-sequence mean's 0.71 and -1.41
    batch = build_batch(group, cfg.trainer.replace(ppo_minibatches=1, advantage=AdvantageConfig()))
    advantages = np.concatenate([mb.advantages[mb.loss_mask] for mb in batch.minibatches])
    np.testing.assert_allclose(sorted(set(np.round(advantages, 4).tolist())), [-1.0, 1.0], atol=1e-3)


async def _broken_agent(client, task):
    await client.chat.completions.create(model="p", messages=[{"role": "user", "content": task.prompt}])
    if task.id.endswith("-1"):
        raise RuntimeError("the agent crashed mid-episode")
    return 0.5


def test_a_failing_agent_fails_only_its_group_against_the_failure_budget(shop, monkeypatch):
    _, workflow, generator, _ = shop
    monkeypatch.setattr(workflow, "agent", _broken_agent)
    tasks = iter([(g, PromptRecord(f"t-{g}", "hi", "1", None, "test", {})) for g in range(4)])
    staleness = StalenessManager(StalenessConfig(max_head_offpolicyness=4, batch_prompts=4, max_concurrent=4))
    groups: list = []
    controller = RolloutController(
        generator, workflow, tasks, staleness, groups.append, failures=FailureBudgetConfig(max_consecutive=3)
    ).start()
    assert controller.exhausted.wait(timeout=60)
    controller.stop()
    assert controller.stats.failed == 1 and controller.stats.accepted == 3 and controller.failure is None
    assert sorted(t.group_id for group in groups for t in group) == [0, 0, 2, 2, 3, 3]
    assert all(t.reward == 0.5 for group in groups for t in group)
    assert generator.num_in_flight() == 0


def test_an_agent_must_be_named_and_async():
    with pytest.raises(ConfigError, match="agent\\.function"):
        WorkflowConfig(kind="agent")
    with pytest.raises(ConfigError, match="not an async function"):
        AgentWorkflow(WorkflowConfig(kind="agent", agent=AgentConfig(function="json:dumps")), None, None)


def test_the_calculator_evaluates_arithmetic_only():
    assert calculate("3*2 + (4 - 1) / 2") == 7.5
    for bad in ("__import__('os')", "2**10", "1/0", "x"):
        with pytest.raises(ValueError):
            calculate(bad)

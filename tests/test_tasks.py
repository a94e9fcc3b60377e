"""The prompt stream (Grain shuffle per epoch, held-out split, re-issue), the reward choice, and the
assembly's checks on prompts and vocabularies."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from areal_jax.config import load_experiment
from areal_jax.configuration import ConfigError
from areal_jax.data.datasets import PromptRecord
from areal_jax.data.tasks import (
    TaskStream,
    arithmetic_records,
    chain_sum_records,
    drop_long_prompts,
    load_task_records,
    split_heldout,
)
from areal_jax.jobs.starting_policy import load_policy
from areal_jax.models.tokenizer import CharTokenizer
from areal_jax.rewards.synthetic import ChainSumTaskConfig, chain_sum_reward
from areal_jax.rollout.environments import CodeFeedbackEnvironment, MathRetryEnvironment
from areal_jax.rollout.rewards import Reward, RewardConfig
from areal_jax.seeds import stream_seed
from areal_jax.system.assembly import build_prompts, build_workflow, check_reward_fields


def _records(n: int) -> list[PromptRecord]:
    return [PromptRecord(f"p{i}", f"{i}+1", str(i + 1), None, "test", {}) for i in range(n)]


def test_stream_shuffles_each_epoch_differently_and_covers_every_prompt_once_per_epoch():
    stream = TaskStream(_records(7), seed=3, epochs=3)
    assert len(stream) == 21
    ids = [stream.task_for(g).id for g in range(21)]
    epochs = [ids[i : i + 7] for i in range(0, 21, 7)]
    assert all(sorted(e) == sorted(f"p{i}" for i in range(7)) for e in epochs)
    assert epochs[0] != epochs[1] and epochs[0] != [f"p{i}" for i in range(7)]
    assert ids == [TaskStream(_records(7), seed=3, epochs=3).task_for(g).id for g in range(21)]  # seeded
    assert [TaskStream(_records(7), seed=4).task_for(g).id for g in range(7)] != epochs[0]
    with pytest.raises(IndexError, match="past the end"):
        stream.task_for(21)
    unshuffled = TaskStream(_records(3), seed=0, shuffle=False)
    assert [unshuffled.task_for(g).id for g in range(6)] == ["p0", "p1", "p2"] * 2  # repeats forever


def test_stream_reissues_lost_groups_first_then_continues_in_order():
    stream = TaskStream(_records(5), seed=0, epochs=2)
    pairs = list(stream.groups(first_group_id=7, reissue=(2, 5)))
    assert [g for g, _ in pairs] == [2, 5, 7, 8, 9]
    assert all(task == stream.task_for(g) for g, task in pairs)


def test_heldout_split_is_seeded_and_disjoint():
    records = _records(50)
    train, heldout = split_heldout(records, 10, seed=1)
    assert len(heldout) == 10 and len(train) == 40
    assert {r.id for r in train}.isdisjoint(r.id for r in heldout)
    assert [r.id for r in split_heldout(records, 10, seed=1)[1]] == [r.id for r in heldout]
    assert [r.id for r in split_heldout(records, 10, seed=2)[1]] != [r.id for r in heldout]
    with pytest.raises(ValueError, match="leaves no training prompt"):
        split_heldout(records, 50, seed=1)


def test_long_prompts_are_dropped_and_reported(caplog):
    records = _records(12)
    kept = drop_long_prompts(records, lambda r: len(r.prompt), 3)
    assert [r.id for r in kept] == [f"p{i}" for i in range(10)]  # "9+1" has 3 characters, "10+1" 4
    assert "skipped 2 of 12 prompts longer than 3 tokens" in caplog.text
    with pytest.raises(ValueError, match=r"dataset\.max_prompt_tokens"):
        drop_long_prompts(records, lambda r: 100, 3)


def test_user_reward_function_is_imported_by_name(monkeypatch):
    module = types.ModuleType("my_rewards")
    module.length_reward = lambda text, task: (float(len(text)), {"correct": 0.0})
    monkeypatch.setitem(sys.modules, "my_rewards", module)
    with Reward(RewardConfig(kind="my_rewards:length_reward")) as reward:
        assert reward.fn("abc", None) == (3.0, {"correct": 0.0})
        assert isinstance(reward.environment(), MathRetryEnvironment)
    with pytest.raises(ConfigError, match="has no function 'missing'"):
        Reward(RewardConfig(kind="my_rewards:missing"))
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz'"):
        Reward(RewardConfig(kind="no_such_module_xyz:fn"))
    with Reward(RewardConfig(kind="code")) as reward:
        assert isinstance(reward.environment(), CodeFeedbackEnvironment)


def test_rewards_refuse_prompts_without_what_they_read():
    code_task = PromptRecord("c1", "write code", None, {"inputs": ["1"], "outputs": ["1"]}, "deepcoder", {})
    with pytest.raises(ConfigError, match=r"reads each prompt's 'answer'.*1 of 2 prompts.*c1 from deepcoder"):
        check_reward_fields([*_records(1), code_task], RewardConfig(kind="math"))
    with pytest.raises(ConfigError, match="'tests'"):
        check_reward_fields(_records(1), RewardConfig(kind="code"))
    check_reward_fields([code_task], RewardConfig(kind="code"))


def test_prompts_of_a_run_with_system_prompt_and_heldout():
    cfg = load_experiment(
        "configs/train_cpu.yaml",
        [
            "dataset.kind=arithmetic",
            "reward.kind=arithmetic",
            "dataset.heldout=16",
            "dataset.arithmetic_problems=128",  # about a fifth have two one-digit operands
            "dataset.arithmetic.max_operand=20",
            "dataset.max_prompt_tokens=10",
        ],
    )
    tokenizer = CharTokenizer()
    with Reward(cfg.reward) as reward, build_workflow(cfg.rollout.workflow, tokenizer, reward) as workflow:
        train, heldout = build_prompts(cfg, workflow)
        assert len(heldout) == 16 and {r.id for r in train}.isdisjoint(r.id for r in heldout)
        lengths = np.array([len(workflow.render_prompt(r)) for r in train + heldout])
        assert lengths.max() == 10 and 16 < len(lengths) < 128  # "Q: 4+4\nA: " kept, "Q: 14+4\nA: " dropped
    with pytest.raises(ValueError, match="renders only"):
        cfg = cfg.replace(rollout=cfg.rollout.replace(workflow=cfg.rollout.workflow.replace(system_prompt="Be brief.")))
        with Reward(cfg.reward) as reward, build_workflow(cfg.rollout.workflow, tokenizer, reward) as workflow:
            build_prompts(cfg, workflow)


def test_policy_vocabulary_is_masked_to_the_tokenizer_and_a_small_one_refused():
    cfg = load_experiment("configs/train_cpu.yaml", ["model.vocab_size=64", "warm_start.steps=0"])
    model = load_policy(cfg, None, CharTokenizer())
    assert model.config.vocab_size == 64 and model.config.vocab_limit == 27
    assert (
        load_policy(cfg.replace(model=cfg.model.replace(vocab_size=27)), None, CharTokenizer()).config.vocab_limit
        is None
    )
    with pytest.raises(ConfigError, match=r"model\.vocab_size: value 20 is below the tokenizer's vocabulary size 27"):
        load_policy(cfg.replace(model=cfg.model.replace(vocab_size=20)), None, CharTokenizer())


def test_arithmetic_records_follow_the_task_config():
    cfg = load_experiment("configs/train_cpu.yaml", ["dataset.arithmetic.operators=+"])
    records = arithmetic_records(cfg.dataset.arithmetic, 20, seed=0)
    assert all("+" in r.prompt and int(r.answer) == eval(r.prompt) for r in records)  # digits and + only


def _cumulative(prompt: str) -> str:
    """The worked chain by an independent route: NumPy's cumulative sum of the terms."""
    return ",".join(str(v) for v in np.cumsum([int(t) for t in prompt.split("+")])[1:])


def test_chain_sums_are_seeded_distinct_and_their_worked_answers_right():
    config = ChainSumTaskConfig(min_terms=2, max_terms=5, problems=3000)
    records = chain_sum_records(config, seed=7)
    assert [(r.prompt, r.answer) for r in records] == [(r.prompt, r.answer) for r in chain_sum_records(config, 7)]
    assert [r.prompt for r in chain_sum_records(config, 8)] != [r.prompt for r in records]
    assert len({r.prompt for r in records}) == 3000
    assert all(r.answer == _cumulative(r.prompt) for r in records)
    terms = {r.metadata["terms"] for r in records}
    assert terms == {2, 3, 4, 5} and all(r.metadata["terms"] == r.prompt.count("+") + 1 for r in records)
    lengths = [len(r.answer) for r in records]
    assert min(lengths) == 1 and max(lengths) >= 10  # "3+4" -> "7"; 5 terms -> four partial sums


def test_chain_sums_difficulty_knob_sets_the_chain_lengths():
    easy = chain_sum_records(ChainSumTaskConfig(min_terms=2, max_terms=3, problems=500), seed=0)
    hard = chain_sum_records(ChainSumTaskConfig(min_terms=6, max_terms=8, max_operand=20, problems=500), seed=0)
    assert {r.answer.count(",") + 1 for r in easy} == {1, 2}
    assert {r.answer.count(",") + 1 for r in hard} == {5, 6, 7}
    assert all(int(t) <= 20 for r in hard for t in r.prompt.split("+"))
    assert max(len(r.answer) for r in hard) > 3 * max(len(r.answer) for r in easy)
    with pytest.raises(ConfigError, match=r"problems: value 200 exceeds the 150 distinct problems"):
        ChainSumTaskConfig(min_terms=2, max_terms=3, max_operand=4, problems=200)
    with pytest.raises(ConfigError, match="max_terms"):
        ChainSumTaskConfig(min_terms=4, max_terms=3)


def test_chain_sum_reward_checks_every_partial_sum():
    assert chain_sum_reward("12,15,23", "12,15,23") == 1.0
    assert chain_sum_reward(" 12, 15,23 ", "12,15,23", format_bonus=0.1) == 1.0
    assert chain_sum_reward("12,16,23", "12,15,23", format_bonus=0.1) == 0.1  # a wrong step, right final sum
    assert chain_sum_reward("12,15", "12,15,23", format_bonus=0.1) == 0.0  # a step missing
    assert chain_sum_reward("23", "12,15,23", format_bonus=0.1) == 0.0  # only the result
    assert chain_sum_reward("12,,23", "12,15,23", format_bonus=0.1) == 0.0
    task = PromptRecord("s", "7+5+3", "12,15", None, "chain_sums", {})
    with Reward(RewardConfig(kind="chain_sums", format_bonus=0.1)) as reward:
        assert reward.fn("12,15", task) == (1.0, {"correct": 1.0, "format": 1.0})
        assert reward.fn("12,14", task) == (0.1, {"correct": 0.0, "format": 1.0})
        assert reward.fn("nonsense", task) == (0.0, {"correct": 0.0, "format": 0.0})


def test_default_task_heldout_is_disjoint_from_training_problems():
    cfg = load_experiment("configs/chain_sums_cpu.yaml", ["dataset.chain_sums.problems=2000", "dataset.heldout=100"])
    assert cfg.dataset.kind == "chain_sums" and cfg.reward.kind == "chain_sums"
    records = load_task_records(cfg.dataset, stream_seed(cfg.seed, "tasks"))
    with Reward(cfg.reward) as reward, build_workflow(cfg.rollout.workflow, CharTokenizer(), reward) as workflow:
        train, heldout = build_prompts(cfg, workflow)
    assert len(train) + len(heldout) == len(records) == 2000 and len(heldout) == 100
    assert {r.prompt for r in train}.isdisjoint(r.prompt for r in heldout)  # no held-out problem is trained

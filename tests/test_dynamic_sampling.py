"""DAPO dynamic sampling: uniform-reward groups are logged untrained, replaced within the staleness bound,
skipped by the pipeline, and neither re-issued nor counted by a resumed rollout side."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
from flax import nnx

from areal_jax.configuration import ConfigError
from areal_jax.data.pipeline import PipelineConfig, build_pipeline, pipeline_stats
from areal_jax.data.rollout_log import RolloutLogWriter
from areal_jax.data.rollout_log_reader import logged_groups
from areal_jax.data.trajectory import NOT_TRAINED
from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.sampling import SamplingParams
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.tokenizer import CharTokenizer
from areal_jax.rewards.synthetic import ArithmeticTaskConfig, make_problems
from areal_jax.rollout.config import RolloutConfig
from areal_jax.rollout.controller import RolloutController
from areal_jax.rollout.dynamic_sampling import (
    UNIFORM_REWARD,
    DynamicSampler,
    DynamicSamplingConfig,
    is_uniform,
    marked_untrained,
)
from areal_jax.rollout.environments import arithmetic_prompt_record
from areal_jax.rollout.staleness import StalenessConfig, StalenessManager
from areal_jax.rollout.workflow import RLVRWorkflow, WorkflowConfig
from areal_jax.system.cluster import resume_point
from tests.dynamic_sampling_rewards import half_uniform
from tests.rollout_log_worker import make_trajectory

FAST = {"poll_initial_s": 0.005, "poll_max_s": 0.05, "idle_timeout_s": 0.3}


def _group(group_id: int, rewards: list[float]):
    return [dataclasses.replace(make_trajectory(group_id, i), reward=r) for i, r in enumerate(rewards)]


def test_uniform_groups_are_dropped_and_marked_and_a_run_of_them_stops_the_rollouts():
    assert is_uniform(_group(0, [1.0, 1.0, 1.0])) and not is_uniform(_group(0, [1.0, 0.0, 1.0]))
    marked = marked_untrained(_group(3, [0.5, 0.5]))
    assert [t.trains for t in marked] == [False, False] and marked[0].metadata[NOT_TRAINED] == UNIFORM_REWARD
    assert all(t.trains for t in _group(3, [0.5, 0.5]))  # the originals are untouched

    off = DynamicSampler(DynamicSamplingConfig())
    assert not off.drops(_group(0, [0.0, 0.0])) and off.dropped == 0
    sampler = DynamicSampler(DynamicSamplingConfig(enabled=True, max_dropped_in_a_row=2))
    assert sampler.drops(_group(0, [0.0, 0.0])) and sampler.exhausted() is None
    assert not sampler.drops(_group(1, [0.0, 1.0]))  # a usable group resets the run of drops
    assert sampler.drops(_group(2, [1.0, 1.0])) and sampler.exhausted() is None
    assert sampler.drops(_group(3, [0.0, 0.0]))
    assert "dropped 2 groups in a row" in str(sampler.exhausted()) and sampler.dropped == 3


def test_config_refuses_dynamic_sampling_of_single_samples():
    with pytest.raises(ConfigError, match=r"dynamic_sampling\.enabled: is true but workflow\.n_samples is 1"):
        RolloutConfig(workflow=WorkflowConfig(n_samples=1), dynamic_sampling=DynamicSamplingConfig(enabled=True))


def _wait(predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_dropped_groups_are_logged_and_replaced_within_the_staleness_bound():
    tokenizer = CharTokenizer()
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_layers=1)
    model = Decoder(cfg, nnx.Rngs(0))
    engine = Engine(model, EngineConfig(max_slots=8, max_length=64))
    generator = Generator(engine, engine.load_params(nnx.state(model), 0))
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=0)
    workflow = RLVRWorkflow(WorkflowConfig(n_samples=2, sampling=sampling), tokenizer, half_uniform)
    problems = make_problems(ArithmeticTaskConfig(), 40, seed=0)
    tasks = enumerate(arithmetic_prompt_record(p) for p in problems)
    staleness = StalenessManager(StalenessConfig(max_head_offpolicyness=0, batch_prompts=3, max_concurrent=4))
    received, lock = [], threading.Lock()

    def sink(trajectories):
        with lock:
            received.append(trajectories)

    def kept() -> list:
        with lock:
            return [g for g in received if g[0].trains]

    with generator, workflow:
        controller = RolloutController(
            generator, workflow, tasks, staleness, sink, dynamic_sampling=DynamicSamplingConfig(enabled=True)
        ).start()
        _wait(lambda: (s := staleness.snapshot()).running == 0 and s.capacity == 0)  # at the gate of version 0
        controller.stop()
    snap = staleness.snapshot()
    dropped = [g for g in received if not g[0].trains]
    assert len(kept()) == snap.accepted == 3  # B usable groups at eta 0, however many were dropped
    assert len(dropped) == snap.rejected == controller.stats.dropped >= 3  # half the prompts are uniform
    assert all(is_uniform(g) and not any(t.trains for t in g) for g in dropped)
    assert all(not is_uniform(g) for g in kept())
    assert all(int(g[0].prompt_id.split("-")[1]) % 2 == 0 for g in dropped)


def test_pipeline_skips_untrained_groups_and_a_resumed_side_neither_reissues_nor_counts_them(tmp_path: Path):
    writer = RolloutLogWriter(tmp_path, "w0")
    for g in range(6):
        group = _group(g, [0.0, 1.0])
        for t in marked_untrained(group) if g in (1, 4) else group:
            writer.append(t)
        writer.flush()
    writer.close()
    config = PipelineConfig(group_size=2, groups_per_batch=2, **FAST)
    iterator = iter(build_pipeline(tmp_path, config))
    batches = list(iterator)
    assert [sorted({t.group_id for t in b}) for b in batches] == [[0, 2], [3, 5]]
    stats = pipeline_stats(iterator.get_state())
    assert (stats["emitted"], stats["untrained_groups"], stats["dropped_groups"]) == (4, 2, 0)

    logged = logged_groups(tmp_path)
    assert logged == {0: True, 1: False, 2: True, 3: True, 4: False, 5: True}
    point = resume_point(logged, 0, 1, untrained=[g for g, trains in logged.items() if not trains])
    assert (point.reissue, point.next_group_id, point.written) == ((), 6, 4)
    two_servers = resume_point(logged, 0, 2, untrained=[1, 4])  # server 0 owns 0, 2, 4
    assert (two_servers.reissue, two_servers.written) == ((), 2)

"""Rollout controller: keeps generating within the staleness bound, never leaks capacity, stops cleanly."""

import asyncio
import collections
import threading
import time

from flax import nnx

from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.sampling import SamplingParams
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.tokenizer import CharTokenizer
from areal_jax.rewards.synthetic import ArithmeticTaskConfig, arithmetic_reward, make_problems
from areal_jax.rollout.controller import RolloutController
from areal_jax.rollout.environments import SyntheticRewardFn, arithmetic_prompt_record
from areal_jax.rollout.failures import ReissueGroup
from areal_jax.rollout.staleness import Admission, StalenessConfig, StalenessManager
from areal_jax.rollout.workflow import RLVRWorkflow, WorkflowConfig


def _wait(predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _setup():
    tokenizer = CharTokenizer()
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_layers=1)
    model = Decoder(cfg, nnx.Rngs(0))
    engine = Engine(model, EngineConfig(max_slots=8, max_length=64))
    generator = Generator(engine, engine.load_params(nnx.state(model), 0))
    workflow = RLVRWorkflow(
        WorkflowConfig(n_samples=2, sampling=SamplingParams(max_new_tokens=4, seed=0)),
        tokenizer,
        SyntheticRewardFn(arithmetic_reward),
    )
    tasks = enumerate([arithmetic_prompt_record(p) for p in make_problems(ArithmeticTaskConfig(), 50, seed=0)])
    return generator, workflow, tasks


class ParkedStaleness(StalenessManager):
    """A staleness manager that counts the callers inside `wait_for_capacity`: with no capacity and nothing
    running, a parked controller cannot start anything until the version moves."""

    def __init__(self, config: StalenessConfig):
        super().__init__(config)
        self.parked = 0

    def wait_for_capacity(self, timeout: float | None = None) -> Admission | None:
        self.parked += 1
        try:
            return super().wait_for_capacity(timeout)
        finally:
            self.parked -= 1


def test_controller_respects_staleness_and_hands_over_groups():
    generator, workflow, tasks = _setup()
    staleness = ParkedStaleness(StalenessConfig(max_head_offpolicyness=1, batch_prompts=2, max_concurrent=8))
    received, lock = [], threading.Lock()

    def sink(trajectories):
        with lock:
            received.append((trajectories, staleness.snapshot().version))

    def blocked() -> bool:
        snap = staleness.snapshot()
        return snap.running == 0 and snap.capacity == 0 and staleness.parked == 1

    with generator, workflow:
        controller = RolloutController(generator, workflow, tasks, staleness, sink).start()
        _wait(blocked)  # every admitted group handed over; the controller waits at the gate
        assert len(received) == 4 and staleness.snapshot().accepted == 4  # (eta + v + 1) * B at version 0
        staleness.set_version(1)
        _wait(lambda: staleness.snapshot().version == 1 and blocked())
        controller.stop()
    assert [version for _, version in received] == [0] * 4 + [1] * 2  # nothing more before set_version(1)
    groups = [t[0].group_id for t, _ in received]
    assert sorted(groups) == list(range(6))
    assert all(len(t) == 2 and {x.sample_index for x in t} == {0, 1} for t, _ in received)
    assert controller.stats.accepted == 6 and controller.stats.trajectories == 12 and controller.next_group_id == 6


def test_failing_sink_rejects_without_leaking_capacity():
    generator, workflow, tasks = _setup()
    staleness = StalenessManager(StalenessConfig(max_head_offpolicyness=0, batch_prompts=2, max_concurrent=2))
    calls = []

    def sink(trajectories):
        calls.append(len(trajectories))
        if len(calls) <= 2:
            raise OSError("disk full")

    with generator, workflow:
        controller = RolloutController(generator, workflow, tasks, staleness, sink).start()
        _wait(lambda: len(calls) == 4)
        controller.stop()
    snap = staleness.snapshot()
    assert snap.rejected == 2 and snap.accepted == 2 and snap.running == 0
    assert controller.stats.failed == 2


def test_a_group_failed_with_reissue_runs_again_under_its_id_even_after_the_tasks_ran_out():
    """Kind 'external': a group whose outside agents died is counted as a failure and issued again, same group id;
    the controller waits for it before it reports the tasks exhausted."""
    ran_out = threading.Event()
    attempts: collections.Counter[int] = collections.Counter()

    def tasks():
        yield from enumerate("abc")
        ran_out.set()

    class LastGroupFailsOnce:
        async def run(self, generator, task, group_id):
            attempts[group_id] += 1
            if group_id == 2 and attempts[group_id] == 1:
                await asyncio.to_thread(ran_out.wait, 60)  # fails once the task source has run out
                raise ReissueGroup("its agents died")
            return [(group_id, task)]

    staleness = StalenessManager(StalenessConfig(max_head_offpolicyness=4, batch_prompts=2, max_concurrent=4))
    received = []
    controller = RolloutController(None, LastGroupFailsOnce(), tasks(), staleness, received.append).start()
    try:
        assert controller.exhausted.wait(60)
    finally:
        controller.stop()
    assert sorted(received) == [[(0, "a")], [(1, "b")], [(2, "c")]] and attempts == {0: 1, 1: 1, 2: 2}
    assert (controller.stats.failed, controller.stats.reissued, controller.stats.accepted) == (1, 1, 3)
    assert staleness.snapshot().running == 0


def test_stop_ends_the_wait_for_a_group_that_never_finishes_after_the_tasks_ran_out():
    """An external group whose episodes nobody runs: stop() cancels it instead of waiting for it."""
    started, cancelled = threading.Event(), threading.Event()

    class NeverFinishes:
        async def run(self, generator, task, group_id):
            started.set()
            try:
                await asyncio.Event().wait()
            finally:
                cancelled.set()

    staleness = StalenessManager(StalenessConfig(max_head_offpolicyness=4, batch_prompts=2, max_concurrent=4))
    controller = RolloutController(None, NeverFinishes(), iter([(0, "a")]), staleness, lambda t: None).start()
    assert started.wait(60)
    begun = time.monotonic()
    controller.stop()
    assert cancelled.is_set() and time.monotonic() - begun < 10 and not controller.exhausted.is_set()
    assert controller.stats.accepted == 0 and staleness.snapshot().running == 0

"""Staleness: admission control (the AReaL bound, eta = 0 as synchronous, blocking waits) and the one rule for
a trajectory's staleness."""

import threading

import numpy as np
import pytest

from areal_jax.configuration import ConfigError
from areal_jax.data.pipeline import staleness_of
from areal_jax.data.trajectory import Trajectory
from areal_jax.rollout.staleness import StalenessConfig, StalenessManager
from areal_jax.system.step_report import reward_stats


def admit(manager: StalenessManager) -> bool:
    """Admit one prompt if the bound allows it now."""
    return manager.wait_for_capacity(timeout=0)


def test_bound_follows_formula():
    manager = StalenessManager(StalenessConfig(max_head_offpolicyness=2, batch_prompts=4, max_concurrent=100))
    admitted = 0
    while admit(manager):
        admitted += 1
    assert admitted == (2 + 0 + 1) * 4
    for _ in range(4):
        manager.finish(accepted=True)
    assert manager.snapshot().capacity == 0  # accepted + running still equals (eta + v + 1) * B
    manager.set_version(1)
    assert manager.snapshot().capacity == 4
    snap = manager.snapshot()
    assert (snap.running, snap.accepted, snap.version) == (8, 4, 1)


def test_rejected_prompts_free_capacity_and_concurrency_cap():
    manager = StalenessManager(StalenessConfig(max_head_offpolicyness=0, batch_prompts=4, max_concurrent=3))
    assert [admit(manager) for _ in range(4)] == [True, True, True, False]
    manager.finish(accepted=False)
    assert admit(manager)
    for _ in range(3):
        manager.finish(accepted=True)
    assert admit(manager)
    manager.finish(accepted=True)
    assert manager.snapshot().accepted == 4 and not admit(manager)  # eta = 0: wait for the trainer
    manager.set_version(1)
    assert admit(manager)


def test_wait_for_capacity_wakes_on_version_and_close():
    manager = StalenessManager(StalenessConfig(max_head_offpolicyness=0, batch_prompts=1))
    assert admit(manager)
    manager.finish(accepted=True)
    assert not manager.wait_for_capacity(timeout=0.01)
    results = []
    waiter = threading.Thread(target=lambda: results.append(manager.wait_for_capacity(timeout=30)))
    waiter.start()
    manager.set_version(1)
    waiter.join(timeout=30)
    assert results == [True]
    closer = threading.Thread(target=lambda: results.append(manager.wait_for_capacity(timeout=30)))
    closer.start()
    manager.close()
    closer.join(timeout=30)
    assert results == [True, False]


def test_misuse_is_refused():
    manager = StalenessManager(StalenessConfig())
    with pytest.raises(RuntimeError, match="without a matching admission"):
        manager.finish(accepted=True)
    manager.set_version(3)
    with pytest.raises(ValueError, match="backwards"):
        manager.set_version(2)
    with pytest.raises(ConfigError, match="batch_prompts"):
        StalenessConfig(batch_prompts=0)


def _trajectory(versions: list[int]) -> Trajectory:
    n = len(versions)
    return Trajectory(
        token_ids=np.arange(n, dtype=np.int32),
        behav_logprobs=np.zeros(n, np.float32),
        versions=np.asarray(versions, np.int32),
        loss_mask=np.asarray(versions, np.int32) >= 0,
        prompt_length=2,
        reward=0.0,
        prompt_id="p",
        group_id=0,
        sample_index=0,
    )


def test_run_statistics_use_the_one_staleness_rule():
    """A trajectory without generated tokens (aborted before its first) has staleness 0 in the pipeline's filter
    and in the run's statistics alike; the statistics once said trainer version + 1."""
    generated, empty = _trajectory([-1, -1, 3, 4]), _trajectory([-1, -1, -1])
    assert [staleness_of(t, 5) for t in (generated, empty)] == [2, 0]
    stats = reward_stats([generated, empty], version=5)
    assert stats["rollout/staleness_max"] == 2 and stats["rollout/staleness_mean"] == 1.0

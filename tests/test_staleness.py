"""Staleness: admission control (the AReaL bound, eta = 0 as synchronous, blocking waits) and the one rule for
a trajectory's staleness."""

import threading

import numpy as np
import pytest

from areal_jax.configuration import ConfigError
from areal_jax.data.pipeline import staleness_of
from areal_jax.data.trajectory import Trajectory
from areal_jax.rollout.staleness import Admission, StalenessConfig, StalenessManager
from areal_jax.system.step_report import reward_stats


def admit(manager: StalenessManager) -> Admission | None:
    """Admit one prompt if the bound allows it now."""
    return manager.wait_for_capacity(timeout=0)


def admit_all(manager: StalenessManager) -> list[Admission]:
    return list(iter(lambda: admit(manager), None))


def test_bound_follows_formula():
    manager = StalenessManager(StalenessConfig(max_head_offpolicyness=2, batch_prompts=4, max_concurrent=100))
    admitted = admit_all(manager)
    assert len(admitted) == (2 + 0 + 1) * 4 and {a.version for a in admitted} == {0}
    for admission in admitted[:4]:
        manager.finish(admission, accepted=True)
    assert manager.snapshot().capacity == 0  # accepted + running still equals (eta + v + 1) * B
    manager.set_version(1)
    assert manager.snapshot().capacity == 4
    snap = manager.snapshot()
    assert (snap.running, snap.accepted, snap.version, snap.floor) == (8, 4, 1, 0)


def test_a_prompt_running_long_holds_admission_back():
    """A prompt admitted at v trains at v + eta + 1 at most only if at most (eta + v + 2) * B prompts are
    admitted before it ends: while one admitted at 0 runs, the versions past 1 admit nothing more."""
    manager = StalenessManager(StalenessConfig(max_head_offpolicyness=1, batch_prompts=2, max_concurrent=100))
    slow, *others = admit_all(manager)
    for admission in others:
        manager.finish(admission, accepted=True)
    manager.set_version(1)
    assert [a.version for a in admit_all(manager)] == [1, 1]  # (1 + min(1, 0 + 1) + 1) * 2 = 6
    manager.set_version(2)
    assert admit(manager) is None and manager.snapshot().floor == 0  # still 6: the slow one may train at 2
    manager.finish(slow, accepted=True)
    assert manager.snapshot().floor == 1 and manager.snapshot().capacity == 2  # (1 + min(2, 2) + 1) * 2 - 6
    episode = manager.wait_for_capacity(timeout=0, trains=False)  # an agent proxy's external episode
    assert episode is not None and manager.snapshot().running == 3
    manager.set_version(5)
    assert manager.snapshot().floor == 1  # the two prompts admitted at 1, not the episode admitted at 2


def test_peer_floor_and_a_restarted_servers_earlier_floor():
    config = StalenessConfig(max_head_offpolicyness=0, batch_prompts=4, max_concurrent=100)
    manager = StalenessManager(config, version=5, server=0, servers=2)
    assert admit(manager) is None  # the others' floors are not known yet
    manager.set_peer_floor(2)  # the other server still runs a prompt admitted at 2
    assert len(admit_all(manager)) == 8  # half of (0 + min(5, 2 + 1) + 1) * 4
    restarted = StalenessManager(config, version=3, server=1, servers=2, admits_from=4)
    restarted.set_peer_floor(None)
    assert admit(restarted) is None and restarted.snapshot().floor == 4  # it published 4 before its restart
    restarted.set_version(4)
    assert [a.version for a in admit_all(restarted)] == [4] * 10


def test_rejected_prompts_free_capacity_and_concurrency_cap():
    manager = StalenessManager(StalenessConfig(max_head_offpolicyness=0, batch_prompts=4, max_concurrent=3))
    first, *rest = admit_all(manager)
    assert len(rest) == 2  # max_concurrent
    manager.finish(first, accepted=False)
    rest.append(admit(manager))
    for admission in rest:
        manager.finish(admission, accepted=True)
    last = admit(manager)
    assert last is not None and admit(manager) is None
    manager.finish(last, accepted=True)
    assert manager.snapshot().accepted == 4 and admit(manager) is None  # eta = 0: wait for the trainer
    manager.set_version(1)
    assert admit(manager) is not None


def test_wait_for_capacity_wakes_on_version_and_close():
    manager = StalenessManager(StalenessConfig(max_head_offpolicyness=0, batch_prompts=1))
    manager.finish(admit(manager), accepted=True)
    assert manager.wait_for_capacity(timeout=0.01) is None
    results = []
    waiter = threading.Thread(target=lambda: results.append(manager.wait_for_capacity(timeout=30)))
    waiter.start()
    manager.set_version(1)
    waiter.join(timeout=30)
    assert results == [Admission(1)]
    closer = threading.Thread(target=lambda: results.append(manager.wait_for_capacity(timeout=30)))
    closer.start()
    manager.close()
    closer.join(timeout=30)
    assert results == [Admission(1), None]


def test_misuse_is_refused():
    manager = StalenessManager(StalenessConfig())
    with pytest.raises(RuntimeError, match="without a matching admission"):
        manager.finish(Admission(0), accepted=True)
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

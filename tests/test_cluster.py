"""The rules the rollout servers and the trainer share across processes (`system/cluster.py`), the
launcher's core split and command lines, and the staleness bound split over servers."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest

from areal_jax.jobs.launcher import server_specs, share_cores, split_cores, trainer_specs
from areal_jax.rollout.staleness import StalenessConfig, StalenessManager, server_share
from areal_jax.system.cluster import ControlFiles, ResumePoint, owns_group, resume_point, server_group_ids


@pytest.mark.parametrize("servers", [1, 2, 3, 5])
def test_server_shares_add_up_to_the_one_process_bound(servers: int) -> None:
    for total in range(0, 40):
        shares = [server_share(total, i, servers) for i in range(servers)]
        assert sum(shares) == total
        assert max(shares) - min(shares) <= 1


def test_servers_together_admit_exactly_the_one_process_bound() -> None:
    config = StalenessConfig(max_head_offpolicyness=2, batch_prompts=5, max_concurrent=100)
    managers = [StalenessManager(config, version=1, server=i, servers=3) for i in range(3)]
    assert all(m.wait_for_capacity(0) is None for m in managers)  # not before it knows the others' floors
    for manager in managers:
        manager.set_peer_floor(1)
    admitted = sum(1 for m in managers for _ in iter(functools.partial(m.wait_for_capacity, 0), None))
    single = StalenessManager(config, version=1)
    assert admitted == sum(1 for _ in iter(functools.partial(single.wait_for_capacity, 0), None)) == (2 + 1 + 1) * 5
    for manager in managers:
        manager.set_version(2)
    assert sum(m.snapshot().capacity for m in managers) == 5  # one more batch per version, over all servers


def test_a_server_index_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="server 2 is not one of 2"):
        StalenessManager(StalenessConfig(), server=2, servers=2)


def test_group_ids_are_partitioned_between_servers() -> None:
    ids = [list(itertools.islice(server_group_ids(ResumePoint((), i, 0), 3, 100), 10)) for i in range(3)]
    flat = sorted(g for part in ids for g in part)
    assert flat == list(range(30))
    assert all(owns_group(g, i, 3) for i, part in enumerate(ids) for g in part)


def test_resume_point_reissues_the_groups_a_dead_server_had_in_flight() -> None:
    # server 1 of 3 wrote 1, 4, 10 and 16; 7 and 13 were in flight when it died; 0/2/5 belong to others
    point = resume_point([0, 1, 2, 4, 5, 10, 16], server=1, servers=3)
    assert point == ResumePoint(reissue=(7, 13), next_group_id=19, written=4)
    assert list(itertools.islice(server_group_ids(point, 3, 100), 4)) == [7, 13, 19, 22]
    assert resume_point([0, 2], server=1, servers=3) == ResumePoint((), 1, 0)  # nothing of its own yet
    assert list(server_group_ids(resume_point([], 0, 2), 2, 7)) == [0, 2, 4, 6]  # ends with the stream


def test_control_files(tmp_path: Path) -> None:
    control = ControlFiles(tmp_path, servers=2)
    control.clear()
    assert not control.all_done() and control.failures() == [] and not control.stop_requested()
    control.write_status(1, {"emitted_tokens": 5})
    assert [s["emitted_tokens"] for s in control.statuses()] == [5]
    control.mark_done(0)
    assert not control.all_done()
    control.mark_done(1)
    control.mark_failed(1, "reward crashed")
    control.request_stop("end")
    assert control.all_done() and control.stop_requested()
    assert control.failures() == ["rollout server 1: reward crashed"]
    control.clear()  # a restarted trainer starts without the markers of an earlier attempt
    assert not control.all_done() and control.failures() == [] and not control.stop_requested()
    assert not list(tmp_path.glob("control/.*.tmp"))  # atomic writes leave no temporary file


def test_cores_are_split_between_roles() -> None:
    assert split_cores([0, 1], 1) == (frozenset({0}), frozenset({1}))
    assert split_cores([4, 5, 6, 7], 3) == (frozenset({4, 5, 6}), frozenset({7}))
    assert split_cores([3], 1) == (frozenset({3}), frozenset({3}))  # one core: shared
    with pytest.raises(ValueError, match="--trainer-cores 2"):
        split_cores([0, 1], 2)


def test_role_command_lines() -> None:
    (trainer,) = trainer_specs(["c.yaml", "seed=1"], 2, frozenset({0}), resume=True)
    servers = [spec for i in range(2) for spec in server_specs(["c.yaml", "seed=1"], 2, i, frozenset({1}))]
    assert [s.name for s in (trainer, *servers)] == ["trainer", "rollout0", "rollout1"]
    assert trainer.argv[-5:] == ("trainer", "--resume", "c.yaml", "seed=1", "cluster.rollout_servers=2")
    assert servers[1].argv[-5:] == ("--server", "1", "c.yaml", "seed=1", "cluster.rollout_servers=2")
    assert (trainer.cores, servers[0].cores) == (frozenset({0}), frozenset({1}))


def test_a_trainer_over_several_processes_joins_one_coordinator_on_its_own_cores() -> None:
    specs = trainer_specs(["c.yaml"], 1, frozenset({0, 1, 2}), processes=2, port=9)
    assert [s.name for s in specs] == ["trainer0", "trainer1"]
    for i, spec in enumerate(specs):
        assert spec.argv[-6:] == (
            "c.yaml",
            "cluster.rollout_servers=1",
            "distributed.enabled=true",
            "distributed.coordinator_address=127.0.0.1:9",
            "distributed.num_processes=2",
            f"distributed.process_id={i}",
        )
    assert [s.cores for s in specs] == [frozenset({0}), frozenset({1, 2})]
    assert share_cores(frozenset({5}), 3) == [frozenset({5})] * 3  # fewer cores than processes: shared
    assert share_cores(frozenset(range(4)), 2) == [frozenset({0, 1}), frozenset({2, 3})]
    with pytest.raises(ValueError, match="trainer over several processes needs a coordinator port"):
        trainer_specs(["c.yaml"], 1, frozenset({0}), processes=2)


def test_a_rollout_server_over_several_processes_is_one_job_on_its_own_port() -> None:
    specs = [spec for i in range(2) for spec in server_specs(["c.yaml"], 2, i, frozenset({1, 2}), 2, 7 + i)]
    assert [s.name for s in specs] == ["rollout0.0", "rollout0.1", "rollout1.0", "rollout1.1"]
    for spec, (server, process) in zip(specs, [(0, 0), (0, 1), (1, 0), (1, 1)], strict=True):
        assert spec.argv[-9:] == (
            "rollout",
            "--server",
            str(server),
            "c.yaml",
            "cluster.rollout_servers=2",
            "distributed.enabled=true",
            f"distributed.coordinator_address=127.0.0.1:{7 + server}",
            "distributed.num_processes=2",
            f"distributed.process_id={process}",
        )
    assert [s.cores for s in specs[:2]] == [frozenset({1}), frozenset({2})]  # the rollout cores shared out
    with pytest.raises(ValueError, match="rollout0 over several processes needs a coordinator port"):
        server_specs(["c.yaml"], 1, 0, frozenset({1}), 2)


def test_a_resumed_trainer_drops_the_weight_versions_of_its_lost_future(tmp_path: Path) -> None:
    import jax.numpy as jnp

    from areal_jax.jobs.trainer_role import _drop_versions_after
    from areal_jax.weights.orbax_store import OrbaxWeightPublisher, OrbaxWeightSubscriber

    store = tmp_path / "weights"
    publisher = OrbaxWeightPublisher(store, max_to_keep=5, async_save=False)
    for version in range(4):
        publisher.publish({"w": jnp.full((2,), version, jnp.float32)}, version)
    publisher.close()
    _drop_versions_after(store, 1)
    reader = OrbaxWeightSubscriber(store)
    assert reader.latest_version() == 1
    reader.close()
    again = OrbaxWeightPublisher(store, max_to_keep=5, async_save=False)
    again.publish({"w": jnp.zeros((2,), jnp.float32)}, 2)  # the resumed trainer's next version is accepted
    again.close()

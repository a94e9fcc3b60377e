"""The staleness bound over several rollout servers, deterministic and fast: each server's real admission
(`StalenessManager`, its floor exchanged with the others' through the control files of a temporary run
directory by `FloorExchange`) against a simulated trainer that fills batches with whole groups in completion
order, as fast as they complete. Time goes in ticks; a group runs a fixed number of ticks on its server.

The bound: a group admitted at version v trains at version v + eta + 1 at most (its staleness, the trained
version minus its oldest token's, is at most that minus v), with one server or several, of unequal speeds,
one following the trainer's versions late, and one restarted from an older stored version."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import pytest

from areal_jax.rollout.staleness import Admission, StalenessConfig, StalenessManager
from areal_jax.system.admission_floors import FloorExchange
from areal_jax.system.cluster import ControlFiles

ETA, BATCH = 2, 4
CONFIG = StalenessConfig(max_head_offpolicyness=ETA, batch_prompts=BATCH, max_concurrent=64)
TICKS = 300


@dataclasses.dataclass
class Server:
    """One rollout server: its admission and the groups it runs (admission, ticks left)."""

    manager: StalenessManager
    floors: FloorExchange
    ticks_per_group: int
    running: list[tuple[Admission, int]] = dataclasses.field(default_factory=list)
    written: int = 0  # its groups in the log: what a restarted server's count starts from

    def admit(self) -> None:
        while (admission := self.manager.wait_for_capacity(timeout=0)) is not None:
            long_one = (self.written + len(self.running)) % 7 == 3  # now and then a long answer
            self.running.append((admission, self.ticks_per_group * (3 if long_one else 1)))

    def advance(self) -> list[Admission]:
        """One tick: the groups that end now, in the log in this order."""
        ended = [admission for admission, left in self.running if left == 1]
        self.running = [(admission, left - 1) for admission, left in self.running if left > 1]
        for admission in ended:
            self.manager.finish(admission, accepted=True)
        self.written += len(ended)
        return ended


def start_server(control: ControlFiles, index: int, version: int, ticks_per_group: int, written: int = 0) -> Server:
    """Server `index` starting at `version` (a restarted one with its groups in the log), as
    `open_rollout_side` starts it: admitting from the floor it published before."""
    manager = StalenessManager(
        CONFIG, version, server=index, servers=control.servers, admits_from=control.floor(index) or 0
    )
    manager.restore(written, 0, version)
    return Server(manager, FloorExchange(control, index, manager), ticks_per_group, written=written)


def simulate(
    run_dir: Path, ticks_per_group: list[int], *, version_lag: int = 0, restart_at: int | None = None
) -> collections.Counter[int]:
    """Trained version minus admission version of every group trained in `TICKS` ticks. The last server
    follows the trainer's versions `version_lag` ticks late and, at tick `restart_at`, loses its running
    groups and starts again from the version 2 before the trainer's (an older stored one)."""
    control = ControlFiles(run_dir, servers=len(ticks_per_group))
    control.clear()
    control.reset_floors(0)  # what the trainer does before any server starts
    servers = [start_server(control, i, 0, ticks) for i, ticks in enumerate(ticks_per_group)]
    last = len(servers) - 1
    trainer_version, published = 0, [0]  # published[t]: the trainer's version after tick t
    completed: collections.deque[Admission] = collections.deque()
    lateness: collections.Counter[int] = collections.Counter()
    for tick in range(TICKS):
        if tick == restart_at:
            old = servers[last]
            servers[last] = start_server(control, last, max(0, trainer_version - 2), old.ticks_per_group, old.written)
        for server in servers:
            server.floors.exchange()
            server.admit()
        for server in servers:
            completed.extend(server.advance())
        while len(completed) >= BATCH:
            for _ in range(BATCH):
                lateness[trainer_version - completed.popleft().version] += 1
            trainer_version += 1
        published.append(trainer_version)
        for i, server in enumerate(servers):
            seen = published[max(0, len(published) - 1 - (version_lag if i == last else 0))]
            if seen > server.manager.snapshot().version:
                server.manager.set_version(seen)
    return lateness


@pytest.mark.parametrize(
    ("ticks_per_group", "version_lag", "restart_at"),
    [
        ([2], 0, None),  # one process, a long answer now and then
        ([1, 3], 0, None),  # two servers, one three times slower
        ([1, 1, 4], 0, None),  # three servers, one four times slower
        ([1, 2], 5, None),  # the slower one follows the versions late
        ([1, 3], 0, 120),  # the slower one restarted from an older stored version
    ],
    ids=["one-process", "two-servers-one-slow", "three-servers-one-slow", "lagging-versions", "restarted"],
)
def test_a_group_trains_at_most_eta_plus_one_versions_after_its_admission(
    tmp_path: Path, ticks_per_group: list[int], version_lag: int, restart_at: int | None
) -> None:
    lateness = simulate(tmp_path, ticks_per_group, version_lag=version_lag, restart_at=restart_at)
    assert sum(lateness.values()) >= 40 * BATCH, lateness  # the trainer kept going
    assert max(lateness) <= ETA + 1, sorted(lateness.items())


def test_a_server_whose_prompts_ran_out_holds_nobody_back(tmp_path: Path) -> None:
    control = ControlFiles(tmp_path, servers=2)
    control.reset_floors(3)
    done, going = (start_server(control, i, 3, 1) for i in range(2))
    done.floors.exchange()
    done.floors.withdraw()
    going.manager.set_version(9)
    going.floors.exchange()
    assert going.manager.snapshot().capacity == (ETA + 9 + 1) * BATCH // 2

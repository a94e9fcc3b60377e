"""The multi-process shape: its config, and the rules the rollout servers and the trainer share.

Roles talk only through the run directory (local, or any shared file system): the trainer publishes weight
versions into `<run>/weights` (Orbax, see `weights/orbax_store.py`), rollout servers append finished groups
to `<run>/rollout_log`, and small JSON files in `<run>/control` carry status and end-of-run markers. No
service runs between them, so any process may die and restart without another one noticing more than a
pause.

Rollout server i of N owns the group ids g with g % N == i (group g is always prompt g of the task
stream) and the i-th of N near-equal shares of the staleness bound (see `StalenessManager`): the N bounds
add up to the one-process bound. The one thing the servers tell each other is their admission floor
(`control/rollout-<i>.floor.json`, `admission_floors.py`), so that a slow server's old prompts hold the
fast ones back as they would in one process. A restarted server finds from the log which of its groups
were written and issues the others again (`resume_point`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from areal_jax import storage
from areal_jax.run_layout import CONTROL_DIR, WEIGHTS_DIR  # noqa: F401  (the roles' files)
from areal_jax.storage import read_json, write_json_atomic
from areal_jax.system_config import DistributedConfig


def initialize_distributed(config: DistributedConfig) -> None:
    """Join the role's processes (no-op unless enabled)."""
    if not config.enabled:
        return
    import jax

    jax.distributed.initialize(
        coordinator_address=config.coordinator_address,
        num_processes=config.num_processes,
        process_id=config.process_id,
        local_device_ids=list(config.local_device_ids) if config.local_device_ids is not None else None,
    )


def owns_group(group_id: int, server: int, servers: int) -> bool:
    return group_id % servers == server


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where server i goes on: the groups of its lost work (issued, never written) and the next new id."""

    reissue: tuple[int, ...]
    next_group_id: int
    written: int  # its groups in the log that train: what its staleness count starts from


def resume_point(
    written_group_ids: Iterable[int], server: int, servers: int, untrained: Iterable[int] = ()
) -> ResumePoint:
    """From the group ids present in the log: server `server`'s ids below its highest written one that are
    missing (in flight when it died, or set aside by a trainer resume) are issued again, then new ids go on
    after the highest. Groups logged but kept out of training (`untrained`: dynamic sampling) are not issued
    again and do not count in its staleness count."""
    mine = sorted({g for g in written_group_ids if owns_group(g, server, servers)})
    if not mine:
        return ResumePoint((), server, 0)
    present = set(mine)
    reissue = tuple(g for g in range(server, mine[-1], servers) if g not in present)
    return ResumePoint(reissue, mine[-1] + servers, len(present - set(untrained)))


def server_group_ids(point: ResumePoint, servers: int, end: int) -> Iterator[int]:
    """The ids server i issues from `point`: the re-issued ones, then every N-th id below `end`."""
    yield from point.reissue
    yield from range(point.next_group_id, end, servers)


def control_dir(run_location: storage.Location) -> str:
    return storage.join(run_location, CONTROL_DIR)


class ControlFiles:
    """The run directory's `control/` files: per-server status, done and failed markers, the stop marker.
    `run_location` may be local or gs:// (`areal_jax.storage`)."""

    def __init__(self, run_location: storage.Location, servers: int):
        self.directory = control_dir(run_location)
        self.servers = servers

    def status_path(self, server: int) -> str:
        return storage.join(self.directory, f"rollout-{server}.json")

    def done_path(self, server: int) -> str:
        return storage.join(self.directory, f"rollout-{server}.done")

    def failed_path(self, server: int) -> str:
        return storage.join(self.directory, f"rollout-{server}.failed")

    @property
    def stop_path(self) -> str:
        return storage.join(self.directory, "stop")

    @property
    def ready_path(self) -> str:
        """Written by the trainer once it has restored its state and published its version: servers start
        only then (a resumed trainer first sets the log's unread shards aside and drops newer versions)."""
        return storage.join(self.directory, "trainer.json")

    @property
    def direct_weights_path(self) -> str:
        """The direct weight path's announcement (`weights/direct.py`): the version on offer and how to pull
        it; written by the trainer, read by the servers."""
        return storage.join(self.directory, "weights-direct.json")

    def floor_path(self, server: int) -> str:
        """Server i's admission floor (`rollout/staleness.py`), written by server i alone once the trainer set it
        to the version it starts from (`reset_floors`)."""
        return storage.join(self.directory, f"rollout-{server}.floor.json")

    def reset_floors(self, version: int) -> None:
        """A (re)started trainer at `version`, before any server starts: no server has admitted anything yet."""
        for server in range(self.servers):
            self.write_floor(server, version)

    def write_floor(self, server: int, floor: int | None) -> None:
        """Server i's floor; None once it admits nothing more (its prompts ran out)."""
        write_json_atomic(self.floor_path(server), {"floor": floor, "time": time.time()})

    def floor(self, server: int) -> int | None:
        found = read_json(self.floor_path(server))
        return None if found is None else found["floor"]

    def trainer_starting(self) -> None:
        storage.remove(self.ready_path)

    def trainer_ready(self, version: int) -> None:
        write_json_atomic(self.ready_path, {"pid": os.getpid(), "version": version, "time": time.time()})

    def ready_trainer(self) -> dict[str, Any] | None:
        return read_json(self.ready_path)

    def clear(self) -> None:
        """A (re)started trainer: markers of an earlier attempt must not end this one."""
        storage.make_dirs(self.directory)
        for server in range(self.servers):
            for path in (self.done_path(server), self.failed_path(server)):
                storage.remove(path)
        storage.remove(self.stop_path)

    def write_status(self, server: int, status: dict[str, Any]) -> None:
        write_json_atomic(self.status_path(server), {**status, "time": time.time()})

    def statuses(self) -> list[dict[str, Any]]:
        return [s for s in (read_json(self.status_path(i)) for i in range(self.servers)) if s is not None]

    def mark_done(self, server: int) -> None:
        write_json_atomic(self.done_path(server), {"time": time.time()})

    def all_done(self) -> bool:
        return all(storage.exists(self.done_path(i)) for i in range(self.servers))

    def mark_failed(self, server: int, message: str) -> None:
        write_json_atomic(self.failed_path(server), {"message": message, "time": time.time()})

    def failures(self) -> list[str]:
        found = (read_json(self.failed_path(i)) for i in range(self.servers))
        return [f"rollout server {i}: {f['message']}" for i, f in enumerate(found) if f is not None]

    def request_stop(self, reason: str) -> None:
        write_json_atomic(self.stop_path, {"reason": reason, "time": time.time()})

    def stop_requested(self) -> bool:
        return storage.exists(self.stop_path)


def sum_statuses(statuses: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[str, float]:
    """The servers' counters added up (the trainer's view of the whole rollout side)."""
    return {key: float(sum(s.get(key, 0) for s in statuses)) for key in keys}


WEIGHT_SOURCES = ("direct", "orbax")
DIRECT_FALLBACKS = "weights_direct_fallbacks"  # a server's direct pulls that failed (the store delivered)


def weight_load_status(source: str, loads: int, load_seconds: float, lag_seconds: float | None) -> dict[str, float]:
    """A server's status entries for its weight loads by `source`: how many, and the last one's load time
    and lag (from the version becoming loadable by that path to its use; left out when unknown)."""
    status = {f"weights_{source}_loads": float(loads), f"weights_{source}_load_seconds": load_seconds}
    if lag_seconds is not None:
        status[f"weights_{source}_lag_seconds"] = lag_seconds
    return status


def weight_path_stats(statuses: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The trainer's metrics of the weight path over every server: loads per path and failed direct pulls
    (summed), the slowest server's last load time and lag per path. Paths no server used are left out."""
    stats: dict[str, float] = {}
    for source in WEIGHT_SOURCES:
        loads = f"weights_{source}_loads"
        if not any(loads in s for s in statuses):
            continue
        stats[f"weights/{source}_loads"] = sum_statuses(statuses, (loads,))[loads]
        for measure in ("load_seconds", "lag_seconds"):
            values = [s[f"weights_{source}_{measure}"] for s in statuses if f"weights_{source}_{measure}" in s]
            if values:
                stats[f"weights/{source}_{measure}_max"] = float(max(values))
    if any(DIRECT_FALLBACKS in s for s in statuses):
        stats["weights/direct_fallbacks"] = sum_statuses(statuses, (DIRECT_FALLBACKS,))[DIRECT_FALLBACKS]
    return stats

"""What each role of a run computed on: `<run>/control/resources-<role>.json`, read by `areal-jax plan`.

Every process of a run records its own share when it starts: the trainer's processes as `trainer-<process
index>` (the devices of the trainer mesh local to that process), rollout server i as `rollout-<i>` and,
over several processes, its process p > 0 as `rollout-<i>.<p>` (the one-process `train` records its
inference mesh as `rollout-0`). A record holds the host, the platform and
device kind, the device ids and the CPU cores the process may run on (`os.sched_getaffinity`, which
`launch local` pins per role). On CPU the cores are what a role's speed depends on (XLA's CPU devices
share the process's thread pool); elsewhere the devices are.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from typing import Any

import jax

from areal_jax import storage
from areal_jax.storage import read_json, write_json_atomic
from areal_jax.system.cluster import control_dir

_PREFIX = "resources-"


def describe(devices: Iterable[jax.Device]) -> dict[str, Any]:
    """This process's record for a role running on `devices` (its local ones)."""
    devices = sorted(devices, key=lambda d: d.id)
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": [d.id for d in devices],
        "cores": sorted(os.sched_getaffinity(0)),
    }


def record(run_location: storage.Location, role: str, devices: Iterable[jax.Device]) -> None:
    """Write this process's record as `role` (e.g. `trainer-0`, `rollout-2`)."""
    write_json_atomic(storage.join(control_dir(run_location), f"{_PREFIX}{role}.json"), describe(devices))


def record_mesh(run_location: storage.Location, role: str, mesh: jax.sharding.Mesh) -> None:
    """`record` for the devices of `mesh` that belong to this process."""
    record(run_location, role, (d for d in mesh.devices.flat if d.process_index == jax.process_index()))


def rollout_role(server: int) -> str:
    """The record name of this process of rollout server `server`: `rollout-<i>` (its process 0), or
    `rollout-<i>.<p>` for process p of a server over several processes."""
    process = jax.process_index()
    return f"rollout-{server}" if process == 0 else f"rollout-{server}.{process}"


def processes_of(records: dict[str, dict[str, Any]], role: str) -> list[str]:
    """`role` and the records of its other processes (`role.<p>`) found among `records`."""
    return [role, *sorted(name for name in records if name.startswith(f"{role}."))]


def read_all(run_location: storage.Location) -> dict[str, dict[str, Any]]:
    """Every role's record in the run directory `run_location`, by role name."""
    directory = control_dir(run_location)
    found = [n for n in storage.names(directory) if n.startswith(_PREFIX) and n.endswith(".json")]
    records = {n.removeprefix(_PREFIX).removesuffix(".json"): read_json(storage.join(directory, n)) for n in found}
    return {role: value for role, value in records.items() if value is not None}

"""`areal-jax plan --memory`: the memory plan of a config on this machine's devices, or on hardware it lacks
(`--topology`, `--rollout-topology`, `--devices` with `--device-memory-gib`), and whether it fits."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from areal_jax.planning.architecture import architecture
from areal_jax.planning.hardware import hardware, mesh_warnings, plan_for_hardware
from areal_jax.planning.memory import GIB, USABLE_SHARE, device_capacity, plan_memory

if TYPE_CHECKING:
    from areal_jax.config import ExperimentConfig


def print_memory_plan(
    cfg: ExperimentConfig,
    topology: str | None,
    rollout_topology: str | None,
    devices: int | None,
    device_memory_gib: float | None,
) -> int:
    """Print the plan's lines and the fit; a plan that cannot fit raises ConfigError naming keys."""
    from areal_jax.system.assembly import build_meshes

    capacity: int | None
    if any(flag is not None for flag in (topology, rollout_topology, devices, device_memory_gib)):
        where = hardware(topology, rollout_topology, devices, device_memory_gib)
        plan = plan_for_hardware(cfg, where)
        capacity = where.device_bytes
        for warning in mesh_warnings(cfg, where):
            print(f"warning: {warning}", file=sys.stderr)
        print(f"memory plan on {where.name}:")
    else:
        inference_mesh, trainer_mesh = build_meshes(cfg)
        plan = plan_memory(cfg, architecture(cfg), trainer_mesh, inference_mesh)
        capacity = device_capacity(list(trainer_mesh.devices.flat))
    print("\n".join(plan.lines()))
    if capacity is None:
        print("not checked: the devices report no memory limit")
        return 0
    plan.check(capacity)
    need = plan.host_total if plan.host else plan.device_total
    print(f"fits: {need / GIB:.1f} GiB of {capacity * USABLE_SHARE / GIB:.1f} GiB usable")
    return 0

"""The memory plan for hardware this machine need not have (`areal-jax plan --memory --topology v5p-8`, or
`--devices 8 --device-memory-gib 80` for GPUs): the meshes' shapes from the device counts, no devices, no
weights and no tokenizer."""

from __future__ import annotations

import dataclasses

from areal_jax.compile.topology import GIB, parse_slice, uneven_mesh_axes
from areal_jax.config import ExperimentConfig
from areal_jax.configuration import ConfigError
from areal_jax.planning.architecture import architecture
from areal_jax.planning.memory import MemoryPlan, plan_for_shapes
from areal_jax.sharding import MESH_AXES, split_devices


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Devices to plan for: their platform, count and memory each; the rollout's own when it has some."""

    name: str
    platform: str
    devices: int
    device_bytes: int
    rollout_devices: int | None = None  # None: the rollout shares `devices` in the run's shares


def hardware(
    topology: str | None, rollout_topology: str | None, devices: int | None, device_memory_gib: float | None
) -> Hardware:
    """The hardware the command line names: a Cloud TPU slice (and the rollout's own), or GPUs."""
    if topology is not None:
        if devices is not None or device_memory_gib is not None:
            raise ConfigError("--topology", "names the chips: give it without --devices and --device-memory-gib")
        tpu = parse_slice(topology)
        rollout = None if rollout_topology is None else parse_slice(rollout_topology)
        if rollout is not None and rollout.chip != tpu.chip:
            raise ConfigError("--rollout-topology", f"plans the same chip as --topology ({tpu.chip.generation})")
        return Hardware(tpu.name, "tpu", tpu.chips, tpu.chip.hbm_bytes, None if rollout is None else rollout.chips)
    if rollout_topology is not None:
        raise ConfigError("--rollout-topology", "is given with --topology")
    if devices is None or device_memory_gib is None:
        raise ConfigError("--device-memory-gib", "plans GPUs with --devices N (or TPUs with --topology)")
    return Hardware(f"{devices} x {device_memory_gib:g} GiB GPUs", "gpu", devices, int(device_memory_gib * GIB))


def _shape(cfg: ExperimentConfig, devices: int) -> dict[str, int]:
    return dict(zip(MESH_AXES, cfg.mesh.resolve(devices), strict=True))


def _side_devices(cfg: ExperimentConfig, where: Hardware) -> tuple[int, int, bool]:
    """(rollout devices, trainer devices, whether they are the same one): `where`'s devices split in the run's
    inference:trainer shares (one device: both sides on it), unless the rollout has devices of its own."""
    if where.rollout_devices is not None:
        return where.rollout_devices, where.devices, False
    split = split_devices(list(range(where.devices)), cfg.rollout.inference_share, cfg.rollout.trainer_share)
    return len(split[0]), len(split[1]), where.devices == 1


def plan_for_hardware(cfg: ExperimentConfig, where: Hardware) -> MemoryPlan:
    """The run's memory plan on `where` (`_side_devices`)."""
    inference, trainer, shared = _side_devices(cfg, where)
    trainer_shape, inference_shape = _shape(cfg, trainer), _shape(cfg, inference)
    return plan_for_shapes(cfg, architecture(cfg), where.platform, trainer_shape, inference_shape, shared)


def mesh_warnings(cfg: ExperimentConfig, where: Hardware) -> list[str]:
    """What the plan cannot say fits but a TPU compile refuses (`areal-jax compile`, before compiling): a side's mesh
    axis over a number of chips that does not divide the slice's."""
    if where.platform != "tpu":
        return []
    inference, trainer, _ = _side_devices(cfg, where)
    rollout_slice = where.devices if where.rollout_devices is None else where.rollout_devices
    found = [
        uneven_mesh_axes("trainer", _shape(cfg, trainer), where.devices, "rollout.trainer_share"),
        uneven_mesh_axes("rollout", _shape(cfg, inference), rollout_slice, "rollout.inference_share"),
    ]
    return [warning for warning in found if warning is not None]

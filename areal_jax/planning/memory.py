"""The memory plan of a run, from its config alone (nothing compiled): what each device of each mesh holds.

Trainer devices: params (a mixture's experts and routers included), Adam moments and gradients (sharded over
fsdp x tensor; with `model.lora` the moments and gradients of the adapters alone), the largest micro-batch's
activations under the chosen remat (a mixture's dispatch buffers included), the log-prob chunks' logits, the
update's temporaries. Inference devices: the engine's weights (in their serving dtype) and per-layer copies, the
KV cache (dense or paged), the prefill and decode temporaries. Each line names the config keys that change it;
`check` refuses a run that cannot fit, naming the keys of its largest lines. On CPU every "device" is host
memory, so the plan adds both sides and the process's own runtime and compares them with the host's RAM.

The activation and temporary terms are estimates (XLA decides the real buffers); `benchmarks/scale.py` and
`tests/test_memory_plan.py` hold the plan against measured peaks. On TPU the lines are `tpu_memory.py`'s (tiled
layouts, XLA:TPU's gradient buffers and compiled code), held against the TPU compiler by `areal-jax compile`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

import psutil
from jax.sharding import Mesh

from areal_jax.config import ExperimentConfig
from areal_jax.configuration import ConfigError
from areal_jax.models.config import ModelConfig
from areal_jax.planning.memory_terms import (
    MemoryItem,
    _with_overhead,
    inference_items,
    trainer_items,
)

logger = logging.getLogger(__name__)

GIB = 2**30
# What a process holds besides arrays on CPU: Python, JAX/XLA and their libraries, the compiled programs,
# host staging buffers (measured: peak RSS 0.68-0.71 GiB for configs/train_cpu.yaml's one-step run, 2026-12-03,
# after tensorboardX stopped importing torch, which had added ~0.3 GiB).
CPU_RUNTIME_BYTES = int(0.7 * GIB)
# Keys that spread a side over more devices: they lower a device's share, not the host's total.
DEVICE_SPREAD_KEYS = ("mesh.fsdp", "rollout.trainer_share")
# A plan may fill this share of a device (or of host RAM) before it is refused.
USABLE_SHARE = 0.92


@dataclasses.dataclass(frozen=True)
class SidePlan:
    """The per-device memory of one mesh (the trainer's or the inference side's)."""

    side: str
    devices: int
    mesh_shape: dict[str, int]
    items: tuple[MemoryItem, ...]

    @property
    def per_device(self) -> int:
        return sum(item.bytes for item in self.items)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Both sides' per-device plans, and how they share memory (`host`: CPU devices are host RAM)."""

    sides: tuple[SidePlan, ...]
    host: bool
    shared_devices: bool
    runtime_bytes: int

    @property
    def host_total(self) -> int:
        """On CPU: all the process holds (both sides' devices and the runtime)."""
        return sum(side.per_device * side.devices for side in self.sides) + self.runtime_bytes

    @property
    def device_total(self) -> int:
        """The fullest device: both sides' shares when they share devices."""
        if self.shared_devices:
            return sum(side.per_device for side in self.sides)
        return max(side.per_device for side in self.sides)

    def lines(self) -> list[str]:
        out = []
        for side in self.sides:
            shape = " x ".join(f"{axis} {size}" for axis, size in side.mesh_shape.items())
            out.append(f"{side.side}: {side.devices} device(s), mesh {shape}; per device:")
            for item in side.items:
                out.append(f"  {item.name:<44} {item.bytes / GIB:8.2f} GiB")
            out.append(f"  {'total':<44} {side.per_device / GIB:8.2f} GiB")
        if self.host:
            out.append(f"process runtime (Python, JAX/XLA)             {self.runtime_bytes / GIB:8.2f} GiB")
            note = ", the two sides on the same device(s)" if self.shared_devices else ""
            out.append(f"host memory in all                            {self.host_total / GIB:8.2f} GiB{note}")
        return out

    def check(self, capacity_bytes: int) -> None:
        """Refuse a plan over `USABLE_SHARE` of `capacity_bytes` (host RAM on CPU, else one device's memory),
        naming the keys of the largest lines of the fullest side."""
        usable = int(capacity_bytes * USABLE_SHARE)
        if self.host:
            need, items, where = self.host_total, [i for s in self.sides for i in s.items], "host memory"
        elif self.shared_devices:  # both sides on the same device(s)
            need, items, where = self.device_total, [i for s in self.sides for i in s.items], "a device"
        else:
            fullest = max(self.sides, key=lambda s: s.per_device)
            need, items, where = fullest.per_device, list(fullest.items), f"a {fullest.side} device"
        if need <= usable:
            return
        largest = sorted(items, key=lambda i: -i.bytes)[:3]
        keys = list(dict.fromkeys(key for item in largest for key in item.keys))
        if self.host:  # CPU devices all draw on host RAM: spreading over more of them saves nothing
            keys = [key for key in keys if key not in DEVICE_SPREAD_KEYS] or keys
        biggest = ", ".join(f"{i.name} {i.bytes / GIB:.2f} GiB" for i in largest)
        raise ConfigError(
            keys[0],
            f"the run needs about {need / GIB:.1f} GiB of {where} but {usable / GIB:.1f} GiB are usable "
            f"({USABLE_SHARE:.0%} of {capacity_bytes / GIB:.1f} GiB); largest: {biggest}; change "
            f"{', '.join(keys)} (`areal-jax plan --memory CONFIG` shows the whole plan)",
        )


def plan_memory(
    cfg: ExperimentConfig,
    model: ModelConfig,
    trainer_mesh: Mesh,
    inference_mesh: Mesh | None,
) -> MemoryPlan:
    """The plan of a run whose policy is `model` (the checkpoint's architecture with the run's choices) on
    these meshes; `inference_mesh` None: the rollout side is not in this process."""
    shared = inference_mesh is not None and set(inference_mesh.devices.flat) == set(trainer_mesh.devices.flat)
    return plan_for_shapes(
        cfg,
        model,
        trainer_mesh.devices.flat[0].platform,
        dict(trainer_mesh.shape),
        None if inference_mesh is None else dict(inference_mesh.shape),
        shared,
    )


def plan_for_shapes(
    cfg: ExperimentConfig,
    model: ModelConfig,
    platform: str,
    trainer_shape: dict[str, int],
    inference_shape: dict[str, int] | None,
    shared: bool = False,
) -> MemoryPlan:
    """`plan_memory` for meshes of these shapes on devices of `platform` (devices this machine need not have);
    `shared`: both sides on the same device(s)."""
    if platform == "tpu":  # XLA:TPU's tiles, buffers and code (`tpu_memory.py`), no flat overhead
        from areal_jax.planning import tpu_memory

        state = tpu_memory.abstract_state(model)
        trainer = tuple(tpu_memory.trainer_items(cfg, model, state, trainer_shape))
        inference = (
            None
            if inference_shape is None
            else tuple(tpu_memory.inference_items(cfg.rollout.engine, model, state, inference_shape))
        )
    else:
        trainer = _with_overhead(trainer_items(cfg, model, trainer_shape, platform))
        inference = (
            None
            if inference_shape is None
            else _with_overhead(inference_items(cfg.rollout.engine, model, inference_shape, platform))
        )
    sides = [SidePlan("trainer", math.prod(trainer_shape.values()), trainer_shape, trainer)]
    if inference_shape is not None and inference is not None:
        sides.append(SidePlan("inference", math.prod(inference_shape.values()), inference_shape, inference))
    host = platform == "cpu"
    return MemoryPlan(tuple(sides), host, shared, CPU_RUNTIME_BYTES if host else 0)


def device_capacity(devices: Sequence) -> int | None:
    """Bytes one device may hold: host RAM on CPU, else the device's memory limit (None: it reports none)."""
    device = devices[0]
    if device.platform == "cpu":
        return int(psutil.virtual_memory().total)
    limit = (device.memory_stats() or {}).get("bytes_limit")
    return int(limit) if limit else None


def check_memory(
    cfg: ExperimentConfig, model: ModelConfig, trainer_mesh: Mesh, inference_mesh: Mesh | None
) -> MemoryPlan:
    """Log the run's memory plan and refuse it (`ConfigError` naming keys) when it cannot fit this machine."""
    plan = plan_memory(cfg, model, trainer_mesh, inference_mesh)
    logger.info("memory plan (before anything compiles):\n%s", "\n".join(plan.lines()))
    capacity = device_capacity(list(trainer_mesh.devices.flat))
    if capacity is None:
        logger.warning("the devices report no memory limit: the memory plan is not checked")
    else:
        plan.check(capacity)
    return plan

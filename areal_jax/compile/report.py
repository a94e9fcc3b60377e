"""`areal-jax compile`: a run's programs compiled for Cloud TPU slices, with no weights and no tokenizer, and
what the compiler says about them per chip beside the memory plan and the chip's published peaks: the
trainer's (`trainer_programs.py`) on its share of `--topology`, the engine's (`engine_programs.py`) on the
rollout's share or on `--rollout-topology`. The roofline and its legend: `side.py`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from areal_jax.compile.agreement import agreements
from areal_jax.compile.engine_programs import EngineOnMesh
from areal_jax.compile.programs import compile_program
from areal_jax.compile.side import SideReport
from areal_jax.compile.topology import GIB, Slice, parse_slice, slice_devices, uneven_mesh_axes
from areal_jax.compile.trainer_programs import resident_lines, trainer_programs
from areal_jax.config import ExperimentConfig
from areal_jax.configuration import ConfigError
from areal_jax.planning.architecture import architecture, config_json, on_platform
from areal_jax.planning.memory import USABLE_SHARE, MemoryItem, plan_memory
from areal_jax.sharding import make_mesh, split_devices


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """Both sides' programs: the trainer on `tpu_slice`, the engine on `rollout_slice` (None: it shares
    `tpu_slice`, on its own chips unless the slice has one chip, `shared`)."""

    tpu_slice: Slice
    rollout_slice: Slice | None
    shared: bool
    trainer: SideReport
    inference: SideReport
    shapes: str = "model.*"  # where the policy's shapes come from: `model.*` or a config.json

    @property
    def sides(self) -> tuple[SideReport, SideReport]:
        return self.trainer, self.inference

    def fits(self, side: SideReport) -> bool:
        need = self.trainer.peak + self.inference.peak if self.shared else side.peak
        return need <= side.usable()

    def to_json(self) -> dict[str, Any]:
        rollout = self.rollout_slice or self.tpu_slice
        out: dict[str, Any] = {
            "topology": self.tpu_slice.name,
            "topology_name": self.tpu_slice.topology_name,
            "chip": dataclasses.asdict(self.tpu_slice.chip),
            "rollout_topology": rollout.name,
            "rollout_topology_name": rollout.topology_name,
            "shared_chips": self.shared,
            "shapes": self.shapes,
        }
        for side in self.sides:
            out[side.side] = side.to_json() | {
                "usable_bytes": side.usable(),
                "fits": self.fits(side),
                "plan_agreement": [dataclasses.asdict(a) | {"ratio": a.ratio} for a in agreements(side)],
            }
        return out

    def lines(self) -> list[str]:
        out = [f"shapes: {self.shapes}"]
        for side, where in ((self.trainer, self.tpu_slice), (self.inference, self.rollout_slice or self.tpu_slice)):
            chip = where.chip
            out.append(
                f"{where.name} ({where.topology_name}): {chip.hbm_bytes / GIB:.0f} GiB HBM, "
                f"{chip.bf16_flops / 1e12:.0f} TFLOP/s bf16, {chip.hbm_bytes_per_s / 1e9:.0f} GB/s HBM a chip"
            )
            out += side.lines()
            out += [f"  plan against compiler: {a}" for a in agreements(side)]
            verdict = "fits" if self.fits(side) else "DOES NOT FIT"
            both = " (both sides on the same chip)" if self.shared else ""
            out.append(
                f"  {verdict}: {side.peak / GIB:.2f} GiB a chip{both} of {side.usable() / GIB:.1f} GiB usable "
                f"({USABLE_SHARE:.0%} of {chip.hbm_bytes / GIB:.0f} GiB)"
            )
        return out

    def check(self) -> None:
        """Refuse a run with a side that cannot fit its chips, naming the keys of that side's largest plan lines."""
        for side in self.sides:
            if not self.fits(side):
                flag = "--rollout-topology" if side.side == "inference" and self.rollout_slice else "--topology"
                raise ConfigError(
                    side.plan_keys[0],
                    f"the {side.side} needs {side.peak / GIB:.1f} GiB a chip by the compiler but "
                    f"{side.usable() / GIB:.1f} GiB are usable; change {', '.join(side.plan_keys)} (or a larger "
                    f"{flag})",
                )


def _keys(items: tuple[MemoryItem, ...]) -> tuple[str, ...]:
    largest = sorted(items, key=lambda item: -item.bytes)[:3]
    return tuple(dict.fromkeys(key for item in largest for key in item.keys))


def _refuse_early(side: str, resident: int, tpu_slice: Slice, keys: tuple[str, ...], flag: str) -> None:
    """Refuse before compiling when the resident state alone overflows a chip: no program needs compiling to
    know."""
    usable = int(tpu_slice.chip.hbm_bytes * USABLE_SHARE)
    if resident > usable:
        raise ConfigError(
            keys[0],
            f"the {side} needs {resident / GIB:.1f} GiB a chip by the compiler's shardings for its resident state "
            f"alone but {usable / GIB:.1f} GiB are usable on {tpu_slice.name}; change {', '.join(keys)} (or a "
            f"larger {flag})",
        )


def compile_for_slice(
    cfg: ExperimentConfig, topology: str, rollout_topology: str | None = None, every_bucket: bool = False
) -> CompileReport:
    """Compile the programs of `cfg` for slice `topology` (shared with the rollout side in the run's
    inference:trainer shares, unless `rollout_topology` names the rollout's own slices)."""
    tpu_slice = parse_slice(topology)
    rollout_slice = None if rollout_topology is None else parse_slice(rollout_topology)
    devices = list(slice_devices(tpu_slice.name))
    if rollout_slice is None:
        inference_devices, trainer_devices = split_devices(
            devices, cfg.rollout.inference_share, cfg.rollout.trainer_share
        )
    else:
        inference_devices, trainer_devices = list(slice_devices(rollout_slice.name)), devices
    trainer_mesh = make_mesh(cfg.mesh, trainer_devices)
    inference_mesh = make_mesh(cfg.mesh, inference_devices)
    for which, mesh, chips, key in (
        ("trainer", trainer_mesh, tpu_slice.chips, "rollout.trainer_share"),
        ("rollout", inference_mesh, (rollout_slice or tpu_slice).chips, "rollout.inference_share"),
    ):
        advice = uneven_mesh_axes(which, dict(mesh.shape), chips, key)
        if advice is not None:  # before compiling: libtpu may abort the process on it
            raise ConfigError(key, advice)
    model = on_platform(architecture(cfg), "tpu")
    plan = plan_memory(cfg, model, trainer_mesh, inference_mesh)
    trainer_plan, inference_plan = plan.sides
    specs = trainer_programs(cfg, model, trainer_mesh)
    trainer_resident = resident_lines(cfg, specs)
    _refuse_early("trainer", sum(s for _, s in trainer_resident), tpu_slice, _keys(trainer_plan.items), "--topology")
    engine = EngineOnMesh(cfg, model, inference_mesh)
    engine_resident = engine.resident_lines()
    rollout_flag = "--topology" if rollout_slice is None else "--rollout-topology"
    engine_slice = rollout_slice or tpu_slice
    _refuse_early(
        "inference", sum(s for _, s in engine_resident), engine_slice, _keys(inference_plan.items), rollout_flag
    )

    def side(name: str, where: Slice, mesh: Any, programs: Any, resident: Any, items: Any) -> SideReport:
        lines = tuple((item.name, item.bytes) for item in items)
        return SideReport(
            name, where.chip, mesh.devices.size, dict(mesh.shape), tuple(programs), resident, lines, _keys(items)
        )

    # what a chip holds between programs, now in the layouts the compiler chose (the early refusals above use
    # the arrays' own bytes, a lower bound)
    trainer_compiled = [compile_program(s) for s in specs]
    trainer_resident = resident_lines(cfg, specs, trainer_compiled)
    engine_compiled = engine.compile(every_bucket)
    decode = next(p for p in reversed(engine_compiled) if p.name.startswith("decode"))
    engine_resident = engine.resident_lines(decode)
    trainer = side("trainer", tpu_slice, trainer_mesh, trainer_compiled, trainer_resident, trainer_plan.items)
    inference = side("inference", engine_slice, inference_mesh, engine_compiled, engine_resident, inference_plan.items)
    source = config_json(cfg)
    shapes = "model.*" if source is None else str(source)
    if source is not None and cfg.hf_checkpoint is not None and source.parent != Path(cfg.hf_checkpoint):
        shapes += f" (a copy: {cfg.hf_checkpoint} is not on this machine)"
    return CompileReport(tpu_slice, rollout_slice, plan.shared_devices, trainer, inference, shapes)

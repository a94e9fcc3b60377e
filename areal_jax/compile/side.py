"""One side of a run compiled for a slice (the trainer's programs or the engine's): the compiler's memory per
chip beside the memory plan's lines, and a roofline per program against the chip's published peaks.

FLOPs for the roofline are analytic (`ModelConfig.matmul_flops_per_token`: every layer's matmuls and causal
attention): XLA's cost analysis counts a `while` body once, so a scan over L layers shows about 1/L of the
work; its raw numbers are printed beside. HBM bytes are a lower bound (weights and state read and written, a
decode step's cache; not activations). Collectives come from the compiled HLO, each counted once per run of
its loop; their bytes over one link's one-way ICI bandwidth are the third bound (the roofline is the largest of
the compute, HBM and ICI times, as if each hid the others).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from areal_jax.compile.programs import CompiledProgram
from areal_jax.compile.topology import GIB, Chip
from areal_jax.planning.memory import USABLE_SHARE


@dataclasses.dataclass(frozen=True)
class SideReport:
    """The programs of one side ("trainer" or "inference") on its chips, per chip."""

    side: str
    chip: Chip
    chips: int
    mesh_shape: dict[str, int]
    programs: tuple[CompiledProgram, ...]
    resident_lines: tuple[tuple[str, int], ...]  # held between programs, by the compiler's shardings
    plan_lines: tuple[tuple[str, int], ...]
    plan_keys: tuple[str, ...]  # of the plan's largest lines: what to change when it does not fit

    @property
    def resident(self) -> int:
        return sum(size for _, size in self.resident_lines)

    @property
    def largest(self) -> CompiledProgram:
        return max(self.programs, key=lambda p: p.transient)

    @property
    def peak(self) -> int:
        """The fullest moment of a chip: the resident state plus the largest program's own needs."""
        return self.resident + self.largest.transient

    @property
    def plan_total(self) -> int:
        return sum(size for _, size in self.plan_lines)

    def roofline(self, program: CompiledProgram) -> dict[str, float]:
        flops = program.flops / self.chips
        compute_s = flops / self.chip.bf16_flops
        memory_s = program.hbm_bytes / self.chip.hbm_bytes_per_s
        comm_bytes = sum(c["bytes"] for c in program.collectives.values())
        ici_s = comm_bytes / self.chip.ici_bytes_per_s
        seconds = max(compute_s, memory_s, ici_s)  # each overlapping the others perfectly: a lower bound
        tokens = program.tokens / self.chips
        return {
            "flops_per_chip": flops,
            "hbm_bytes_per_chip": program.hbm_bytes,
            "collective_bytes_per_chip": comm_bytes,
            "compute_s": compute_s,
            "memory_s": memory_s,
            "ici_s": ici_s,
            "roofline_s": seconds,
            "tokens_per_s_per_chip": tokens / seconds if tokens and seconds else 0.0,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "chips": self.chips,
            "mesh": self.mesh_shape,
            "programs": [p.report() | {"transient": p.transient, "roofline": self.roofline(p)} for p in self.programs],
            "resident": [{"line": name, "bytes": size} for name, size in self.resident_lines],
            "resident_bytes": self.resident,
            "peak_bytes": self.peak,
            "plan": [{"line": name, "bytes": size} for name, size in self.plan_lines],
            "plan_total_bytes": self.plan_total,
        }

    def lines(self) -> list[str]:
        shape = " x ".join(f"{axis} {size}" for axis, size in self.mesh_shape.items())
        unit, scale = ("GiB", GIB) if self.peak >= GIB else ("MiB", 2**20)
        out = [
            f"{self.side} on {self.chips} chip(s), mesh {shape}",
            f"  per chip, {unit}:                  compile   args    out  alias   temp   heap   code | TFLOP   "
            "roofline  tokens/s",
        ]
        for p in self.programs:
            r = self.roofline(p)
            sizes = (p.arguments, p.outputs, p.aliased, p.temporaries, p.heap, p.code)
            out.append(
                f"  {p.name:<32} {p.seconds:6.1f}s "
                + " ".join(f"{size / scale:6.2f}" for size in sizes)
                + f" | {r['flops_per_chip'] / 1e12:6.2f} {r['roofline_s'] * 1e3:8.2f} ms "
                f"{r['tokens_per_s_per_chip']:9.0f}"
            )
            out.append(
                f"    XLA cost analysis (a while body once): {p.xla_flops / 1e12:.3f} TFLOP, {p.xla_bytes / 1e9:.2f} GB"
            )
            kinds = ", ".join(
                f"{kind} {c['runs']}x {c['bytes'] / 1e6:.1f} MB" for kind, c in sorted(p.collectives.items())
            )
            out.append(f"    collectives per call, per chip: {kinds or 'none'}")
            if p.kernels:
                out.append(
                    "    Pallas kernels: " + ", ".join(f"{name} ({n} call sites)" for name, n in p.kernels.items())
                )
        resident = " + ".join(f"{name} {size / scale:.2f}" for name, size in self.resident_lines)
        out.append(
            f"  compiler, per chip: resident ({resident}) {self.resident / scale:.2f} {unit} + {self.largest.name} "
            f"{self.largest.transient / scale:.2f} {unit} = {self.peak / scale:.2f} {unit}"
        )
        out.append(f"  memory plan, per {self.side} chip:")
        for name, size in self.plan_lines:
            out.append(f"    {name:<52} {size / scale:8.2f} {unit}")
        out.append(f"    {'total':<52} {self.plan_total / scale:8.2f} {unit} (compiler {self.peak / scale:.2f} {unit})")
        return out

    def usable(self) -> int:
        return int(self.chip.hbm_bytes * USABLE_SHARE)

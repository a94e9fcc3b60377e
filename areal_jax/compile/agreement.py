"""The memory plan held against the compiler, per side and per chip: the plan's lines grouped into what the
compiler reports (the resident state, the largest program's own needs, the chip's total).

`ratio` is min(plan / compiler, compiler / plan): 1 when they agree, 0.8 when one is 25% over the other.
"""

from __future__ import annotations

import dataclasses

from areal_jax.compile.side import SideReport

# plan lines (by the start of their names) that the compiler reports as resident, per side; the plan's other
# lines are what it expects the largest program to need besides
_RESIDENT = {
    "trainer": ("params", "Adam moments"),
    "inference": ("engine weights", "per-layer weight copies", "KV cache", "recurrent states"),
}


@dataclasses.dataclass(frozen=True)
class Agreement:
    """One comparison: the plan's bytes and the compiler's, per chip."""

    side: str
    line: str
    plan: int
    compiler: int

    @property
    def ratio(self) -> float:
        if self.plan == self.compiler:
            return 1.0
        if min(self.plan, self.compiler) <= 0:
            return 0.0
        return min(self.plan / self.compiler, self.compiler / self.plan)

    def __str__(self) -> str:
        return (
            f"{self.line}: plan {self.plan / 2**20:.2f} MiB, compiler {self.compiler / 2**20:.2f} MiB, "
            f"ratio {self.ratio:.2f}"
        )


def agreements(side: SideReport) -> list[Agreement]:
    """The side's resident state, its largest program's needs and its total: plan against compiler."""
    resident_names = _RESIDENT[side.side]
    plan_resident = sum(size for name, size in side.plan_lines if name.startswith(resident_names))
    return [
        Agreement(side.side, "resident state", plan_resident, side.resident),
        Agreement(
            side.side, f"largest program ({side.largest.name})", side.plan_total - plan_resident, side.largest.transient
        ),
        Agreement(side.side, "total", side.plan_total, side.peak),
    ]

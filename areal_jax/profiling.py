"""Profiling a run with the XLA tools: a trace window over chosen trainer steps, and a summary of it.

`ProfileWindow` starts `jax.profiler` before trainer step `start_step` and stops it after `num_steps`
steps. The trace covers the whole process — trainer steps, the generator's decode steps, prefills and
weight copies running alongside — and is written as an XProf trace (`<run>/profile/plugins/profile/...`)
that TensorBoard's profile plugin or `xprof` opens. `summarize_trace` ranks the XLA operations of a
trace by total time without any of those tools (`areal-jax profile-summary <dir>`).

On CPU, XLA emits per-operation events only when the process starts with
`--xla_cpu_enable_xprof_traceme=true` in XLA_FLAGS; `request_cpu_op_events()` adds it and must run
before the first JAX computation (the CLI does this when a profile window is configured).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
from pathlib import Path

import jax

from areal_jax.configuration import Config, option

logger = logging.getLogger(__name__)

CPU_OP_EVENTS_FLAG = "--xla_cpu_enable_xprof_traceme=true"


@dataclasses.dataclass(frozen=True)
class ProfileConfig(Config):
    """Which trainer steps to trace."""

    start_step: int = option(0, ge=0, doc="trace from before this trainer step (1 = the first); 0 = off")
    num_steps: int = option(2, ge=1, doc="trainer steps inside the trace window")
    python_tracer: bool = option(
        False,
        doc="also record every Python call of every thread (host-side overheads in the trace viewer): the trace "
        "grows ~10x and writing it takes tens of seconds; off, the trace holds XLA operations and JAX's own "
        "annotations",
    )


def request_cpu_op_events() -> None:
    """Ask XLA:CPU for per-operation trace events (effective only before the backend starts)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if CPU_OP_EVENTS_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_OP_EVENTS_FLAG}".strip()


class ProfileWindow:
    """Call `before_step(step)` / `after_step(step)` around trainer step `step` (1-based); `close()` stops
    a trace still open when the loop ends early."""

    def __init__(self, config: ProfileConfig, directory: str | os.PathLike[str]):
        self.config = config
        self.directory = Path(directory)
        self.active = False

    @property
    def enabled(self) -> bool:
        return self.config.start_step > 0

    def before_step(self, step: int) -> None:
        if self.enabled and not self.active and step == self.config.start_step:
            self.directory.mkdir(parents=True, exist_ok=True)
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = int(self.config.python_tracer)
            jax.profiler.start_trace(str(self.directory), profiler_options=options)
            self.active = True
            logger.info(
                "profiling trainer steps %d..%d into %s", step, step + self.config.num_steps - 1, self.directory
            )

    def after_step(self, step: int) -> None:
        if self.active and step >= self.config.start_step + self.config.num_steps - 1:
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            logger.info("profile written to %s (summary: areal-jax profile-summary %s)", self.directory, self.directory)


@dataclasses.dataclass(frozen=True)
class OpTime:
    """Total time of one XLA operation (or fusion) across the trace."""

    name: str
    total_ms: float
    count: int
    share: float  # of all XLA operation time in the trace


def _is_op_line(plane_name: str, line_name: str) -> bool:
    if plane_name.startswith("/device:"):  # GPU/TPU: the device's operation line
        return line_name == "XLA Ops"
    return line_name.startswith("tf_XLA")  # CPU: the threads that run XLA's thunks


def newest_trace(directory: str | os.PathLike[str]) -> Path:
    traces = sorted(Path(directory).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"no *.xplane.pb trace under {directory}")
    return traces[-1]


def summarize_trace(directory: str | os.PathLike[str], top: int = 25) -> list[OpTime]:
    """The `top` XLA operations of the newest trace under `directory`, by total time (the executor's own
    bookkeeping events excluded). Names are HLO instruction names, so same-named fusions of different
    programs add up; XProf's trace viewer shows them per program."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(newest_trace(directory)))
    totals: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if not _is_op_line(plane.name, line.name):
                continue
            for event in line.events:
                if event.name.startswith(("ThunkExecutor", "ThreadpoolListener", "end: ")):
                    continue
                totals[event.name] += event.duration_ns
                counts[event.name] += 1
    overall = sum(totals.values()) or 1
    return [
        OpTime(name=name, total_ms=ns / 1e6, count=counts[name], share=ns / overall)
        for name, ns in totals.most_common(top)
    ]


def format_summary(ops: list[OpTime]) -> str:
    lines = [f"{'total ms':>10} {'count':>7} {'share':>6}  operation"]
    lines += [f"{op.total_ms:10.2f} {op.count:7d} {op.share:6.1%}  {op.name}" for op in ops]
    return "\n".join(lines)

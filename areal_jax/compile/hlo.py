"""What a compiled program moves between chips: its collectives by kind, count and bytes, read from the compiled
HLO text, each counted as often as it runs per call of the program: a computation as often as its callers run it,
a `while` body once per trip (XLA's known trip count, else the bound its condition compares the counter with), so
the counts multiply along the nesting (a trainer program's loop over its micro-batches, over the layers, over an
all-to-all dispatch's rounds: runs per call, not per micro-batch).

Legend: a collective's bytes are its result's (per chip): an all-gather's gathered array, an all-reduce's
reduced one, a reduce-scatter's shard. XLA:TPU writes a reduce-scatter as an `all-reduce-scatter` fusion (an
all-reduce whose result each partition slices at once): counted as a reduce-scatter of the slices. A ragged
all-to-all moves what the routing sends, unknown to the compiler, into a buffer sized for the worst case (every
peer's rows to one chip): counted at its result over its group's size, what it moves under balanced routing
(`models/moe.py`'s rounds: one peer's share a call; a one-shot exchange: each of N peers' 1/N of a buffer N
times one chip's rows).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}
_BYTES |= {"s64": 8, "u64": 8, "f64": 8, "c64": 8}
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64)\[([\d,]*)\]")
_CALLS = re.compile(r"\b(body|condition|calls|to_apply|branch_computations)=(\{[%\w.\-, ]+\}|%[\w.\-]+)")
_OP = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_OPCODE = re.compile(r"\s[a-z][\w\-]*\(")
# XLA:TPU's reduce-scatter: a fusion of an all-reduce and each partition's dynamic slice of its result, in a
# computation of this name (`fusion(...), kind=kCustom, calls=%all-reduce-scatter.5`); its bytes are the slices'
_REDUCE_SCATTER_FUSION = "all-reduce-scatter"
# integer scalar constants (a TPU windowed einsum's loop counts in u32) and the bound of a counted loop
_CONSTANT = re.compile(r"^\s*%([\w.\-]+) = [su](?:8|16|32|64)\[\]\S*\s+constant\((\d+)\)")
_COMPARE = re.compile(r"\(%([\w.\-]+), %([\w.\-]+)\).*?direction=(LT|LE|GT|GE)")
_KNOWN_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# a collective's first replica group: listed (`{{0,1,2,3},{4,...}}`) or iota (`[2,4]<=[8]`: groups of 4)
_LISTED_GROUP = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[\d+,(\d+)\]<=")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: its kind, result shapes (dtype, dims), and how many times it runs."""

    kind: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    runs: int
    share: int = 1  # a ragged all-to-all's group size: its result over this is what it moves (module legend)

    @property
    def bytes(self) -> int:
        """Per chip, per run."""
        return sum(_BYTES.get(dtype, 4) * math.prod(dims) for dtype, dims in self.shapes) // self.share


def _group_size(line: str) -> int:
    """The size of a collective instruction's first replica group, 1 when it names none."""
    listed = _LISTED_GROUP.search(line)
    if listed:
        return max(1, len([d for d in listed.group(1).split(",") if d]))
    iota = _IOTA_GROUPS.search(line)
    return int(iota.group(1)) if iota else 1


def _collective(line: str) -> tuple[str, tuple[tuple[str, tuple[int, ...]], ...]] | None:
    """(kind, result shapes) of an instruction line that is a collective (an async one's `-start`; its
    `-done` is not counted), else None."""
    if " = " not in line:
        return None
    result = line.split(" = ", 1)[1]
    match = _OP.search(result)
    if match is None:
        return None
    shapes = [
        (dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(result[: match.start()])
    ]
    if match.group(2):  # an async start's result: (operands..., results..., u32[] contexts of a permute)
        while len(shapes) > 1 and shapes[-1][1] == () and shapes[-1][0] in ("u32", "s32"):
            shapes.pop()
        shapes = shapes[len(shapes) // 2 :]
    return match.group(1), tuple(shapes)


def _trip_count(loop: str, condition: list[str]) -> int:
    """A counted loop's trips (its counter from 0 by 1, as `lax.scan` and `fori_loop` make them): XLA's
    `known_trip_count` of the `while` instruction `loop` when it has one (CPU, GPU), else the constant that the
    condition's root compares the counter with (`i < n`: n; `i <= n`: n + 1), else its largest integer constant."""
    known = _KNOWN_TRIP_COUNT.search(loop)
    if known:
        return int(known.group(1))
    constants = {name: int(value) for line in condition for name, value in _CONSTANT.findall(line)}
    root = next((line for line in condition if line.lstrip().startswith("ROOT ")), "")
    compare = _COMPARE.search(root)
    if compare:
        left, right, direction = compare.groups()
        if right in constants and direction in ("LT", "LE"):
            return constants[right] + (direction == "LE")
        if left in constants and direction in ("GT", "GE"):
            return constants[left] + (direction == "GE")
    return max(constants.values(), default=1)


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled module's HLO text, with the times it runs per call of the module."""
    bodies: dict[str, list[str]] = {}
    entry = None
    current: list[str] | None = None
    for line in hlo_text.splitlines():
        match = _COMPUTATION.match(line)
        if match:
            current = bodies.setdefault(match.group(1), [])
            if line.startswith("ENTRY"):
                entry = match.group(1)
        elif current is not None:
            current.append(line)
    # how often each computation runs: its callers' counts, a while body's times the loop's trip count
    # each call site once: (callee, times it runs per run of the caller)
    edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, lines in bodies.items():
        for line in lines:
            calls = _CALLS.findall(line)
            condition = next((c.strip(" {}%") for role, c in calls if role == "condition"), None)
            trips = _trip_count(line, bodies.get(condition, [])) if condition is not None else 1
            for role, callees in calls:
                for callee in (c.strip(" {}%") for c in callees.split(",")):
                    edges[name].append((callee, trips if role == "body" else 1))
    runs: dict[str, int] = defaultdict(int)

    def visit(name: str, times: int, depth: int = 0) -> None:
        if depth > 64:
            return
        runs[name] += times
        for callee, factor in edges.get(name, ()):
            visit(callee, times * factor, depth + 1)

    if entry is not None:
        visit(entry, 1)
    found = []
    for name, lines in bodies.items():
        for line in lines:
            collective = _collective(line)
            if collective is not None and runs.get(name, 0):
                kind, shapes = collective
                if name.startswith(_REDUCE_SCATTER_FUSION) and kind == "all-reduce":
                    kind, shapes = "reduce-scatter", _root_shapes(lines) or shapes
                share = _group_size(line) if kind == "ragged-all-to-all" else 1
                found.append(Collective(kind, shapes, runs[name], share))
    return found


def _root_shapes(lines: list[str]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The result shapes of a computation's ROOT instruction."""
    root = next((line for line in lines if line.lstrip().startswith("ROOT ")), "")
    result = root.split(" = ", 1)[1] if " = " in root else ""
    op = _OPCODE.search(result)
    return tuple(
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(result[: op.start() if op else len(result)])
    )


def summarize(found: list[Collective]) -> dict[str, dict[str, int]]:
    """Per kind: instructions, runs per call and bytes per chip per call."""
    out: dict[str, dict[str, int]] = {}
    for c in found:
        entry = out.setdefault(c.kind, {"instructions": 0, "runs": 0, "bytes": 0})
        entry["instructions"] += 1
        entry["runs"] += c.runs
        entry["bytes"] += c.runs * c.bytes
    return out


_KERNEL = re.compile(r"^\s*(?:ROOT\s+)?%([A-Za-z_][\w\-]*?)(?:\.\d+)*\s+=.*custom_call_target=\"tpu_custom_call\"")


def kernels(hlo_text: str) -> dict[str, int]:
    """The Pallas (Mosaic) kernels a compiled TPU module calls, by name (the instruction's), with their call
    sites' count (a kernel in a loop body counted once)."""
    found: dict[str, int] = defaultdict(int)
    for line in hlo_text.splitlines():
        match = _KERNEL.match(line)
        if match:
            found[match.group(1)] += 1
    return dict(sorted(found.items()))

"""A compiled program and what it says about itself: the compiler's memory, cost and collectives."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax

from areal_jax.compile.hlo import collectives, kernels, summarize


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    """A program to compile: a jitted function, its (abstract, sharded) arguments, and which of them stay
    resident between calls (params, optimizer state: counted once per chip, not per program)."""

    name: str
    jitted: Any
    args: tuple[Any, ...]
    resident: tuple[int, ...]  # indices of `args` held between calls
    tokens: int  # tokens the program processes per call (all chips), 0 when it processes none
    flops: float  # analytic FLOPs per call, all chips (the model's matmuls and attention)
    hbm_bytes: float  # analytic HBM traffic per call per chip (weights, state; a lower bound)
    static: tuple[int, ...] = ()  # indices of `args` that are the jit's static arguments
    lower_context: Callable[[], Any] = dataclasses.field(default=lambda: _nothing())


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def padded_bytes(shape: tuple[int, ...], itemsize: int, major_to_minor: tuple[int, ...], tiling: Any) -> int:
    """Bytes of an array of `shape` in a device layout: its first tile pads the most minor dims to its sizes
    (TPU: `T(8,128)` rounds the minor dim up to 128 and the next to 8), a sub-tile packs narrow dtypes."""
    dims = list(shape)
    if tiling:
        tile = tiling[0]
        for dim, size in zip(reversed(major_to_minor), reversed(tile), strict=False):
            dims[dim] = -(-dims[dim] // size) * size
    return math.prod(dims) * itemsize


def per_chip_bytes(tree: Any) -> int:
    """Bytes one chip holds of an abstract sharded pytree (each leaf's shard), the fullest chip's."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if leaf is None or not hasattr(leaf, "shape"):
            continue
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """The compiler's account of one program, per chip."""

    name: str
    seconds: float
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    code: int
    heap: int  # XLA's peak heap: arguments, outputs and temporaries live at once (0: not reported)
    resident: int  # of `arguments`, the resident state in the compiler's layouts (counted once in the chip's total)
    xla_flops: float  # XLA's cost analysis (a `while` body counted once)
    xla_bytes: float
    flops: float  # analytic, all chips
    hbm_bytes: float  # analytic, per chip
    tokens: int
    collectives: dict[str, dict[str, int]]
    kernels: dict[str, int]  # Pallas kernels by name: call sites
    # the layouts the compiler chose for the arguments (`Format`s, arg for arg; None for a static one)
    formats: tuple[Any, ...] = dataclasses.field(default=(), repr=False, compare=False)

    def report(self) -> dict[str, Any]:
        """The JSON-friendly fields (all but the layouts)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "formats"}

    def laid_out(self, arg: int, tree: Any) -> int:
        """Bytes a chip holds of `tree` (argument `arg`, or a part of it of the same tree structure as the
        matching part of its formats) in the compiler's layouts."""
        return laid_out_bytes(tree, self.formats[arg])

    @property
    def transient(self) -> int:
        """What the program needs beside the resident state while it runs, with its code: XLA's peak heap (its
        arguments, outputs and temporaries as they are live at once) less the resident state. XLA:TPU's own
        out-of-memory check counts that heap: it compiled a program whose heap fit v5e's 15.75 GiB though its
        arguments + outputs + `temp_size_in_bytes` came to 17.5 GiB, and refused one whose heap did not
        (docs/tpu.md). `temp_size_in_bytes` is not the heap's rest: it counts the outputs again (a dense gradient
        program: preallocated temporaries + the live-out outputs) and, around a Gated DeltaNet layer's scan, more
        than the buffer assignment holds. Without a reported heap: arguments + temporaries + outputs - aliased."""
        if self.heap:
            return self.heap - self.resident + self.code
        return self.arguments - self.resident + self.temporaries + self.outputs - self.aliased + self.code


def compile_program(spec: ProgramSpec) -> CompiledProgram:
    return compile_with_outputs(spec)[0]


def compile_with_outputs(spec: ProgramSpec) -> tuple[CompiledProgram, Any]:
    """The compiler's account of `spec`, and its outputs as abstract arrays with the shardings the compiler
    gave them (what a program receiving them is lowered with)."""
    started = time.perf_counter()
    with spec.lower_context():
        lowered = spec.jitted.lower(*spec.args)
        compiled = lowered.compile()
    seconds = time.perf_counter() - started
    outputs = jax.tree.map(
        lambda info, sharding: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding),
        lowered.out_info,
        compiled.output_shardings,
    )
    memory = compiled.memory_analysis()
    dynamic = iter(compiled.input_formats[0])
    formats = [None if i in spec.static else next(dynamic) for i in range(len(spec.args))]
    text = compiled.as_text()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older JAX: one dict per computation
        cost = cost[0] if cost else {}
    resident = sum(laid_out_bytes(spec.args[i], formats[i]) for i in spec.resident)
    program = CompiledProgram(
        name=spec.name,
        seconds=seconds,
        arguments=int(memory.argument_size_in_bytes),
        outputs=int(memory.output_size_in_bytes),
        aliased=int(memory.alias_size_in_bytes),
        temporaries=int(memory.temp_size_in_bytes),
        code=int(memory.generated_code_size_in_bytes),
        heap=int(getattr(memory, "peak_memory_in_bytes", 0) or 0),
        resident=resident,
        xla_flops=float(cost.get("flops", 0.0)),
        xla_bytes=float(cost.get("bytes accessed", 0.0)),
        flops=spec.flops,
        hbm_bytes=spec.hbm_bytes,
        tokens=spec.tokens,
        collectives=summarize(collectives(text)),
        kernels=kernels(text),
        formats=tuple(formats),
    )
    return program, outputs


def laid_out_bytes(tree: Any, formats: Any) -> int:
    """Bytes one chip holds of the abstract pytree `tree` in the layouts the compiler chose for it (`formats`:
    its `Format`s, tree for tree): each shard padded to its layout's tiles, what `memory_analysis` counts."""
    leaves = [leaf for leaf in jax.tree.leaves(tree) if hasattr(leaf, "shape")]
    laid = jax.tree.leaves(formats, is_leaf=lambda x: hasattr(x, "layout") and hasattr(x, "sharding"))
    total = 0
    for leaf, fmt in zip(leaves, laid, strict=True):
        sharding = fmt.sharding or getattr(leaf, "sharding", None)
        shape = leaf.shape if sharding is None else sharding.shard_shape(leaf.shape)
        layout = fmt.layout
        if layout is None:
            total += math.prod(shape) * leaf.dtype.itemsize
        else:
            total += padded_bytes(shape, leaf.dtype.itemsize, tuple(layout.major_to_minor), layout.tiling)
    return total

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
    lower_context: Callable[[], Any] = dataclasses.field(default=lambda: _nothing())


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


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
    resident: int  # of `arguments`, the resident state (counted once in the chip's total)
    xla_flops: float  # XLA's cost analysis (a `while` body counted once)
    xla_bytes: float
    flops: float  # analytic, all chips
    hbm_bytes: float  # analytic, per chip
    tokens: int
    collectives: dict[str, dict[str, int]]
    kernels: dict[str, int]  # Pallas kernels by name: call sites

    @property
    def transient(self) -> int:
        """What the program needs beside the resident state while it runs: its other arguments, temporaries,
        the outputs that do not reuse an argument's buffer, and its code."""
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
    text = compiled.as_text()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older JAX: one dict per computation
        cost = cost[0] if cost else {}
    resident = sum(per_chip_bytes(spec.args[i]) for i in spec.resident)
    program = CompiledProgram(
        name=spec.name,
        seconds=seconds,
        arguments=int(memory.argument_size_in_bytes),
        outputs=int(memory.output_size_in_bytes),
        aliased=int(memory.alias_size_in_bytes),
        temporaries=int(memory.temp_size_in_bytes),
        code=int(memory.generated_code_size_in_bytes),
        resident=resident,
        xla_flops=float(cost.get("flops", 0.0)),
        xla_bytes=float(cost.get("bytes accessed", 0.0)),
        flops=spec.flops,
        hbm_bytes=spec.hbm_bytes,
        tokens=spec.tokens,
        collectives=summarize(collectives(text)),
        kernels=kernels(text),
    )
    return program, outputs

"""Activations pinned to mesh axes by logical name, and the platform a program is built for.

Without a constraint, XLA's sharding propagation follows the weights: a `[B, T, D] x [D (fsdp), F]` matmul
whose batch is split over `fsdp` too gets one of the two splits, and at real sizes it kept the weight's, so
every chip ran the whole batch over its slice of D and all-reduced whole-batch activations (tensor
parallelism over the contracted axis). Pinning the activations to the batch axis (data x fsdp), as MaxText
does, makes the program FSDP: each layer's weights are all-gathered, its gradients reduce-scattered, and
the activations never leave their chips.

A program opts in by tracing under `activations_on(mesh)`; outside it `constrain` is a no-op (the engine's
programs and single-device code trace as before). The engine's programs trace under `jax.set_mesh` of their mesh
instead (`on_mesh`): its kernels (paged attention, grouped matmuls) then run per shard, as on a TPU slice XLA cannot
partition a Pallas kernel.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from areal_jax.sharding import logical_to_spec

# The leading axes of the row paths' activations [B, T, ...]: rows split over data x fsdp whenever a program
# traces under `activations_on` (the trainer's), so its weights are gathered per layer, never its activations.
ROW_AXES = ("batch", "length")

_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("activation_mesh", default=None)


@contextlib.contextmanager
def activations_on(mesh: Mesh) -> Iterator[None]:
    """Trace the enclosed code with its activations pinned to `mesh` by `constrain`."""
    token = _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(token)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """`x` constrained to the mesh axes of its logical axis `names` (an axis that does not divide its dimension
    is left out), under `activations_on`; else `x` unchanged."""
    mesh = _MESH.get()
    if mesh is None:
        return x
    spec = logical_to_spec(names, x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def unsplit_axis(x: jax.Array, axis: int) -> jax.Array:
    """`x` with dimension `axis` kept whole on every device of the program's mesh (`program_mesh`), its other
    dimensions left to sharding propagation; `x` unchanged without a mesh. For the axis a `lax.scan` walks:
    split, every step's slice of it is an all-gather of the whole array."""
    mesh = program_mesh()
    if mesh is None or mesh.size == 1:
        return x
    spec: list[Any] = [PartitionSpec.UNCONSTRAINED] * x.ndim
    spec[axis] = None
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


def put_rows_locally(
    target: jax.Array, rows_B: jax.Array, values: jax.Array, names: Sequence[str | None], at: tuple[slice, ...] = ()
) -> jax.Array:
    """`target.at[rows_B, *at].set(values, mode="drop")` (rows along the first axis; out-of-range rows dropped),
    each device writing only into its own rows of `target`, which is split along logical axes `names` under the
    program's mesh (`program_mesh`). Left to the partitioner, a scatter at traced rows into an array split along
    them all-gathers the whole array on every device (XLA:TPU: an insert into R1-Distill-1.5B's slot-split KV
    cache moved 92 GB a call over 4 v6e chips, docs/tpu.md); here only `values` travel, whole to every device."""
    mesh = program_mesh()
    spec = None if mesh is None or mesh.size == 1 else logical_to_spec(names, target.shape, mesh)
    if mesh is None or spec is None or not spec or spec[0] is None:
        return target.at[(rows_B, *at)].set(values, mode="drop")
    row_axes = (spec[0],) if isinstance(spec[0], str) else tuple(spec[0])
    sizes = [mesh.shape[axis] for axis in row_axes]
    values_spec = PartitionSpec(None, *spec[1:])
    rows_spec = PartitionSpec()

    def local(target_local: jax.Array, rows: jax.Array, values_local: jax.Array) -> jax.Array:
        index = jnp.zeros((), jnp.int32)
        for axis, size in zip(row_axes, sizes, strict=True):
            index = index * size + jax.lax.axis_index(axis)
        held = target_local.shape[0]
        mine = rows - index * held
        mine = jnp.where((mine >= 0) & (mine < held), mine, held)  # another device's row: past the end, dropped
        return target_local.at[(mine, *at)].set(values_local, mode="drop")

    return jax.shard_map(local, mesh=mesh, in_specs=(spec, rows_spec, values_spec), out_specs=spec, check_vma=False)(
        target, rows_B, values
    )


def program_mesh() -> Mesh | AbstractMesh | None:
    """The mesh a program is being built for: that of `activations_on`, else that of `jax.set_mesh` (read as the
    abstract mesh, which also answers inside `jit`), else None."""
    mesh = _MESH.get()
    if mesh is not None:
        return mesh
    abstract = jax.sharding.get_abstract_mesh()
    return None if abstract.empty else abstract


def mesh_platform() -> str:
    """The platform of the devices a program is being built for (`program_mesh`), else JAX's default backend.
    An ahead-of-time compile for a TPU topology runs on a CPU machine, so `jax.default_backend()` alone would
    pick the CPU's kernels."""
    mesh = program_mesh()
    if isinstance(mesh, Mesh):
        return str(mesh.devices.flat[0].platform)
    if mesh is not None and mesh.abstract_device is not None:
        return str(mesh.abstract_device.platform)
    return jax.default_backend()


class MeshProgram:
    """A jitted function lowered and called under `jax.set_mesh(mesh)`, so what it traces sees the mesh it runs
    on (`program_mesh`, `mesh_platform`): on a TPU slice the Pallas kernels it picks run per shard under
    `shard_map`, as `areal-jax compile` lowers them. Other attributes are the jitted function's."""

    def __init__(self, jitted: Any, mesh: Mesh):
        self.jitted = jitted
        self.mesh = mesh

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._mesh_set():
            return self.jitted(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        with self._mesh_set():
            return _LoweredOnMesh(self.jitted.lower(*args, **kwargs), self)

    def _mesh_set(self) -> contextlib.AbstractContextManager[Any]:
        """`jax.set_mesh(mesh)`, unless this mesh is set already (a caller's `jax.eval_shape` under it: `set_mesh`
        cannot be entered while tracing). Another mesh in the caller's context is replaced for the call."""
        if jax.sharding.get_abstract_mesh() == self.mesh.abstract_mesh:
            return contextlib.nullcontext()
        return jax.set_mesh(self.mesh)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.jitted, name)


class _LoweredOnMesh:
    """A `MeshProgram`'s lowering, compiled under its mesh too (the compiler resolves shardings against it)."""

    def __init__(self, lowered: Any, program: MeshProgram):
        self.lowered = lowered
        self.program = program

    def compile(self, *args: Any, **kwargs: Any) -> Any:
        with self.program._mesh_set():
            return self.lowered.compile(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lowered, name)


def on_mesh(jitted: Callable[..., Any], mesh: Mesh | None) -> Any:
    """`jitted` traced under `mesh` (`MeshProgram`); itself without a mesh (one device)."""
    return jitted if mesh is None else MeshProgram(jitted, mesh)

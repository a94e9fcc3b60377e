"""Activations pinned to mesh axes by logical name, and the platform a program is built for.

Without a constraint, XLA's sharding propagation follows the weights: a `[B, T, D] x [D (fsdp), F]` matmul
whose batch is split over `fsdp` too gets one of the two splits, and at real sizes it kept the weight's, so
every chip ran the whole batch over its slice of D and all-reduced whole-batch activations (tensor
parallelism over the contracted axis). Pinning the activations to the batch axis (data x fsdp), as MaxText
does, makes the program FSDP: each layer's weights are all-gathered, its gradients reduce-scattered, and
the activations never leave their chips.

A program opts in by tracing under `activations_on(mesh)`; outside it `constrain` is a no-op (the engine's
programs and single-device code trace as before).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding

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

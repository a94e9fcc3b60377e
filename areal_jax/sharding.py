"""Device meshes and the one table that maps logical array axes to mesh axes."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from areal_jax.configuration import Config, ConfigError, option

logger = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis name -> mesh axes it is split over (None = replicated). Parameters are FSDP-sharded
# on their model dimension and tensor-parallel on heads / MLP / vocab; activations on batch. The slot axes
# of the fused kernels (`qkv`: a head group's queries, key, value; `gate_up`) are never split.
LOGICAL_RULES: Mapping[str, tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "length": None,
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "mlp": ("tensor",),
    # a mixture's experts: expert parallelism over the FSDP devices (each holds E / fsdp whole experts)
    "expert": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": None,
    "qkv": None,
    "gate_up": None,
    "layers": None,
    "norm": None,
    "lora_rank": None,
    "slots": ("data", "fsdp"),
}


@dataclasses.dataclass(frozen=True)
class MeshConfig(Config):
    """Sizes of the three mesh axes; exactly one may be -1, meaning 'all remaining devices'."""

    data: int = option(1, ge=-1, doc="data-parallel replicas (-1 = the rest)")
    fsdp: int = option(-1, ge=-1, doc="fully-sharded data parallelism (-1 = the rest)")
    tensor: int = option(1, ge=-1, doc="tensor parallelism over heads / MLP / vocab (-1 = the rest)")

    def validate(self) -> None:
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for key, size in sizes.items():
            if size == 0:
                raise ConfigError(key, "value 0 is not allowed; use a positive size or -1 for the rest")
        if sum(size == -1 for size in sizes.values()) > 1:
            raise ConfigError("data", f"at most one of data/fsdp/tensor may be -1, got {sizes}")

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        """Concrete (data, fsdp, tensor) sizes for `num_devices` devices."""
        sizes = [self.data, self.fsdp, self.tensor]
        fixed = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % fixed:
                raise ConfigError(
                    "mesh", f"{num_devices} devices cannot be split with fixed axis sizes of product {fixed}"
                )
            sizes = [num_devices // fixed if s == -1 else s for s in sizes]
        if math.prod(sizes) != num_devices:
            raise ConfigError("mesh", f"data*fsdp*tensor = {math.prod(sizes)} but {num_devices} devices are available")
        return sizes[0], sizes[1], sizes[2]


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh with classic auto sharding over `devices` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = config.resolve(len(devices))
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if len(devices) == jax.device_count():
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES, axis_types=axis_types)


def split_devices(
    devices: Sequence[jax.Device], inference_share: int, trainer_share: int
) -> tuple[list[jax.Device], list[jax.Device]]:
    """Split devices into (inference, trainer) lists in the ratio inference_share:trainer_share.

    Each side gets at least one device; with a single device both sides share it.
    """
    if inference_share < 1 or trainer_share < 1:
        raise ConfigError("device_ratio", f"shares must be >= 1, got {inference_share}:{trainer_share}")
    devices = list(devices)
    if len(devices) == 1:
        return devices, devices
    n_inference = round(len(devices) * inference_share / (inference_share + trainer_share))
    n_inference = min(max(n_inference, 1), len(devices) - 1)
    return devices[:n_inference], devices[n_inference:]


def logical_to_spec(
    names: Sequence[str | None],
    shape: Sequence[int] | None = None,
    mesh: Mesh | AbstractMesh | None = None,
    rules: Mapping[str, tuple[str, ...] | None] = LOGICAL_RULES,
) -> PartitionSpec:
    """PartitionSpec for an array whose axes carry logical `names`.

    With `shape` and `mesh`, a mesh axis that does not divide its dimension (e.g. 2 KV heads over a
    tensor axis of 4) is dropped for that array, which is then replicated along it. No mesh axis is used
    twice in one spec.
    """
    used: set[str] = set()
    spec: list[Any] = []
    for dim, name in enumerate(names):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
        axes = [a for a in (rules[name] or ()) if a not in used]
        if mesh is not None:
            axes = [a for a in axes if a in mesh.shape]
        if shape is not None and mesh is not None:
            kept: list[str] = []
            for axis in axes:
                if shape[dim] % (math.prod(mesh.shape[a] for a in kept) * mesh.shape[axis]) == 0:
                    kept.append(axis)
            if kept != axes:
                logger.debug("axis %s (size %d): mesh axes %s dropped, not divisible", name, shape[dim], axes)
            axes = kept
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*spec)


def state_shardings(state: nnx.State, mesh: Mesh | AbstractMesh) -> Any:
    """NamedShardings for every variable of an NNX state (abstract or concrete), from its logical names."""

    def one(variable: Any) -> Any:
        if not isinstance(variable, nnx.Variable):
            return NamedSharding(mesh, PartitionSpec())
        names = variable.get_metadata().get("out_sharding") or (None,) * len(variable.get_value().shape)
        spec = logical_to_spec(names, variable.get_value().shape, mesh)
        return variable.replace(NamedSharding(mesh, spec))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def data_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, ...] host batch: rows over data+fsdp, the rest replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), mesh=mesh))


def copy_to(tree: Any, shardings: Any) -> Any:
    """A private copy of `tree` placed on `shardings` (device to device, no host round trip).

    The result never shares a buffer with `tree`, so the source may be donated right away: where the
    source and target device sets overlap, `device_put` can hand back the source's own buffers (even with
    `may_alias=False` for a replicated target), so the arrays are copied by a jitted program, built once
    per (tree structure, shardings) and reused by every later publish of the same layout.
    """
    leaves, treedef = jax.tree.flatten(tree)
    target = tuple(jax.tree.leaves(shardings))
    source = tuple(leaf.sharding for leaf in leaves)
    source_devices = {d for s in source for d in s.device_set}
    target_devices = {d for s in target for d in s.device_set}
    if not source_devices & target_devices:
        return jax.device_put(tree, shardings)
    if source_devices == target_devices:
        return jax.tree.unflatten(treedef, _copy_program(target)(leaves))
    return jax.device_put(jax.tree.unflatten(treedef, _copy_program(source)(leaves)), shardings)


@functools.lru_cache(maxsize=16)
def _copy_program(out_shardings: tuple[jax.sharding.Sharding, ...]) -> Callable[[list[jax.Array]], list[jax.Array]]:
    """A jitted copy of a list of arrays onto `out_shardings` (one per array, same devices as the input)."""
    return jax.jit(lambda leaves: [jnp.copy(leaf) for leaf in leaves], out_shardings=list(out_shardings))

"""A published pytree cut into single-device pieces, and put back together on a reader's shardings.

JAX's transfer server pulls an array shard by shard into a destination with the same number and sizes of
shards, so it cannot reshard. The direct weight path therefore serves every leaf as its distinct shards
(one per index: replicas are sent once), each a single-device array that the reader may land on any of its
devices. The reader either pulls each piece straight onto the devices that hold that index in its own
layout (same cut, e.g. trainer and rollout meshes of one shape), or, when the cuts differ, pulls the pieces
of a leaf onto one device, joins them and places the whole leaf on its sharding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding

Index = tuple[tuple[int, int], ...]  # [start, stop) per dimension


def normalized_index(index: tuple[slice, ...], shape: Sequence[int]) -> Index:
    """A shard's tuple of slices as explicit [start, stop) bounds."""
    bounds = []
    for dim, part in zip(shape, index, strict=True):
        start, stop, step = part.indices(dim)
        if step != 1:
            raise ValueError(f"shard index {index} of shape {tuple(shape)} has a step; only contiguous shards")
        bounds.append((start, stop))
    return tuple(bounds)


def piece_shape(index: Index) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in index)


def distinct_shards(leaf: jax.Array) -> list[tuple[Index, jax.Array]]:
    """One single-device array per distinct index of `leaf` (a replica's buffer, not a copy)."""
    if not leaf.is_fully_addressable:
        raise ValueError(
            "the direct weight path serves arrays held by one process; this one spans several "
            "(a trainer over several processes publishes through the Orbax store only)"
        )
    found: dict[Index, jax.Array] = {}
    for shard in leaf.addressable_shards:
        found.setdefault(normalized_index(shard.index, leaf.shape), shard.data)
    return sorted(found.items())


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """What a reader needs to pull one leaf: its global shape, dtype, and the indices of its pieces."""

    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Index, ...]

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "pieces": [[list(b) for b in p] for p in self.pieces]}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> LeafSpec:
        pieces = tuple(tuple((int(a), int(b)) for a, b in piece) for piece in value["pieces"])
        return cls(tuple(int(d) for d in value["shape"]), str(value["dtype"]), pieces)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """Where each piece of one leaf lands on the reader, and how the leaf is rebuilt from them."""

    spec: LeafSpec
    target: Sharding
    devices: tuple[jax.Device, ...]  # the device each piece is pulled onto, in `spec.pieces` order
    direct: bool  # the pieces are the target's own shards: no join, no reshard

    def pull_specs(self) -> list[jax.ShapeDtypeStruct]:
        dtype = jnp.dtype(self.spec.dtype)
        return [
            jax.ShapeDtypeStruct(piece_shape(index), dtype, sharding=SingleDeviceSharding(device))
            for index, device in zip(self.spec.pieces, self.devices, strict=True)
        ]

    def build(self, pulled: Sequence[jax.Array]) -> jax.Array:
        """The leaf on `target` from its pulled pieces (in `spec.pieces` order)."""
        by_index = dict(zip(self.spec.pieces, pulled, strict=True))
        if self.direct:
            indices = self.target.addressable_devices_indices_map(self.spec.shape)
            arrays = [
                _on(by_index[normalized_index(index, self.spec.shape)], device) for device, index in indices.items()
            ]
            return jax.make_array_from_single_device_arrays(self.spec.shape, self.target, arrays)
        return jax.device_put(_join(by_index, self.spec.shape), self.target)


def plan_leaf(spec: LeafSpec, target: Sharding, spread: int = 0) -> LeafPlan:
    """Pull each piece onto a target device holding exactly its index when the cuts agree; otherwise all
    pieces onto one target device (the `spread`-th, so that the leaves being joined spread over devices)."""
    holders: dict[Index, jax.Device] = {}
    for device, index in target.addressable_devices_indices_map(spec.shape).items():
        holders.setdefault(normalized_index(index, spec.shape), device)
    if set(holders) == set(spec.pieces):
        return LeafPlan(spec, target, tuple(holders[index] for index in spec.pieces), direct=True)
    devices = sorted(target.addressable_devices, key=lambda d: d.id)
    home = devices[spread % len(devices)]
    return LeafPlan(spec, target, (home,) * len(spec.pieces), direct=False)


def _on(array: jax.Array, device: jax.Device) -> jax.Array:
    return array if array.devices() == {device} else jax.device_put(array, device)


def _join(pieces: dict[Index, jax.Array], shape: tuple[int, ...]) -> jax.Array:
    """The whole array from pieces that tile it as a grid (what a sharding's shards do)."""
    covered = sum(int(np.prod(piece_shape(index))) for index in pieces)
    if covered != int(np.prod(shape)):
        raise ValueError(f"pieces {sorted(pieces)} do not tile shape {shape}")
    return _join_from(dict(pieces), dim=0)


def _join_from(pieces: dict[Index, jax.Array], dim: int) -> jax.Array:
    if len(pieces) == 1:
        return next(iter(pieces.values()))
    starts = sorted({index[dim][0] for index in pieces})
    if len(starts) == 1:
        return _join_from(pieces, dim + 1)
    slabs = [_join_from({i: a for i, a in pieces.items() if i[dim][0] == start}, dim + 1) for start in starts]
    return jnp.concatenate(slabs, axis=dim)

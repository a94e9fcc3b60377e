"""A published pytree cut into single-device pieces, and put back together on a reader's shardings.

JAX's transfer server pulls an array shard by shard into a destination with the same number and sizes of
shards, so it cannot reshard. The direct weight path therefore serves every leaf as its distinct shards
(one per index: replicas are sent once; with several trainer processes, by the lowest process holding the
index), each a single-device array that the reader may land on any of its devices. The reader pulls each
piece onto the device of its own layout that it overlaps most, then cuts every target shard from the
pieces it overlaps (on the piece's device, so only the needed bytes move) and joins the parts on the
shard's device. Where both layouts cut a leaf alike (e.g. trainer and rollout
meshes of one shape) the pieces are the target's shards: nothing is cut, joined or moved after the pull.
No device ever holds a whole leaf that its layout shards.
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


def offered_pieces(leaf: jax.Array) -> tuple[LeafSpec, list[tuple[int, jax.Array]]]:
    """The leaf's spec (its distinct indices over every process, sorted) and the pieces this process
    offers, as (number in `spec.pieces`, a local replica's buffer, not a copy): each distinct index is
    offered by the lowest process holding it, so every piece is offered once over all processes."""
    owners: dict[Index, int] = {}
    for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
        bounds = normalized_index(index, leaf.shape)
        holder = device.process_index  # type: ignore[attr-defined]  # jaxlib ships no stubs for Device
        owners[bounds] = min(owners.get(bounds, holder), holder)
    spec = LeafSpec(tuple(leaf.shape), str(leaf.dtype), tuple(sorted(owners)))
    local: dict[Index, jax.Array] = {}
    for shard in leaf.addressable_shards:
        local.setdefault(normalized_index(shard.index, leaf.shape), shard.data)
    process = jax.process_index()
    return spec, [(number, local[index]) for number, index in enumerate(spec.pieces) if owners[index] == process]


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
    """Where each piece of one leaf lands on the reader, and how the target's shards are cut from them."""

    spec: LeafSpec
    target: Sharding
    devices: tuple[jax.Device, ...]  # the device each piece is pulled onto, in `spec.pieces` order
    direct: bool  # the pieces are the target's own shards: nothing to cut or join

    def pull_specs(self) -> list[jax.ShapeDtypeStruct]:
        dtype = jnp.dtype(self.spec.dtype)
        return [
            jax.ShapeDtypeStruct(piece_shape(index), dtype, sharding=SingleDeviceSharding(device))
            for index, device in zip(self.spec.pieces, self.devices, strict=True)
        ]

    def build(self, pulled: Sequence[jax.Array]) -> jax.Array:
        """The leaf on `target` from its pulled pieces (in `spec.pieces` order): each distinct target shard
        is cut from the pieces it overlaps, on the first device holding it, and copied to its replicas."""
        placed = dict(zip(self.spec.pieces, pulled, strict=True))
        blocks: dict[Index, jax.Array] = {}
        arrays = []
        for device, index in _target_indices(self.target, self.spec.shape).items():
            if index not in blocks:
                blocks[index] = _block(index, placed, device)
            arrays.append(_on(blocks[index], device))
        return jax.make_array_from_single_device_arrays(self.spec.shape, self.target, arrays)


def plan_leaf(spec: LeafSpec, target: Sharding) -> LeafPlan:
    """Pull each piece onto the target device it overlaps most (the first such; a device already chosen
    for fewer pieces on ties), so that most bytes land where they stay."""
    indices = _target_indices(target, spec.shape)
    chosen: dict[jax.Device, int] = dict.fromkeys(indices, 0)
    devices = []
    for piece in spec.pieces:
        best = max(indices, key=lambda d: (_volume(_overlap(piece, indices[d])), -chosen[d]))
        chosen[best] += 1
        devices.append(best)
    direct = set(indices.values()) == set(spec.pieces)
    return LeafPlan(spec, target, tuple(devices), direct)


def _target_indices(target: Sharding, shape: tuple[int, ...]) -> dict[jax.Device, Index]:
    indices = target.addressable_devices_indices_map(shape)
    # jax annotates the values `Index | None`, but they are those of `devices_indices_map`, never None
    return {d: normalized_index(i, shape) for d, i in indices.items()}  # type: ignore[arg-type]


def _overlap(a: Index, b: Index) -> Index | None:
    bounds = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return None if any(start >= stop for start, stop in bounds) else bounds


def _volume(index: Index | None) -> int:
    return -1 if index is None else int(np.prod(piece_shape(index)))


def _block(want: Index, placed: dict[Index, jax.Array], device: jax.Device) -> jax.Array:
    """The part `want` of the leaf on `device`, from the pieces that overlap it."""
    parts = {}
    for have, array in placed.items():
        part = _overlap(want, have)
        if part is None:
            continue
        if part != have:  # only the overlap, cut where the piece is, before it travels
            array = array[tuple(slice(a - h, b - h) for (a, b), (h, _) in zip(part, have, strict=True))]
        parts[part] = _on(array, device)
    return _join(parts, piece_shape(want))


def _on(array: jax.Array, device: jax.Device) -> jax.Array:
    return array if array.devices() == {device} else jax.device_put(array, device)


def _join(parts: dict[Index, jax.Array], shape: tuple[int, ...]) -> jax.Array:
    """One array from parts that tile it as a grid (the overlaps of a shard with another cut's shards)."""
    covered = sum(_volume(index) for index in parts)
    if covered != int(np.prod(shape)):
        raise ValueError(f"parts {sorted(parts)} do not tile a block of shape {shape}")
    return _join_from(parts, dim=0)


def _join_from(parts: dict[Index, jax.Array], dim: int) -> jax.Array:
    if len(parts) == 1:
        return next(iter(parts.values()))
    starts = sorted({index[dim][0] for index in parts})
    if len(starts) == 1:
        return _join_from(parts, dim + 1)
    slabs = [_join_from({i: a for i, a in parts.items() if i[dim][0] == start}, dim + 1) for start in starts]
    return jnp.concatenate(slabs, axis=dim)

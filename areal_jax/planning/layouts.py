"""The bytes an array takes on a device in the layout its compiler gives it, for the memory plan.

TPU stores an array in tiles of 8 sublanes x 128 lanes (`T(8,128)` in the compiled HLO; a sublane dim under 8
gets a tile of 1, 2 or 4 rows), so a dim of 64 in the lanes takes 128. For a program's arguments XLA:TPU picks
the layout: the dims that pad least go in the lanes and the sublanes (`areal-jax compile`'s HLO shows
`bf16[512,32]{0,1:T(8,128)}`, the vocab in the lanes and a width of 32 in the sublanes; Qwen2.5-0.5B's fused
q/k/v kernel [24, 896, 2, 9, 64] and its KV cache of head dim 64 are stored unpadded, while at head dim 32 and
32 positions the cache takes 4x its bytes). Other platforms store arrays unpadded.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh

from areal_jax.sharding import logical_to_spec

LANES = 128
SUBLANES = 8


def _round(size: int, tile: int) -> int:
    return -(-size // tile) * tile


def _rows_tile(size: int) -> int:
    """The sublane tile of a second-minor dim: 8, or the power of two that covers a smaller dim."""
    return SUBLANES if size >= SUBLANES else 1 << max(0, size - 1).bit_length()


def tiled_elements(shape: Sequence[int], platform: str) -> int:
    """Elements a device stores for an array (a shard) of `shape`: on TPU padded to tiles, the lanes and
    sublanes on whichever two dims pad least, else exact."""
    dims = list(shape)
    if platform != "tpu" or not dims:
        return math.prod(dims)
    if len(dims) == 1:
        return _round(dims[0], LANES)
    total = math.prod(dims)
    best = None
    for lanes, rows in itertools.permutations(range(len(dims)), 2):
        rest = total // (dims[lanes] * dims[rows]) if dims[lanes] * dims[rows] else 0
        padded = rest * _round(dims[lanes], LANES) * _round(dims[rows], _rows_tile(dims[rows]))
        best = padded if best is None else min(best, padded)
    return int(best or 0)


def shard_shape(shape: Sequence[int], names: Sequence[str | None], mesh_shape: dict[str, int]) -> tuple[int, ...]:
    """One device's shard of an array whose axes carry logical `names` (`sharding.logical_to_spec`)."""
    mesh = AbstractMesh(tuple(mesh_shape.values()), tuple(mesh_shape))
    spec = logical_to_spec(names, shape, mesh)
    out = []
    for size, axes in zip(shape, (*spec, *(None,) * (len(shape) - len(spec))), strict=True):
        split = () if axes is None else (axes,) if isinstance(axes, str) else axes
        out.append(size // math.prod(mesh_shape[a] for a in split))
    return tuple(out)


def state_bytes(state: Any, mesh_shape: dict[str, int], platform: str, itemsize: int | None = None) -> int:
    """Bytes one device holds of an abstract NNX state sharded by its logical names (each leaf in its own dtype,
    or `itemsize` bytes an element), in the platform's layouts."""
    total = 0
    for variable in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        value = variable.get_value() if isinstance(variable, nnx.Variable) else variable
        names = (variable.get_metadata().get("out_sharding") if isinstance(variable, nnx.Variable) else None) or (
            (None,) * len(value.shape)
        )
        elements = tiled_elements(shard_shape(value.shape, names, mesh_shape), platform)
        total += elements * (itemsize or value.dtype.itemsize)
    return total

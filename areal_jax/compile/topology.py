"""Cloud TPU slices by name (`v5p-8`, `v5e-16`, `v6e-8`): their chips as compile-only JAX devices, and each
chip's published peaks (docs/tpu.md lists the sources).

A slice name counts TensorCores for v5p (two per chip) and chips for v5e and v6e, as Cloud TPU's
accelerator types do; JAX's topology names give the chips' layout (`v5p:2x2x1`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import jax

from areal_jax.configuration import ConfigError


@dataclasses.dataclass(frozen=True)
class Chip:
    """One generation's chip: HBM, peak dense bf16 matmul FLOP/s, HBM and per-chip ICI bandwidth (bytes/s, one
    direction: half the published bidirectional figure)."""

    generation: str
    hbm_bytes: int
    bf16_flops: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float
    cores_per_chip: int  # TensorCores a slice name counts per chip
    layout_dims: int  # 3: a 3-D torus (v5p), 2: a 2-D one (v5e, v6e)


GIB = 2**30
# Cloud TPU's system-architecture pages (docs/tpu.md): per chip
CHIPS = {
    "v5p": Chip("v5p", 95 * GIB, 459e12, 2765e9, 600e9, 2, 3),
    "v5e": Chip("v5e", 16 * GIB, 197e12, 819e9, 200e9, 1, 2),
    "v6e": Chip("v6e", 32 * GIB, 918e12, 1638e9, 400e9, 1, 2),
}


@dataclasses.dataclass(frozen=True)
class Slice:
    """A named slice: its chip, chip count and JAX topology name."""

    name: str
    chip: Chip
    chips: int
    topology_name: str


_LAYOUTS = {
    2: {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
    3: {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8", 512: "8x8x8"},
}


def parse_slice(name: str) -> Slice:
    """`v5p-8` -> 4 v5p chips as `v5p:2x2x1`; `v5litepod-8` is `v5e-8`. A user error names `--topology`."""
    match = re.fullmatch(r"(v5p|v5e|v5litepod|v6e)-(\d+)", name.strip().lower())
    if match is None:
        raise ConfigError("--topology", f"{name!r} is not a Cloud TPU slice name like v5e-8, v5p-8, v6e-8")
    generation = "v5e" if match.group(1) == "v5litepod" else match.group(1)
    chip = CHIPS[generation]
    count = int(match.group(2))
    if count % chip.cores_per_chip:
        raise ConfigError("--topology", f"{name!r}: a {generation} slice counts {chip.cores_per_chip} cores a chip")
    chips = count // chip.cores_per_chip
    layouts = _LAYOUTS[chip.layout_dims]
    if chips not in layouts:
        raise ConfigError("--topology", f"{name!r}: {chips} chips is not a slice size; sizes: {sorted(layouts)} chips")
    layout = layouts[chips]
    return Slice(f"{generation}-{count}", chip, chips, f"{generation}:{layout}")


def _quiet_libtpu(accelerator_type: str) -> None:
    """libtpu reads the TPU host's description from these at load; on any other machine it prints errors
    about them unless they are set. Compiling for a topology needs neither."""
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator_type)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # compile-only: no chip is opened, so several processes (the suite's workers) may load libtpu at once
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


@functools.cache
def slice_devices(name: str) -> tuple[jax.Device, ...]:
    """The chips of slice `name` as compile-only devices (`jax.experimental.topologies`; needs `libtpu`)."""
    from jax.experimental import topologies

    tpu_slice = parse_slice(name)
    _quiet_libtpu(tpu_slice.name)
    try:
        description = topologies.get_topology_desc(platform="tpu", topology_name=tpu_slice.topology_name)
    except (RuntimeError, jax.errors.JaxRuntimeError) as err:
        raise ConfigError(
            "--topology", f"cannot describe {tpu_slice.topology_name}: {err} (libtpu: requirements-dev.txt)"
        ) from None
    devices = tuple(description.devices)
    assert len(devices) == tpu_slice.chips, (len(devices), tpu_slice)
    return devices


def uneven_mesh_axes(side: str, mesh_shape: dict[str, int], slice_chips: int, share_key: str) -> str | None:
    """What to tell a user whose `side` mesh splits an axis over a number of chips that does not divide the slice's
    `slice_chips` (on a slice of 2^k chips: one that is not a power of two), else None. XLA:TPU compiles no
    all-reduce over such a group: libtpu 0.0.42.1 refused the 1.5B recipe's decode step over 3 of v5p-8's 4 chips
    (`UNIMPLEMENTED: Encountered AllReduce fusion with 3 sized replica_groups, which is odd and greater than one`)
    and aborted the process compiling the 0.5B recipe's over 6 of v5e-8's 8 (`Check failed: total_device_count %
    num_participants_per_group == 0`). A program that all-reduces over no such axis compiles, but which do is the
    compiler's choice, and an abort cannot be caught."""
    uneven = {axis: size for axis, size in mesh_shape.items() if size > 1 and slice_chips % size}
    if not uneven:
        return None
    axes = ", ".join(f"{axis} over {size} chips" for axis, size in uneven.items())
    return (
        f"the {side}'s mesh splits {axes}, which does not divide the slice's {slice_chips}: XLA:TPU compiles no "
        f"all-reduce over such a group (it refuses some and aborts on others); give the {side} a number of chips "
        f"that divides {slice_chips} (change {share_key}, or mesh.*)"
    )

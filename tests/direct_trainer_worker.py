"""Subprocess side of the direct weight-path test of a trainer over several processes (one trainer process);
the caller sets XLA_FLAGS (2 devices a process).

python tests/direct_trainer_worker.py RUN COORDINATOR PROCESS PROCESSES

Joins `jax.distributed` as process PROCESS of PROCESSES, opens a `DirectWeightPublisher` on
RUN/announcement.json + RUN/weights (one puller), prints "ready", then for each version read from stdin
(one a line) publishes `trainer_params(version)` over the global mesh of every process's devices and
prints "published VERSION". Closes the publisher at the end of stdin.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# name: (shape, dtype, partition over the (process, device) mesh "x" x "y"), and the number of pieces each
# trainer process offers: a distinct index is offered by the lowest process holding it
LEAVES = {
    "embed": ((16, 8), "float32", P(("x", "y"), None)),  # 4 pieces, 2 on each process
    "kernel": ((8, 12), "bfloat16", P("x", "y")),  # 4 pieces, 2 on each process
    "counts": ((6, 4), "int32", P("x")),  # 2 pieces, each replicated on its process's devices
    "rows": ((4, 6), "float32", P("y")),  # 2 pieces, each replicated on both processes: process 0 offers them
    "norm": ((8,), "float32", P()),  # replicated everywhere: process 0 offers it
}
OFFERED = {"embed": (2, 2), "kernel": (2, 2), "counts": (1, 1), "rows": (2, 0), "norm": (1, 0)}


def known_values(version: int) -> dict[str, np.ndarray]:
    """The values of `version` (different per version; bf16 as its numpy dtype)."""
    rng = np.random.default_rng(version)
    values = {}
    for name, (shape, dtype, _) in LEAVES.items():
        if dtype == "int32":
            values[name] = rng.integers(-(2**31), 2**31 - 1, shape, dtype=np.int32)
        else:
            values[name] = rng.standard_normal(shape).astype(jax.numpy.dtype(dtype))
    return values


def trainer_params(version: int) -> dict[str, jax.Array]:
    """`known_values(version)` laid out over every process's devices (process p's devices on row p)."""
    mesh = Mesh(np.array(jax.devices()).reshape(jax.process_count(), -1), ("x", "y"))
    return {
        name: jax.make_array_from_callback(value.shape, NamedSharding(mesh, LEAVES[name][2]), value.__getitem__)
        for name, value in known_values(version).items()
    }


def main(run: Path, coordinator: str, process: int, processes: int) -> None:
    jax.distributed.initialize(coordinator, processes, process)
    from areal_jax.weights import OrbaxWeightPublisher
    from areal_jax.weights.direct import DirectWeightPublisher

    publisher = DirectWeightPublisher(
        run / "announcement.json", OrbaxWeightPublisher(run / "weights"), pullers=1, timeout_s=60, host="127.0.0.1"
    )
    print("ready", flush=True)
    for line in sys.stdin:
        version = int(line)
        publisher.publish(trainer_params(version), version)
        print(f"published {version}", flush=True)
    publisher.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))

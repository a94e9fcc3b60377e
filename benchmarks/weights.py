"""Weight publishing: a ~100M-parameter decoder through Orbax on local disk versus raw `np.save`/`np.load`
of the same arrays, and the in-process reshard between two meshes, all in one run.

The params live on a 2x4 (fsdp x tensor) mesh of 8 devices (8 virtual CPU devices unless XLA_FLAGS says
otherwise); readers load them onto a 4x2 mesh. Orbax: publish (async save + wait for the commit) then load
(restore onto the 4x2 shardings). Raw: gather every array to host, `np.save` it and fsync the file (Orbax,
through TensorStore, fsyncs what it writes; raw without fsync is printed too), then `np.load` and
`device_put` onto the same 4x2 shardings. In-process: `jax.device_put` from the 2x4 to the 4x2 sharding.
The paths take turns, round after round (so they see the same background load); the first round warms
them up and is dropped, and each path keeps its best time.

Prints `name: value unit` lines; the last is `ratio orbax_vs_raw: X.XX`, the round-trip (save + load)
throughput of Orbax relative to raw with fsync.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from common import MODEL_100M
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.sharding import MeshConfig, copy_to, make_mesh, state_shardings
from areal_jax.weights import (
    OrbaxWeightPublisher,
    OrbaxWeightSubscriber,
    abstract_target,
    target_shardings,
    tree_nbytes,
)


def random_params(cfg: ModelConfig, mesh: jax.sharding.Mesh) -> nnx.State:
    """The decoder's parameter state on `mesh` (logical shardings), filled with NumPy normals: the values do
    not matter here and drawing them on host is much faster than compiling the initialisers on CPU."""
    abstract = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), nnx.Param)
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda a, s: jax.device_put(rng.standard_normal(a.shape, np.float32).astype(a.dtype), s),
        abstract,
        state_shardings(abstract, mesh),
    )


def fresh_copy(params: Any) -> Any:
    """A new device copy: a jax.Array caches its host value after the first `np.asarray`, which would let
    repeated raw saves skip the device-to-host transfer that every real publish pays."""
    return jax.block_until_ready(jax.tree.map(lambda x: x.copy(), params))


def raw_save(params: Any, directory: Path, fsync: bool) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for i, leaf in enumerate(jax.tree.leaves(params)):
        path = directory / f"{i}.npy"
        with open(path, "wb") as f:
            np.save(f, np.asarray(leaf))
            if fsync:
                f.flush()
                os.fsync(f.fileno())


def raw_load(target: Any, directory: Path) -> Any:
    leaves, treedef = jax.tree.flatten(target)
    arrays = [jax.device_put(np.load(directory / f"{i}.npy"), t.sharding) for i, t in enumerate(leaves)]
    return jax.block_until_ready(jax.tree.unflatten(treedef, arrays))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="8 timed rounds instead of --repeats (< 60 s on 2 cores)")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds; each path keeps its best")
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    args = parser.parse_args()
    logging.getLogger("absl").setLevel(logging.ERROR)
    repeats = 8 if args.quick else args.repeats
    if jax.device_count() < 8:
        raise SystemExit(f"needs 8 devices for the 2x4 -> 4x2 reshard; found {jax.device_count()}")
    devices = jax.devices()[:8]
    writer_mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4), devices)
    reader_mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2), devices)
    cfg = MODEL_100M
    params = random_params(cfg, writer_mesh)
    target = abstract_target(params, state_shardings(params, reader_mesh))
    nbytes = tree_nbytes(params)
    mb = nbytes / 1e6
    print(f"backend: {jax.default_backend()} ({len(devices)} devices)")
    print(f"parameters: {cfg.num_params() / 1e6:.1f} M")
    print(f"weights_bytes: {mb:.1f} MB")

    scratch = Path(args.dir or tempfile.mkdtemp(prefix="weights-bench-"))
    publisher = OrbaxWeightPublisher(scratch / "orbax")
    subscriber = OrbaxWeightSubscriber(scratch / "orbax")
    inference_shardings = target_shardings(target)
    times: dict[str, list[float]] = {}

    def record(name: str, started: float) -> None:
        times.setdefault(name, []).append(time.perf_counter() - started)

    try:
        for version in range(1, repeats + 2):  # round 1 warms every path up and is dropped
            copy = fresh_copy(params)
            started = time.perf_counter()
            publisher.publish(copy, version)
            record("orbax_publish_blocking", started)
            publisher.wait()
            record("orbax_publish", started)
            started = time.perf_counter()
            jax.block_until_ready(subscriber.load(version, target).params)
            record("orbax_load", started)
            for fsync, name in ((True, "raw_save_fsync"), (False, "raw_save_nofsync")):
                shutil.rmtree(scratch / "raw", ignore_errors=True)
                copy = fresh_copy(params)
                started = time.perf_counter()
                raw_save(copy, scratch / "raw", fsync)
                record(name, started)
            started = time.perf_counter()
            raw_load(target, scratch / "raw")
            record("raw_load", started)
            copy = fresh_copy(params)
            started = time.perf_counter()
            jax.block_until_ready(copy_to(copy, inference_shardings))  # what the engine's load copies in process
            record("inprocess_reshard", started)
    finally:
        publisher.close()
        subscriber.close()
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)

    best = {name: min(values[1:]) for name, values in times.items()}
    orbax_rate = mb / (best["orbax_publish"] + best["orbax_load"])
    raw_rate = mb / (best["raw_save_fsync"] + best["raw_load"])
    raw_nosync_rate = mb / (best["raw_save_nofsync"] + best["raw_load"])
    print(f"timed_rounds: {repeats} rounds")
    print(f"orbax_publish_blocking: {best['orbax_publish_blocking']:.3f} s")
    print(f"orbax_publish_committed: {best['orbax_publish']:.3f} s")
    print(f"orbax_load_onto_4x2: {best['orbax_load']:.3f} s")
    print(f"raw_save_fsync: {best['raw_save_fsync']:.3f} s")
    print(f"raw_save_nofsync: {best['raw_save_nofsync']:.3f} s")
    print(f"raw_load_onto_4x2: {best['raw_load']:.3f} s")
    print(f"inprocess_reshard_2x4_to_4x2: {best['inprocess_reshard']:.3f} s")
    print(f"inprocess_reshard_throughput: {mb / best['inprocess_reshard']:.1f} MB/s")
    print(f"orbax_roundtrip_throughput: {orbax_rate:.1f} MB/s")
    print(f"raw_roundtrip_throughput: {raw_rate:.1f} MB/s")
    print(f"raw_nofsync_roundtrip_throughput: {raw_nosync_rate:.1f} MB/s")
    print(f"orbax_vs_raw_nofsync: {orbax_rate / raw_nosync_rate:.2f} x")
    print(f"ratio orbax_vs_raw: {orbax_rate / raw_rate:.2f}")


if __name__ == "__main__":
    main()

"""Subprocess side of the direct weight-path tests (a rollout server's end); the caller sets XLA_FLAGS.

python tests/direct_weights_worker.py RUN PULLER OUT.npz VERSION:LAYOUT [VERSION:LAYOUT ...]

Opens a `DirectWeightSubscriber` on RUN/announcement.json + RUN/weights as puller PULLER, prints "ready",
then for each VERSION loads it onto LAYOUT twice: pulled directly (`load`) and restored from the store,
checks both landed on the layout's shardings, prints "loaded VERSION" and at the end saves the bytes of
every array, and the path each direct load came by, into OUT.npz.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from areal_jax.weights import OrbaxWeightSubscriber
from areal_jax.weights.direct import DirectWeightSubscriber

# name: (shape, dtype, the trainer's partition over its 2-device axis "x")
LEAVES = {
    "embed": ((128, 32), "float32", P("x", None)),
    "kernel": ((32, 64), "bfloat16", P(None, "x")),
    "norm": ((32,), "float32", P()),
    "scale": ((), "float32", P()),
    "counts": ((12, 5), "int32", P("x")),
}
TRANSPOSED = {"embed": P(None, "x"), "kernel": P("x", None), "norm": P("x"), "scale": P(), "counts": P("x")}


def source_params(devices: list[jax.Device], version: int) -> dict[str, jax.Array]:
    """Random values (different per version) laid out as the trainer holds them on `devices` (2)."""
    mesh = Mesh(np.array(devices), ("x",))
    rng = np.random.default_rng(version)
    params = {}
    for name, (shape, dtype, spec) in LEAVES.items():
        if dtype == "int32":
            value = rng.integers(-(2**31), 2**31 - 1, shape, dtype=np.int32)
        else:
            value = rng.standard_normal(shape).astype(jax.numpy.dtype(dtype))
        params[name] = jax.device_put(value, NamedSharding(mesh, spec))
    return params


def as_bytes(array: jax.Array) -> np.ndarray:
    """The array's bytes (bit-exact comparison, bfloat16 included)."""
    return np.frombuffer(np.asarray(array).tobytes(), np.uint8)


def layout(name: str) -> dict[str, jax.ShapeDtypeStruct]:
    """'one': every leaf whole on one device; 'four': 4 devices, every leaf cut another way than the
    trainer's; 'same': 2 devices cut as the trainer's (the pieces are the target's own shards)."""
    devices, specs = {
        "one": (jax.devices()[:1], {k: v[2] for k, v in LEAVES.items()}),
        "four": (jax.devices()[:4], TRANSPOSED),
        "same": (jax.devices()[2:4], {k: v[2] for k, v in LEAVES.items()}),
    }[name]
    mesh = Mesh(np.array(devices), ("x",))
    return {
        k: jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype), sharding=NamedSharding(mesh, specs[k]))
        for k, (shape, dtype, _) in LEAVES.items()
    }


def main(run: Path, puller: int, out: str, plan: list[str]) -> None:
    store = OrbaxWeightSubscriber(run / "weights")
    subscriber = DirectWeightSubscriber(run / "announcement.json", store, puller=puller, timeout_s=30, poll_s=0.01)
    print("ready", flush=True)
    saved: dict[str, np.ndarray] = {}
    for item in plan:
        version, name = int(item.split(":")[0]), item.split(":")[1]
        target = layout(name)
        assert subscriber.wait_for_version(version, timeout_s=60) == version
        pulled = subscriber.load(version, target)
        assert store.wait_for_version(version, timeout_s=60) is not None
        restored = store.load(version, target)
        for path, loaded in (("direct", pulled), ("orbax", restored)):
            assert loaded.version == version, (path, loaded.version)
            for key, leaf in loaded.params.items():
                assert leaf.sharding == target[key].sharding, (path, key, leaf.sharding)
                saved[f"{path}/{version}/{key}"] = as_bytes(leaf)
        saved[f"source/{version}"] = np.array(pulled.source)
        print(f"loaded {version}", flush=True)
    np.savez(out, **saved)
    subscriber.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:])

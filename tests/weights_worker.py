"""Subprocess side of the weight-channel tests; the caller sets XLA_FLAGS (device count) and JAX_PLATFORMS.

python tests/weights_worker.py load DIR OUT.npz      load the newest version of the tiny decoder's params
                                                     onto a 4x1 (fsdp x tensor) mesh, save them as npz
python tests/weights_worker.py publish-big DIR MB    publish version 1 ({"w": MB megabytes}) and wait
                                                     for it, print "committed 1", then publish version 2
                                                     (different values) and wait
"""

from __future__ import annotations

import sys

import jax
import numpy as np
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.sharding import MeshConfig, make_mesh, state_shardings
from areal_jax.weights import OrbaxWeightPublisher, OrbaxWeightSubscriber, abstract_target

TINY = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def big_params(megabytes: int, version: int) -> dict[str, np.ndarray]:
    """Incompressible values (Orbax compresses), different for every version."""
    w = np.random.default_rng(version).integers(0, 2**32, megabytes * 2**18, dtype=np.uint32).view(np.float32)
    return {"w": w, "b": np.arange(7, dtype=np.float32) + version}


def flat(state: nnx.State) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(state)}


def load(directory: str, out: str) -> None:
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=1))
    abstract = nnx.state(nnx.eval_shape(lambda: Decoder(TINY, nnx.Rngs(0))), nnx.Param)
    target = abstract_target(abstract, state_shardings(abstract, mesh))
    subscriber = OrbaxWeightSubscriber(directory)
    version = subscriber.wait_for_version(1, timeout_s=30)
    loaded = subscriber.load(version, target)
    for leaf in jax.tree.leaves(loaded.params):
        assert leaf.sharding.mesh.devices.shape == (1, 4, 1), leaf.sharding
    np.savez(out, version=loaded.version, **flat(loaded.params))
    subscriber.close()


def publish_big(directory: str, megabytes: int) -> None:
    publisher = OrbaxWeightPublisher(directory)
    publisher.publish(jax.device_put(big_params(megabytes, 1)), 1)
    publisher.wait()
    print("committed 1", flush=True)
    publisher.publish(jax.device_put(big_params(megabytes, 2)), 2)
    publisher.wait()
    print("committed 2", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "load":
        load(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "publish-big":
        publish_big(sys.argv[2], int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}; expected load or publish-big")

"""One trainer process of the multi-process test: `python tests/distributed_trainer_worker.py OUT PROCESS_ID
NUM_PROCESSES PORT CHECKPOINT_DIR` (NUM_PROCESSES=1: the single-process reference, no jax.distributed).

Builds the tiny decoder on one global (fsdp) mesh over every process's devices, trains 3 steps on the same
seeded trajectories, saves a checkpoint collectively, restores it into a fresh trainer, and writes (process 0)
the trained params gathered to host and whether the restore matched, to OUT (npz). The caller sets XLA_FLAGS
(devices per process) and JAX_PLATFORMS=cpu.
"""

from __future__ import annotations

import sys

import jax
import numpy as np


def main(out: str, process_id: int, num_processes: int, port: int, checkpoints: str) -> None:
    if num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        from areal_jax.system.cluster import DistributedConfig, initialize_distributed

        initialize_distributed(
            DistributedConfig(
                enabled=True,
                coordinator_address=f"127.0.0.1:{port}",
                num_processes=num_processes,
                process_id=process_id,
            )
        )
    from jax.experimental import multihost_utils

    from areal_jax.models.init import create_decoder
    from areal_jax.sharding import MeshConfig, make_mesh
    from areal_jax.trainer.checkpoint import CheckpointConfig, TrainCheckpointer
    from areal_jax.trainer.trainer import Trainer
    from areal_jax.weights.base import abstract_target
    from tests.test_train_step import CONFIG, TINY, make_trajectories

    assert jax.process_count() == num_processes and jax.device_count() == 8, (jax.process_count(), jax.device_count())
    mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1))
    config = CONFIG.replace(packing=CONFIG.packing.replace(rows=8, token_budget=512))
    trainer = Trainer(create_decoder(TINY, seed=0, mesh=mesh), config, mesh, temperature=1.0)
    rng = np.random.default_rng(7)
    for step in range(3):
        trainer.step(make_trajectories(rng, 16, version=step))

    def gathered(tree):
        return {
            jax.tree_util.keystr(path): np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        }

    params = gathered(trainer.params)
    checkpointer = TrainCheckpointer(checkpoints, CheckpointConfig(every_steps=1))
    checkpointer.save(3, {"params": trainer.params, "opt_state": trainer.opt_state}, {"version": 3}, wait=True)
    fresh = Trainer(create_decoder(TINY, seed=1, mesh=mesh), config, mesh, temperature=1.0)
    restored = checkpointer.restore(abstract_target({"params": fresh.params, "opt_state": fresh.opt_state}))
    checkpointer.close()
    again = gathered(restored.state["params"])
    same = all(np.array_equal(params[k], again[k]) for k in params)
    if jax.process_index() == 0:
        np.savez(out, restored_equal=same, restored_step=restored.step, **params)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])

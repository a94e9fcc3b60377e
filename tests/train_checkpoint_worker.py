"""A training loop for the SIGTERM test: `python tests/train_checkpoint_worker.py DIR`.

Runs steps (w += 1 on a 2-device mesh) until SIGTERM/SIGINT, printing "step N" after each; then
the loop's `StopControl` ends it, the checkpoint is written and the process prints "saved N" and exits 0.
The caller sets XLA_FLAGS (2 devices) and JAX_PLATFORMS.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from areal_jax.multiprocess import TrainerProcesses
from areal_jax.system.stop_control import StopControl
from areal_jax.trainer.checkpoint import CheckpointConfig, TrainCheckpointer


def main(directory: str) -> None:
    mesh = jax.make_mesh((2,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    state = {"w": jax.device_put(jnp.zeros((8, 4), jnp.float32), NamedSharding(mesh, PartitionSpec("fsdp")))}
    step_fn = jax.jit(lambda s: {"w": s["w"] + 1.0}, donate_argnums=0)
    checkpointer = TrainCheckpointer(directory, CheckpointConfig(every_steps=1_000_000))
    stops = StopControl(TrainerProcesses(), train_steps=1_000_000, max_skipped_steps=1, updates_per_step=1)
    step = 0
    with stops.watching_signals():
        while stops.go_on(step):
            step += 1
            state = step_fn(state)
            print(f"step {step}", flush=True)
            checkpointer.maybe_save(step, state, {"policy_version": step})
    checkpointer.save(step, state, {"policy_version": step}, wait=True)
    checkpointer.close()
    print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

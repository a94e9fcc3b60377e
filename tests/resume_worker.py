"""A trainer process for the exact-resume test: trains from a fixed rollout log, checkpointing.

    python tests/resume_worker.py LOG_DIR CKPT_DIR OUT_NPZ TOTAL_STEPS KILL_AFTER_STEP

Trains until TOTAL_STEPS (resuming from the newest checkpoint in CKPT_DIR if there is one), appending the
(group_id, sample_index) of every consumed record to OUT_NPZ.consumed.jsonl; checkpoints every step.
With KILL_AFTER_STEP > 0 it SIGKILLs itself right after the checkpoint of that step is committed;
otherwise it writes the final params to OUT_NPZ.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import jax
import numpy as np
from flax import nnx

from areal_jax.data.packing import PackingConfig
from areal_jax.data.pipeline import PipelineConfig, build_pipeline
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.sharding import MeshConfig, make_mesh
from areal_jax.trainer.checkpoint import CheckpointConfig, TrainCheckpointer
from areal_jax.trainer.config import OptimizerConfig, TrainerConfig
from areal_jax.trainer.trainer import Trainer
from areal_jax.weights.base import abstract_target

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
GROUP_SIZE, GROUPS_PER_BATCH = 2, 2


def main(log_dir: str, ckpt_dir: str, out: str, total_steps: int, kill_after: int) -> None:
    mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1), jax.devices()[:1])
    config = TrainerConfig(optimizer=OptimizerConfig(lr=1e-2), packing=PackingConfig(token_budget=256, rows=4))
    trainer = Trainer(Decoder(MODEL, nnx.Rngs(0)), config, mesh, temperature=1.0)
    checkpointer = TrainCheckpointer(ckpt_dir, CheckpointConfig(every_steps=1, async_save=False))
    pipeline = iter(
        build_pipeline(
            log_dir,
            PipelineConfig(group_size=GROUP_SIZE, groups_per_batch=GROUPS_PER_BATCH, idle_timeout_s=5.0),
        )
    )
    if checkpointer.latest_step() is not None:
        restored = checkpointer.restore(abstract_target({"params": trainer.params, "opt": trainer.opt_state}))
        trainer.params, trainer.opt_state = restored.state["params"], restored.state["opt"]
        trainer.version = int(restored.metadata["version"])
        pipeline.set_state(restored.metadata["pipeline"])
    with open(out + ".consumed.jsonl", "a") as consumed:
        while trainer.version < total_steps:
            batch = next(pipeline)
            trainer.step(batch)
            consumed.write(json.dumps([[t.group_id, t.sample_index] for t in batch]) + "\n")
            consumed.flush()
            checkpointer.save(
                trainer.version,
                {"params": trainer.params, "opt": trainer.opt_state},
                {"version": trainer.version, "pipeline": pipeline.get_state()},
                wait=True,
            )
            if trainer.version == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
    flat = {
        "/".join(map(str, path)): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(trainer.params))
    }
    np.savez(out, **flat)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))

"""Resume with LoRA: the training checkpoint holds the adapters and their optimizer state alone; a trainer rebuilt
from the same base and restored by the run's own `restore` continues to the same adapters as an uninterrupted run,
with LoRA dropout too (its masks come from the run seed and the step)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.models.decoder import Decoder
from areal_jax.models.lora_config import LoRAConfig
from areal_jax.system.run_state import RunState, restore
from areal_jax.trainer.checkpoint import CheckpointConfig, TrainCheckpointer
from areal_jax.trainer.trainer import Trainer
from tests.test_train_step import CONFIG, TEMPERATURE, TINY, make_trajectories, single_device_mesh

CFG = TINY.replace(num_layers=1, lora=LoRAConfig(rank=4, targets=("q", "v", "o", "up", "down")))
K = 2  # steps before the checkpoint and after it


def _trainer(dropout: float) -> Trainer:
    cfg = CFG.replace(lora=CFG.lora.replace(dropout=dropout))
    return Trainer(Decoder(cfg, nnx.Rngs(0)), CONFIG, single_device_mesh(), temperature=TEMPERATURE, seed=7)


def _batch(step: int):
    return make_trajectories(np.random.default_rng(100 + step), 8, version=step)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_a_lora_run_resumes_exactly_from_a_checkpoint_of_adapters(tmp_path: Path, dropout: float) -> None:
    straight = _trainer(dropout)
    for step in range(2 * K):
        straight.step(_batch(step))

    first = _trainer(dropout)
    for step in range(K):
        first.step(_batch(step))
    checkpointer = TrainCheckpointer(tmp_path / "ckpt", CheckpointConfig(every_steps=1, async_save=False))
    state = RunState(version=first.version, pipeline={}, consumed_groups=2 * K)
    checkpointer.save(
        first.version, {"params": first.params, "opt_state": first.opt_state}, state.metadata(), wait=True
    )
    checkpointer.close()
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(first.frozen))
    written = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*") if f.is_file())
    # adapters and their Adam moments only (the base is the run's source): below the arrays alone of a full checkpoint
    assert written < 3 * base_bytes

    resumed = _trainer(dropout)
    checkpointer = TrainCheckpointer(tmp_path / "ckpt", CheckpointConfig(every_steps=1, async_save=False))
    try:
        restored, step = restore(checkpointer, resumed)
    finally:
        checkpointer.close()
    assert (step, restored.version, resumed.version) == (K, K, K)
    for step in range(K, 2 * K):
        resumed.step(_batch(step))
    for want, got in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for want, got in zip(jax.tree.leaves(straight.opt_state), jax.tree.leaves(resumed.opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    moved = [
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(resumed.params), strict=True)
    ]
    assert any(moved)

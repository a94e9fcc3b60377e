"""A golden step: `Trainer.step` on a fixed batch (the tiny decoder from seed 0, 16 random trajectories up to 2
versions stale, 2 mini-batches) against the statistics and squared parameter updates recorded in
tests/data/golden_step.json, so a change to the objective, the packing, the optimizer or the model's numerics
shows here in seconds instead of as a drift in a learning curve.

A deliberate numerical change rewrites the record: `AREAL_JAX_RECORD_GOLDEN=1 pytest tests/test_golden_step.py`,
then review the diff of the JSON file like code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from areal_jax.trainer.trainer import Trainer
from tests.test_train_step import CONFIG, TEMPERATURE, make_trajectories, single_device_mesh, tiny_model_state

RECORD = Path(__file__).parent / "data" / "golden_step.json"
# XLA may fuse and reduce in another order on another machine or version: 1e-5 relative holds float32
# rounding, while any change to a formula moves these values by far more.
RTOL, ATOL = 1e-5, 1e-7


def _golden_run() -> dict[str, dict[str, float]]:
    graphdef, state = tiny_model_state()
    config = CONFIG.replace(ppo_minibatches=2)
    trainer = Trainer(nnx.merge(graphdef, state), config, single_device_mesh(), version=2, temperature=TEMPERATURE)
    stats = trainer.step(make_trajectories(np.random.default_rng(0), 16, version=2))
    timing = ("train/step_time", "train/throughput")
    before = jax.tree_util.tree_leaves(jax.device_get(state))
    after = jax.tree_util.tree_leaves_with_path(jax.device_get(trainer.params))
    updates = {  # each parameter's squared update: the optimizer's step, not the far larger weights around it
        jax.tree_util.keystr(path): float(np.sum((np.asarray(new, np.float64) - np.asarray(old, np.float64)) ** 2))
        for (path, new), old in zip(after, before, strict=True)
    }
    return {"stats": {k: float(v) for k, v in sorted(stats.items()) if k not in timing}, "update_sq_sums": updates}


def test_one_trainer_step_matches_the_recorded_statistics_and_parameters():
    got = _golden_run()
    if os.environ.get("AREAL_JAX_RECORD_GOLDEN"):
        RECORD.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(RECORD.read_text())
    for section in ("stats", "update_sq_sums"):
        assert sorted(got[section]) == sorted(want[section]), f"{section}: keys differ from {RECORD.name}"
        differ = {
            key: (got[section][key], want[section][key])
            for key in want[section]
            if not np.isclose(got[section][key], want[section][key], rtol=RTOL, atol=ATOL)
        }
        assert not differ, f"{section} differ from {RECORD.name} (got, recorded): {differ}"

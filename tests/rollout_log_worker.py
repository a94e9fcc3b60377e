"""Trajectory factory shared by the rollout-log and pipeline tests, and a writer process for the log tests.

As a script: `python tests/rollout_log_worker.py DIR WRITER_ID COUNT SEED` appends COUNT trajectories
(metadata {"writer": WRITER_ID, "i": i}) with random shard sizes and explicit flushes, then closes.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import numpy as np

from areal_jax.data.rollout_log import RolloutLogWriter
from areal_jax.data.trajectory import Trajectory


def make_trajectory(
    group_id: int,
    sample_index: int = 0,
    *,
    prompt_id: str | None = None,
    version: int = 0,
    length: int = 12,
    prompt_length: int = 4,
    seed: int = 0,
    metadata: dict | None = None,
) -> Trajectory:
    """A trajectory whose generated tokens were sampled at policy `version` (the first at version - 1
    when version > 0, so oldest_version() == version - 1 in that case)."""
    rng = np.random.default_rng([seed, group_id, sample_index])
    versions = np.full(length, -1, np.int32)
    versions[prompt_length:] = version
    if version > 0:
        versions[prompt_length] = version - 1
    loss_mask = np.zeros(length, bool)
    loss_mask[prompt_length:] = True
    return Trajectory(
        token_ids=rng.integers(0, 50_000, length).astype(np.int32),
        behav_logprobs=np.where(loss_mask, -rng.random(length), 0.0).astype(np.float32),
        versions=versions,
        loss_mask=loss_mask,
        prompt_length=prompt_length,
        reward=float(sample_index % 2),
        prompt_id=prompt_id if prompt_id is not None else f"p{group_id}",
        group_id=group_id,
        sample_index=sample_index,
        reward_components={"correct": float(sample_index % 2)},
        timings={"generate_s": 0.5},
        metadata=dict(metadata or {}),
    )


def append_in_shards(writer: RolloutLogWriter, trajectories: Iterable[Trajectory], per_shard: int) -> None:
    """Append `trajectories`, committing a shard whenever `per_shard` records are buffered (the rest wait
    for the next flush or close)."""
    for trajectory in trajectories:
        writer.append(trajectory)
        if writer.buffered >= per_shard:
            writer.flush()


def main(directory: str, writer_id: str, count: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    per_shard = int(rng.integers(2, 9))
    with RolloutLogWriter(directory, writer_id) as writer:
        for i in range(count):
            writer.append(make_trajectory(i, metadata={"writer": writer_id, "i": i}, length=int(rng.integers(5, 40))))
            if writer.buffered >= per_shard or rng.random() < 0.1:
                writer.flush()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))

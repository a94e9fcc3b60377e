"""The prompt an uninterrupted run gives each group id, written once for the crash tests: the training stream
is a function of the config's seed and data (nothing a crash or a resume may change)."""

from __future__ import annotations

from collections.abc import Iterable

from areal_jax.config import ExperimentConfig
from areal_jax.data.tasks import TaskStream, load_task_records
from areal_jax.seeds import stream_seed


def uninterrupted_prompts(cfg: ExperimentConfig, group_ids: Iterable[int]) -> dict[int, str]:
    """Group id -> prompt id for `group_ids`, from the config alone (every prompt trains: `dataset.heldout=0`)."""
    assert cfg.dataset.heldout == 0, "the held-out split would change which prompts train"
    records = load_task_records(cfg.dataset, stream_seed(cfg.seed, "tasks"))
    stream = TaskStream(records, stream_seed(cfg.seed, "shuffle"), cfg.dataset.shuffle, cfg.dataset.epochs)
    return {g: stream.task_for(g).id for g in group_ids}

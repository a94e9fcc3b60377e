"""The trainer's input pipeline: Grain stages from the rollout log to batches of whole groups.

    RolloutLogDataset     tails the log directory (`rollout_log_tail`): reads committed shards as they
                          appear (bounded-backoff polling, never a busy loop), one writer's in commit order
      -> staleness filter  staleness = trainer version (from a callable) - oldest token version; samples
                          above the bound are dropped and counted (kept/dropped histograms in the state)
      -> group assembly    a prompt's `group_size` samples, in any arrival order, are emitted together
                          (sorted by sample and sequence index) once all have arrived (an agent episode
                          trained as several sequences: all `num_sequences` of it); a group that lost
                          samples to the filter is emitted only if at least `min_group_size` samples keep
                          a sequence; a group logged but kept out of training (`Trajectory.trains`) is
                          skipped and counted
      -> batch             `groups_per_batch` groups as one flat list of trajectories (groups contiguous),
                          what one `Trainer.step` trains on

State. `get_state()` of the final iterator is a JSON-ready dict: per writer the next shard to read, the
current shard and the index of its next unread record, the log positions of the samples of incomplete
groups (re-read from the log by `set_state`; shards are immutable), and the filter and group counters.
A new iterator given that state yields exactly the records not yet consumed. Shards referenced by a
saved state must still exist when it is restored.

Several trainer processes. One pipeline reads the whole log, on process 0; the other processes get each
batch from it by broadcast (`system/trainer_processes.SharedBatches`), so every process trains on the same
batch. Stopping. Each iterator ends (StopIteration) when `stop_event` is set (checked at least every
`poll_max_s`), once `writers_done` is set and no unread shard is left (the writers finished: the stream
ends after their last shard), after `idle_timeout_s` without a new shard, or when it is closed.
Staleness is computed when the filter stage pulls a record, as the trainer asks for the batch (there is no
prefetch: the position a checkpoint records is what was handed out, and the trainer's version is the one
the batch trains at).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import grain

from areal_jax import storage
from areal_jax.configuration import Config, ConfigError, option
from areal_jax.data.rollout_log_reader import LogEntry, read_positions, read_shard
from areal_jax.data.rollout_log_shards import TMP_PREFIX, ShardName, list_shards, shard_location
from areal_jax.data.rollout_log_tail import RolloutLogDataset, StopFlag
from areal_jax.data.trajectory import Trajectory

logger = logging.getLogger(__name__)

Position = tuple[str, int]


@dataclasses.dataclass(frozen=True)
class PipelineConfig(Config):
    """Grouping, batching, the staleness bound and how the log is tailed."""

    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "prefetch_batches": "the trainer reads each batch as it asks for it (the checkpointed position)"
    }

    group_size: int | None = option(
        None,
        ge=1,
        doc="samples per prompt (n); a group is complete when all n have arrived; null = the run's "
        "rollout.workflow.n_samples",
    )
    min_group_size: int | None = option(
        None, ge=1, doc="emit a group that lost samples to the staleness filter if this many remain; null = all"
    )
    groups_per_batch: int | None = option(
        None, ge=1, doc="groups per training batch; null = the run's rollout.staleness.batch_prompts"
    )
    max_staleness: int | None = option(
        None, ge=0, doc="drop samples whose staleness (trainer version - oldest token version) exceeds this"
    )
    max_pending_groups: int = option(
        4096, ge=1, doc="incomplete groups held at most; beyond it the oldest is dropped (and counted)"
    )
    poll_initial_s: float = option(0.01, gt=0, doc="first wait when no new shard is visible; doubles per retry")
    poll_max_s: float = option(0.5, gt=0, doc="longest wait between two listings of the log directory")
    idle_timeout_s: float | None = option(
        None, gt=0, doc="end the stream after this long without a new shard; null = wait until stopped"
    )
    gap_timeout_s: float = option(
        10.0, gt=0, doc="a writer's missing shard sequence number is skipped (and reported) after this long"
    )

    def validate(self) -> None:
        if self.min_group_size is not None and self.group_size is not None and self.min_group_size > self.group_size:
            raise ConfigError("min_group_size", f"value {self.min_group_size} exceeds group_size={self.group_size}")
        if self.poll_initial_s > self.poll_max_s:
            raise ConfigError("poll_initial_s", f"value {self.poll_initial_s} exceeds poll_max_s={self.poll_max_s}")


# -- staleness filter ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckedEntry:
    """A log entry with its staleness at the time the filter saw it, and the verdict."""

    entry: LogEntry
    staleness: int
    kept: bool


def staleness_of(trajectory: Trajectory, trainer_version: int) -> int:
    """Trainer version minus the oldest version among generated tokens (0 if the policy generated none)."""
    oldest = trajectory.oldest_version()
    return 0 if oldest < 0 else trainer_version - oldest


class StalenessFilterDataset(grain.IterDataset):
    """Marks each entry kept or dropped by `max_staleness` (None keeps all) and counts both by staleness."""

    def __init__(self, parent: grain.IterDataset, max_staleness: int | None, trainer_version: Callable[[], int] | None):
        super().__init__(parent)
        if max_staleness is not None and trainer_version is None:
            raise ValueError(f"max_staleness is {max_staleness} but no trainer_version callable was given")
        self.max_staleness = max_staleness
        self.trainer_version = trainer_version

    def __iter__(self) -> _StalenessFilterIterator:
        return _StalenessFilterIterator(self._parent.__iter__(), self)


class _StalenessFilterIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, dataset: StalenessFilterDataset):
        super().__init__(parent)
        self._ds = dataset
        self._kept: collections.Counter[int] = collections.Counter()
        self._dropped: collections.Counter[int] = collections.Counter()

    def __next__(self) -> CheckedEntry:
        entry = next(self._parent)
        version = self._ds.trainer_version() if self._ds.trainer_version is not None else None
        staleness = 0 if version is None else staleness_of(entry.trajectory, version)
        kept = self._ds.max_staleness is None or staleness <= self._ds.max_staleness
        (self._kept if kept else self._dropped)[staleness] += 1
        if not kept:
            logger.debug(
                "dropping %s/%d: staleness %d > %d",
                entry.trajectory.prompt_id,
                entry.trajectory.sample_index,
                staleness,
                self._ds.max_staleness,
            )
        return CheckedEntry(entry, staleness, kept)

    def get_state(self) -> dict[str, Any]:
        return {
            "parent": self._parent.get_state(),
            "kept_by_staleness": {str(k): v for k, v in sorted(self._kept.items())},
            "dropped_by_staleness": {str(k): v for k, v in sorted(self._dropped.items())},
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._kept = collections.Counter({int(k): int(v) for k, v in state["kept_by_staleness"].items()})
        self._dropped = collections.Counter({int(k): int(v) for k, v in state["dropped_by_staleness"].items()})


# -- group assembly ----------------------------------------------------------------------------


Part = tuple[int, int]  # (sample index, sequence index) of one trajectory of a group


@dataclasses.dataclass
class _OpenGroup:
    entries: list[LogEntry] = dataclasses.field(default_factory=list)
    dropped: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (sample, sequence, of)

    def seen(self) -> set[Part]:
        return {(e.trajectory.sample_index, e.trajectory.sequence_index) for e in self.entries} | {
            (sample, sequence) for sample, sequence, _ in self.dropped
        }

    def expected(self) -> dict[int, int]:
        """Each seen sample's number of sequences."""
        counts = {e.trajectory.sample_index: e.trajectory.num_sequences for e in self.entries}
        return counts | {sample: of for sample, _, of in self.dropped}

    def complete(self, group_size: int) -> bool:
        expected = self.expected()
        return len(expected) == group_size and len(self.entries) + len(self.dropped) == sum(expected.values())

    def kept_samples(self) -> int:
        return len({e.trajectory.sample_index for e in self.entries})


def _dropped_part(value: Any) -> tuple[int, int, int]:
    """A saved dropped part: [sample, sequence, of], or a sample index alone (states before sequences)."""
    if isinstance(value, int):
        return value, 0, 1
    sample, sequence, of = value
    return int(sample), int(sequence), int(of)


class GroupDataset(grain.IterDataset):
    """Whole groups (a list of trajectories sorted by sample and sequence index) out of checked entries in any
    order.

    `fetch` reads log positions back; `set_state` uses it to rebuild incomplete groups.
    """

    def __init__(
        self,
        parent: grain.IterDataset,
        group_size: int,
        min_group_size: int,
        max_pending_groups: int,
        fetch: Callable[[Sequence[Position]], list[LogEntry]],
    ):
        super().__init__(parent)
        self.group_size = group_size
        self.min_group_size = min_group_size
        self.max_pending_groups = max_pending_groups
        self.fetch = fetch

    def __iter__(self) -> _GroupIterator:
        return _GroupIterator(self._parent.__iter__(), self)


class _GroupIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, dataset: GroupDataset):
        super().__init__(parent)
        self._ds = dataset
        self._open: collections.OrderedDict[tuple[str, int], _OpenGroup] = collections.OrderedDict()
        self._counts = {"emitted": 0, "dropped_groups": 0, "duplicates": 0, "evicted": 0, "untrained_groups": 0}

    def __next__(self) -> list[Trajectory]:
        while True:
            checked: CheckedEntry = next(self._parent)
            trajectory = checked.entry.trajectory
            if not 0 <= trajectory.sample_index < self._ds.group_size:
                raise ValueError(
                    f"trajectory {trajectory.prompt_id}/{trajectory.group_id} at {checked.entry.position} has "
                    f"sample_index {trajectory.sample_index} outside [0, group_size={self._ds.group_size})"
                )
            key = (trajectory.prompt_id, trajectory.group_id)
            group = self._open.get(key)
            if group is None:
                group = self._open[key] = _OpenGroup()
                self._evict_if_full()
            part = (trajectory.sample_index, trajectory.sequence_index)
            if part in group.seen():
                self._counts["duplicates"] += 1
                logger.warning(
                    "ignoring a duplicate of sample %d (sequence %d) of group %s at %s",
                    *part,
                    key,
                    checked.entry.position,
                )
                continue
            if group.expected().get(trajectory.sample_index, trajectory.num_sequences) != trajectory.num_sequences:
                raise ValueError(
                    f"trajectory {trajectory.prompt_id}/{trajectory.group_id} at {checked.entry.position}: sample "
                    f"{trajectory.sample_index} has num_sequences {trajectory.num_sequences}, its other sequences "
                    f"{group.expected()[trajectory.sample_index]}"
                )
            if checked.kept:
                group.entries.append(checked.entry)
            else:
                group.dropped.append((*part, trajectory.num_sequences))
            if not group.complete(self._ds.group_size):
                continue
            del self._open[key]
            if not all(e.trajectory.trains for e in group.entries):  # logged, kept out of training
                self._counts["untrained_groups"] += 1
            elif group.kept_samples() >= self._ds.min_group_size:
                self._counts["emitted"] += 1
                return sorted((e.trajectory for e in group.entries), key=lambda t: (t.sample_index, t.sequence_index))
            else:
                self._counts["dropped_groups"] += 1

    def _evict_if_full(self) -> None:
        while len(self._open) > self._ds.max_pending_groups:
            key, group = self._open.popitem(last=False)
            self._counts["evicted"] += 1
            logger.warning(
                "dropping incomplete group %s (%d of %d samples seen): more than %d groups are open",
                key,
                len(group.expected()),
                self._ds.group_size,
                self._ds.max_pending_groups,
            )

    def get_state(self) -> dict[str, Any]:
        return {
            "parent": self._parent.get_state(),
            "open_groups": [
                [prompt_id, group_id, [list(e.position) for e in group.entries], [list(d) for d in group.dropped]]
                for (prompt_id, group_id), group in self._open.items()
            ],
            **self._counts,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._counts = {key: int(state.get(key, 0)) for key in self._counts}  # older states lack new counters
        positions = [(str(name), int(index)) for _, _, entries, _ in state["open_groups"] for name, index in entries]
        fetched = iter(self._ds.fetch(positions))
        self._open = collections.OrderedDict()
        for prompt_id, group_id, entries, dropped in state["open_groups"]:
            self._open[(str(prompt_id), int(group_id))] = _OpenGroup(
                entries=[next(fetched) for _ in entries], dropped=[_dropped_part(d) for d in dropped]
            )


# -- the whole pipeline --------------------------------------------------------------------------


def build_pipeline(
    directory: str | os.PathLike[str],
    config: PipelineConfig,
    *,
    trainer_version: Callable[[], int] | None = None,
    stop_event: StopFlag | None = None,
    writers_done: threading.Event | None = None,
) -> grain.IterDataset:
    """The pipeline of the module docstring over the rollout log in `directory`.

    Each element is a list of `groups_per_batch * group_size` trajectories or fewer (a group may have lost
    stale samples, and the last batch before the stream ends may hold fewer groups). `trainer_version` is
    required when `config.max_staleness` is set.
    """
    if config.group_size is None or config.groups_per_batch is None:
        raise ValueError(f"the pipeline needs group_size and groups_per_batch, got {config}")
    source = RolloutLogDataset(directory, config, stop_event=stop_event, writers_done=writers_done)
    checked = StalenessFilterDataset(source, config.max_staleness, trainer_version)
    groups = GroupDataset(
        checked,
        config.group_size,
        config.min_group_size or config.group_size,
        config.max_pending_groups,
        lambda positions: read_positions(directory, positions),
    )
    return groups.batch(config.groups_per_batch, batch_fn=lambda gs: [t for g in gs for t in g])


def _find(state: Any, key: str) -> Any:
    if isinstance(state, dict):
        if key in state:
            return state[key]
        for value in state.values():
            found = _find(value, key)
            if found is not None:
                return found
    return None


def pipeline_stats(state: dict[str, Any]) -> dict[str, Any]:
    """Counters of a pipeline iterator's `get_state()`: samples kept/dropped by staleness, groups emitted,
    dropped (too few samples left), evicted and duplicate samples, unreadable log data skipped."""
    kept = {int(k): v for k, v in (_find(state, "kept_by_staleness") or {}).items()}
    dropped = {int(k): v for k, v in (_find(state, "dropped_by_staleness") or {}).items()}
    return {
        "samples_kept": sum(kept.values()),
        "samples_dropped": sum(dropped.values()),
        "kept_by_staleness": kept,
        "dropped_by_staleness": dropped,
        **{
            key: _find(state, key) or 0
            for key in ("emitted", "dropped_groups", "untrained_groups", "evicted", "duplicates")
        },
        "unreadable": _find(state, "problems") or 0,
    }


@dataclasses.dataclass(frozen=True)
class SetAside:
    """What `set_aside_unread` did: shards moved out of the log, temporary files of unfinished shards
    deleted, and the groups still to be read from it."""

    shards: int
    records: int
    unread_group_ids: frozenset[int]
    temporaries: int = 0


def _log_state(state: dict[str, Any]) -> dict[str, Any]:
    while "next_shard" not in state:
        state = state["parent"]
    return state


def set_aside_unread(
    directory: str | os.PathLike[str], state: dict[str, Any], into: str | os.PathLike[str]
) -> SetAside:
    """Move every shard that a pipeline at `state` has not started reading into `into` (out of the log,
    kept for inspection), so the log ends where the state is, and delete the temporary files of shards
    that were never committed. The rest of a shard it is partway through stays; its group ids are
    returned, as those groups will still be read. Only while no writer is live (a resume)."""
    log = _log_state(state)
    next_shard = {str(k): int(v) for k, v in log["next_shard"].items()}
    current = ShardName.parse(log["shard"]) if log["shard"] is not None else None
    moved = records = 0
    for shard in list_shards(directory):
        if shard == current or shard.shard_seq < next_shard.get(shard.writer_id, 0):
            continue
        storage.move(shard_location(directory, shard.name), shard_location(into, shard.name))
        moved, records = moved + 1, records + shard.num_records
    temporaries = 0
    if not storage.is_remote(directory):  # a GCS writer's temporary files are on its own host
        for leftover in Path(directory).glob(f"{TMP_PREFIX}*"):
            leftover.unlink(missing_ok=True)
            temporaries += 1
    unread: set[int] = set()
    if current is not None:
        entries, _ = read_shard(directory, current, int(log["record"]))
        unread = {entry.trajectory.group_id for entry in entries}
    return SetAside(moved, records, frozenset(unread), temporaries)


def open_group_ids(state: dict[str, Any]) -> set[int]:
    """Group ids of the incomplete groups a pipeline state holds."""
    return {int(group_id) for _, group_id, _, _ in _find(state, "open_groups") or []}

"""The trainer's input pipeline: Grain stages from the rollout log to batches of whole groups.

    RolloutLogDataset     tails the log directory: reads committed shards as they appear (bounded-backoff
                          polling, never a busy loop), one writer's shards in commit order
      -> staleness filter  staleness = trainer version (from a callable) - oldest token version; samples
                          above the bound are dropped and counted (kept/dropped histograms in the state)
      -> group assembly    a prompt's `group_size` samples, in any arrival order, are emitted together
                          (sorted by sample index) once all have arrived; a group that lost samples to
                          the filter is emitted only if at least `min_group_size` are left
      -> batch             `groups_per_batch` groups as one flat list of trajectories (groups contiguous),
                          what `Trainer.run` consumes
      -> map hook          optional `batch_fn`, e.g. the trainer's packing (`trainer.batching.build_batch`)
      -> thread prefetch   `prefetch_batches` batches ahead in one background thread

State. `get_state()` of the final iterator is a JSON-ready dict: per writer the next shard to read, the
current shard and the index of its next unread record, the log positions of the samples of incomplete
groups (re-read from the log by `set_state`; shards are immutable), and the filter and group counters.
A new iterator given that state yields exactly the records not yet consumed. Shards referenced by a
saved state must still exist when it is restored.

Multi-host. Process i of n keeps the groups with `group_id % n == i` (record-level slicing): every process
reads every shard (trajectories are small) and a group never straddles two processes, so group
advantages only need local data. Stopping. Each iterator ends (StopIteration) when `stop_event` is set
(checked at least every `poll_max_s`), once `writers_done` is set and no unread shard is left (the
writers finished: the stream ends after their last shard), after `idle_timeout_s` without a new shard, or
when it is closed;
set the event before closing an iterator whose prefetch thread may be waiting for data.
Staleness is computed when the filter stage pulls a record, up to `prefetch_batches` batches before the
trainer consumes it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grain
from grain.experimental import ThreadPrefetchDatasetIterator, ThreadPrefetchIterDataset

from areal_jax import storage
from areal_jax.configuration import Config, ConfigError, option
from areal_jax.data.rollout_log import (
    TMP_PREFIX,
    LogEntry,
    ReadProblem,
    ShardFetcher,
    ShardName,
    list_shards,
    list_shards_and_ages,
    read_positions,
    read_shard,
    shard_age,
)
from areal_jax.data.trajectory import Trajectory

logger = logging.getLogger(__name__)

Position = tuple[str, int]


@dataclasses.dataclass(frozen=True)
class PipelineConfig(Config):
    """Grouping, batching, the staleness bound, prefetch depth and how the log is tailed."""

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
    prefetch_batches: int = option(2, ge=0, doc="batches prepared ahead in a background thread; 0 = none")
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


# -- source: tail the rollout log -------------------------------------------------------------------


class RolloutLogDataset(grain.IterDataset):
    """The committed records of a rollout-log directory, in shard order, as `LogEntry`s (see module doc)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        config: PipelineConfig,
        *,
        process_index: int = 0,
        process_count: int = 1,
        stop_event: threading.Event | None = None,
        writers_done: threading.Event | None = None,
    ):
        super().__init__()
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} outside [0, process_count={process_count})")
        self.directory = os.fspath(directory)
        self.config = config
        self.process_index = process_index
        self.process_count = process_count
        self.stop_event = stop_event
        self.writers_done = writers_done

    def __iter__(self) -> RolloutLogIterator:
        return RolloutLogIterator(self)

    def __str__(self) -> str:
        return f"RolloutLogDataset({self.directory}, process {self.process_index}/{self.process_count})"


class RolloutLogIterator(grain.DatasetIterator):
    """Reads one shard at a time; waits for new shards with a bounded exponential backoff."""

    def __init__(self, dataset: RolloutLogDataset):
        super().__init__()
        self._ds = dataset
        self._wake = threading.Event()
        self._next_shard: dict[str, int] = {}
        self._shard: ShardName | None = None
        self._record = 0
        self._entries: collections.deque[LogEntry] = collections.deque()
        self._problems = 0
        self._pending: dict[str, collections.deque[ShardName]] = {}  # from the last directory listing
        self._ages: dict[str, int] | None = None  # shard name -> commit time, from a gs:// listing
        self._gap_since: dict[str, float] = {}
        self._fetcher = ShardFetcher(dataset.directory)  # on gs://: the next shards download meanwhile

    @property
    def problems(self) -> int:
        """Unreadable shards and records skipped so far."""
        return self._problems

    def interrupt(self) -> None:
        """End the iteration: a waiting or later `__next__` raises StopIteration."""
        self._wake.set()

    def close(self) -> None:
        self.interrupt()
        self._fetcher.close()
        super().close()

    def __next__(self) -> LogEntry:
        while True:
            while self._entries:
                entry = self._entries.popleft()
                self._record = entry.index + 1
                if entry.trajectory.group_id % self._ds.process_count == self._ds.process_index:
                    return entry
            if self._shard is not None:
                self._next_shard[self._shard.writer_id] = self._shard.shard_seq + 1
                self._shard, self._record = None, 0
            self._open(self._wait_for_shard(), start=0)

    def _open(self, shard: ShardName, start: int) -> None:
        entries, problems = self._fetcher.read(shard, start)
        self._problems += len(problems)
        self._shard, self._record = shard, start
        self._entries = collections.deque(entries)

    def _stopped(self) -> bool:
        return self._wake.is_set() or (self._ds.stop_event is not None and self._ds.stop_event.is_set())

    def _wait_for_shard(self) -> ShardName:
        config = self._ds.config
        delay = config.poll_initial_s
        idle_since = time.monotonic()
        while True:
            if self._stopped():
                raise StopIteration
            # read before listing: a shard committed before the writers finished is in this listing
            writers_done = self._ds.writers_done is not None and self._ds.writers_done.is_set()
            shard = self._pick()
            if shard is None:
                self._refresh()
                shard = self._pick()
            if shard is not None:
                return shard
            if writers_done:
                raise StopIteration  # every shard there will ever be has been read
            waited = time.monotonic() - idle_since
            if config.idle_timeout_s is not None and waited >= config.idle_timeout_s:
                logger.info("no new rollout-log shard in %s for %.1f s; ending", self._ds.directory, waited)
                raise StopIteration
            remaining = float("inf") if config.idle_timeout_s is None else config.idle_timeout_s - waited
            self._wake.wait(min(delay, remaining))
            delay = min(2 * delay, config.poll_max_s)

    def _refresh(self) -> None:
        """List the directory: per writer, its committed shards not yet consumed, in sequence order."""
        pending: dict[str, collections.deque[ShardName]] = {}
        shards, self._ages = list_shards_and_ages(self._ds.directory)
        for shard in shards:
            if shard.shard_seq >= self._next_shard.get(shard.writer_id, 0):
                pending.setdefault(shard.writer_id, collections.deque()).append(shard)
        self._pending = pending
        self._prefetch()

    def _prefetch(self) -> None:
        """Start fetching the shards read next: each writer's next, then each one's second, ..."""
        rounds = itertools.zip_longest(*self._pending.values())
        self._fetcher.prefetch(shard for round_ in rounds for shard in round_ if shard is not None)

    def _pick(self) -> ShardName | None:
        """The next shard from the last listing: each writer's next in sequence, the oldest file among them
        first. A writer whose next shard stays missing for `gap_timeout_s` is skipped ahead (reported)."""
        candidates = []
        now = time.monotonic()
        for writer, queue in self._pending.items():
            expected = self._next_shard.get(writer, 0)
            while queue and queue[0].shard_seq < expected:
                queue.popleft()
            if not queue:
                continue
            head = queue[0]
            if head.shard_seq != expected:
                if now - self._gap_since.setdefault(writer, now) < self._ds.config.gap_timeout_s:
                    continue
                problem = ReadProblem(
                    head.name, None, f"shards {expected}..{head.shard_seq - 1} of writer {writer} are missing"
                )
                logger.error("rollout log %s: %s; skipping ahead", self._ds.directory, problem)
                self._problems += 1
                self._next_shard[writer] = head.shard_seq
            self._gap_since.pop(writer, None)
            candidates.append(head)
        if not candidates:
            return None

        chosen = min(candidates, key=lambda shard: (shard_age(self._ds.directory, shard.name, self._ages), shard.name))
        self._pending[chosen.writer_id].popleft()
        self._prefetch()
        return chosen

    def get_state(self) -> dict[str, Any]:
        return {
            "next_shard": dict(self._next_shard),
            "shard": None if self._shard is None else self._shard.name,
            "record": self._record,
            "problems": self._problems,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self._next_shard = {str(k): int(v) for k, v in state["next_shard"].items()}
        self._problems = int(state["problems"])
        self._shard, self._record, self._entries = None, 0, collections.deque()
        self._pending, self._gap_since = {}, {}
        if state["shard"] is not None:
            shard = ShardName.parse(state["shard"])
            if shard is None:
                raise ValueError(f"iterator state names {state['shard']!r}, which is not a rollout-log shard")
            self._open(shard, start=int(state["record"]))

    def __str__(self) -> str:
        return f"RolloutLogIterator({self._ds.directory})"


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


@dataclasses.dataclass
class _OpenGroup:
    entries: list[LogEntry] = dataclasses.field(default_factory=list)
    dropped: list[int] = dataclasses.field(default_factory=list)

    def seen(self) -> set[int]:
        return {e.trajectory.sample_index for e in self.entries} | set(self.dropped)


class GroupDataset(grain.IterDataset):
    """Whole groups (a list of trajectories sorted by sample index) out of checked entries in any order.

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
        self._counts = {"emitted": 0, "dropped_groups": 0, "duplicates": 0, "evicted": 0}

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
            if trajectory.sample_index in group.seen():
                self._counts["duplicates"] += 1
                logger.warning(
                    "ignoring a duplicate of sample %d of group %s at %s",
                    trajectory.sample_index,
                    key,
                    checked.entry.position,
                )
                continue
            if checked.kept:
                group.entries.append(checked.entry)
            else:
                group.dropped.append(trajectory.sample_index)
            if len(group.entries) + len(group.dropped) < self._ds.group_size:
                continue
            del self._open[key]
            if len(group.entries) >= self._ds.min_group_size:
                self._counts["emitted"] += 1
                return sorted((e.trajectory for e in group.entries), key=lambda t: t.sample_index)
            self._counts["dropped_groups"] += 1

    def _evict_if_full(self) -> None:
        while len(self._open) > self._ds.max_pending_groups:
            key, group = self._open.popitem(last=False)
            self._counts["evicted"] += 1
            logger.warning(
                "dropping incomplete group %s (%d of %d samples seen): more than %d groups are open",
                key,
                len(group.entries) + len(group.dropped),
                self._ds.group_size,
                self._ds.max_pending_groups,
            )

    def get_state(self) -> dict[str, Any]:
        return {
            "parent": self._parent.get_state(),
            "open_groups": [
                [prompt_id, group_id, [list(e.position) for e in group.entries], list(group.dropped)]
                for (prompt_id, group_id), group in self._open.items()
            ],
            **self._counts,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._counts = {key: int(state[key]) for key in self._counts}
        positions = [(str(name), int(index)) for _, _, entries, _ in state["open_groups"] for name, index in entries]
        fetched = iter(self._ds.fetch(positions))
        self._open = collections.OrderedDict()
        for prompt_id, group_id, entries, dropped in state["open_groups"]:
            self._open[(str(prompt_id), int(group_id))] = _OpenGroup(
                entries=[next(fetched) for _ in entries], dropped=[int(i) for i in dropped]
            )


# -- prefetch that can wake a waiting source -----------------------------------------------------


def _sources(iterator: Any) -> Iterator[RolloutLogIterator]:
    if isinstance(iterator, RolloutLogIterator):
        yield iterator
    for parent in getattr(iterator, "_parents", ()):
        yield from _sources(parent)


class _TailPrefetchIterator(ThreadPrefetchDatasetIterator):
    """Grain's thread prefetch; closing it first wakes the log source so the prefetch thread can exit."""

    def close(self) -> None:
        for source in _sources(self):
            source.interrupt()
        super().close()


class TailPrefetchDataset(ThreadPrefetchIterDataset):
    """`ThreadPrefetchIterDataset` whose iterator can be closed while its source waits for new shards."""

    def __iter__(self) -> grain.DatasetIterator:
        return _TailPrefetchIterator(self._parent.__iter__(), self._prefetch_buffer_size)


# -- the whole pipeline --------------------------------------------------------------------------


def build_pipeline(
    directory: str | os.PathLike[str],
    config: PipelineConfig,
    *,
    trainer_version: Callable[[], int] | None = None,
    batch_fn: Callable[[list[Trajectory]], Any] | None = None,
    process_index: int = 0,
    process_count: int = 1,
    stop_event: threading.Event | None = None,
    writers_done: threading.Event | None = None,
) -> grain.IterDataset:
    """The pipeline of the module docstring over the rollout log in `directory`.

    Each element is a list of `groups_per_batch * group_size` trajectories or fewer (a group may have lost
    stale samples, and the last batch before the stream ends may hold fewer groups), passed through
    `batch_fn` if given. `trainer_version` is required when `config.max_staleness` is set; with prefetch it
    is called from the prefetch thread, so it must be thread-safe (reading an int attribute is).
    """
    if config.group_size is None or config.groups_per_batch is None:
        raise ValueError(f"the pipeline needs group_size and groups_per_batch, got {config}")
    source = RolloutLogDataset(
        directory,
        config,
        process_index=process_index,
        process_count=process_count,
        stop_event=stop_event,
        writers_done=writers_done,
    )
    checked = StalenessFilterDataset(source, config.max_staleness, trainer_version)
    groups = GroupDataset(
        checked,
        config.group_size,
        config.min_group_size or config.group_size,
        config.max_pending_groups,
        lambda positions: read_positions(directory, positions),
    )
    batches = groups.batch(config.groups_per_batch, batch_fn=lambda gs: [t for g in gs for t in g])
    if batch_fn is not None:
        batches = batches.map(batch_fn)
    if config.prefetch_batches > 0:
        batches = TailPrefetchDataset(batches, prefetch_buffer_size=config.prefetch_batches)
    return batches


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
        **{key: _find(state, key) or 0 for key in ("emitted", "dropped_groups", "evicted", "duplicates")},
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
        storage.move(storage.join(directory, shard.name), storage.join(into, shard.name))
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

"""The trainer pipeline's source: the records of a rollout-log directory as they are committed.

`RolloutLogDataset` tails the directory: it reads committed shards as they appear, each writer's in commit
order (the oldest file first among the writers' next shards), and waits for new ones with a bounded
exponential backoff (`poll_initial_s` doubling up to `poll_max_s`; never a busy loop). A writer's shard
that stays missing for `gap_timeout_s` is skipped and reported. It lists the whole directory once, when it
starts or is restored; after that a refresh asks only for what each writer committed since
(`rollout_log_index.ShardFeed`), so its cost does not grow with the shards already read. On gs:// the next
shards download in the background (`ShardFetcher`). Its state is, per writer, the next shard to read, and
the current shard and the index of its next unread record.

Stopping. An iterator ends (StopIteration) when `stop_event` is set (checked at least every
`poll_max_s`), once `writers_done` is set and no unread shard is left (the writers finished: the stream
ends after their last shard), after `idle_timeout_s` without a new shard, or when it is interrupted or
closed.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
from typing import Any, Protocol

import grain

from areal_jax.data.rollout_log_index import ShardFeed
from areal_jax.data.rollout_log_reader import LogEntry, ReadProblem, ShardFetcher
from areal_jax.data.rollout_log_shards import ShardName, list_shards_and_ages, shard_age

logger = logging.getLogger(__name__)


class TailSettings(Protocol):
    """How the log is tailed (the pipeline passes its `PipelineConfig`); read-only, so a frozen config fits."""

    @property
    def poll_initial_s(self) -> float: ...

    @property
    def poll_max_s(self) -> float: ...

    @property
    def idle_timeout_s(self) -> float | None: ...

    @property
    def gap_timeout_s(self) -> float: ...


class StopFlag(Protocol):
    """A `threading.Event`, or anything else that says whether a stop was asked (the trainer's `StopControl`)."""

    def is_set(self) -> bool: ...


class RolloutLogDataset(grain.IterDataset):
    """The committed records of a rollout-log directory, in shard order, as `LogEntry`s (see module doc)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        config: TailSettings,
        *,
        stop_event: StopFlag | None = None,
        writers_done: threading.Event | None = None,
    ):
        super().__init__()
        self.directory = os.fspath(directory)
        self.config = config
        self.stop_event = stop_event
        self.writers_done = writers_done

    def __iter__(self) -> RolloutLogIterator:
        return RolloutLogIterator(self)

    def __str__(self) -> str:
        return f"RolloutLogDataset({self.directory})"


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
        self._pending: dict[str, collections.deque[ShardName]] = {}  # found, not picked yet
        self._ages: dict[str, int] = {}  # pending shard's name -> commit time, from a gs:// listing
        self._feed = ShardFeed(self._ds.directory)
        self._listed = False  # whether the whole directory was listed since the start or the last restore
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
        self._feed.close()
        super().close()

    def __next__(self) -> LogEntry:
        while True:
            while self._entries:
                entry = self._entries.popleft()
                self._record = entry.index + 1
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
        """Add to each writer's pending shards those committed after them, in sequence order: after a start
        or a restore from a listing of the whole directory (and every journal read whole), then only from
        what the feed finds new."""
        if not self._listed:
            self._feed.reset()
            self._pending, self._ages = {}, {}
            self._add(*list_shards_and_ages(self._ds.directory))
            self._listed = True
        self._add(*self._feed.poll(self._known()))
        self._prefetch()

    def _add(self, shards: list[ShardName], ages: dict[str, int] | None) -> None:
        known = self._known()
        for shard in shards:
            if shard.shard_seq >= known.get(shard.writer_id, 0):
                self._pending.setdefault(shard.writer_id, collections.deque()).append(shard)
                known[shard.writer_id] = shard.shard_seq + 1
                if ages is not None and shard.name in ages:
                    self._ages[shard.name] = ages[shard.name]

    def _known(self) -> dict[str, int]:
        """Per writer, the first shard number neither consumed nor pending."""
        known = dict(self._next_shard)
        for writer, queue in self._pending.items():
            if queue:
                known[writer] = max(known.get(writer, 0), queue[-1].shard_seq + 1)
        return known

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
        self._ages.pop(chosen.name, None)
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
        self._pending, self._gap_since, self._listed = {}, {}, False
        if state["shard"] is not None:
            shard = ShardName.parse(state["shard"])
            if shard is None:
                raise ValueError(f"iterator state names {state['shard']!r}, which is not a rollout-log shard")
            self._open(shard, start=int(state["record"]))

    def __str__(self) -> str:
        return f"RolloutLogIterator({self._ds.directory})"

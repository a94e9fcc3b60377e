"""How a tailing reader finds new rollout-log shards (`rollout_log_index`): the writers' journals on a local
disk, bounded per-writer listings on gs://, and a refresh whose cost does not grow with the shards read."""

from __future__ import annotations

import os
import statistics
import time
import uuid
from pathlib import Path

import pytest

from areal_jax import storage
from areal_jax.data import rollout_log_index
from areal_jax.data.pipeline import PipelineConfig
from areal_jax.data.rollout_log import RolloutLogConfig, RolloutLogWriter
from areal_jax.data.rollout_log_index import WRITERS_DIR, ShardFeed, WriterJournal
from areal_jax.data.rollout_log_shards import ShardName, shard_location
from areal_jax.data.rollout_log_tail import RolloutLogDataset
from tests.gcs_emulator import BUCKET, GcsEmulator
from tests.rollout_log_worker import make_trajectory

FAST = PipelineConfig(poll_initial_s=0.005, poll_max_s=0.02, idle_timeout_s=0.3)


def _commit(writer: RolloutLogWriter, group: int) -> ShardName:
    writer.append(make_trajectory(group))
    shard = writer.flush()
    assert shard is not None
    return shard


def test_a_tailing_reader_finds_new_shards_new_writers_and_restarted_ones(tmp_path: Path) -> None:
    iterator = iter(RolloutLogDataset(tmp_path, FAST))
    a = RolloutLogWriter(tmp_path, "a")
    _commit(a, 0)
    entry = next(iterator)  # the first refresh lists the directory
    assert (entry.writer_id, entry.seq) == ("a", 0)
    _commit(a, 1)
    b = RolloutLogWriter(tmp_path, "b")  # a writer that appeared after the reader started
    _commit(b, 2)
    _commit(b, 3)
    got = {(e.writer_id, e.seq) for e in (next(iterator), next(iterator), next(iterator))}
    assert got == {("a", 1), ("b", 0), ("b", 1)}
    assert (tmp_path / WRITERS_DIR / "a").read_text().split() == [
        ShardName("a", 0, 0, 1).name,
        ShardName("a", 1, 1, 1).name,
    ]

    # a crash after announcing a shard and before linking it: the line stays, the shard never appears
    a._journal.announce(ShardName("a", 2, 2, 5))
    with open(tmp_path / WRITERS_DIR / "a", "ab") as journal:
        journal.write(b"a_00000003_000000")  # and half of a next line
    _commit(b, 4)
    assert (next(iterator).writer_id, iterator.get_state()["next_shard"]) == ("b", {"a": 2, "b": 2})
    again = RolloutLogWriter(tmp_path, "a")  # restarted: the journal is rewritten from the committed shards
    assert (tmp_path / WRITERS_DIR / "a").read_text().split() == [
        ShardName("a", 0, 0, 1).name,
        ShardName("a", 1, 1, 1).name,
    ]
    assert _commit(again, 5) == ShardName("a", 2, 2, 1)
    assert [(e.writer_id, e.seq) for e in iterator] == [("a", 2)]
    assert iterator.problems == 0


def test_a_feed_returns_each_writers_shards_in_order_from_the_asked_number(tmp_path: Path) -> None:
    with RolloutLogWriter(tmp_path, "w") as writer:
        shards = [_commit(writer, group) for group in range(5)]
    feed = ShardFeed(str(tmp_path))
    assert feed.poll({"w": 2}) == (shards[2:], None)
    assert feed.poll({"w": 2}) == ([], None)  # read already: only new lines count
    feed.reset()
    assert feed.poll({"w": 4}) == (shards[4:], None)
    os.unlink(shard_location(tmp_path, shards[2].name))  # not there (yet): the later names wait behind it
    feed.reset()
    assert feed.poll({}) == (shards[:2], None)


def _fill_log(log: Path, shards_per_writer: int, writers: list[str]) -> None:
    """Committed shards as a writer leaves them, named and journaled, with no records in them (cheap to make:
    the reader's refresh only lists and stats them)."""
    log.mkdir()
    for writer in writers:
        shards = [ShardName(writer, seq, seq, 1) for seq in range(shards_per_writer)]
        for shard in shards:
            (log / shard.name).touch()
        WriterJournal(str(log), writer, shards, fsync=False)


def test_a_refresh_does_not_grow_with_the_shards_already_consumed(tmp_path: Path, monkeypatch) -> None:
    writers = ["w0", "w1", "w2", "w3"]
    listed: list[int] = []
    listdir = os.listdir

    def counting_listdir(path):
        names = listdir(path)
        listed.append(len(names))
        return names

    def measure(total: int) -> tuple[int, float]:
        """Names listed by, and the median time of, one refresh of a reader that consumed `total` shards;
        then a new shard still reaches it."""
        log = tmp_path / str(total)
        _fill_log(log, total // len(writers), writers)
        iterator = iter(RolloutLogDataset(log, FAST))
        consumed = {writer: total // len(writers) for writer in writers}
        iterator.set_state({"next_shard": consumed, "shard": None, "record": 0, "problems": 0})
        iterator._refresh()  # a restored reader lists the whole directory once
        monkeypatch.setattr(os, "listdir", counting_listdir)
        listed.clear()
        iterator._refresh()
        names = sum(listed)
        times = []
        for _ in range(200):
            started = time.perf_counter()
            iterator._refresh()
            times.append(time.perf_counter() - started)
        monkeypatch.setattr(os, "listdir", listdir)
        with RolloutLogWriter(log, "w2", config=RolloutLogConfig(fsync=False)) as writer:
            assert _commit(writer, 7).shard_seq == total // len(writers)
        entry = next(iterator)
        assert (entry.writer_id, entry.seq) == ("w2", total // len(writers))
        return names, statistics.median(times)

    small_names, small_time = measure(100)
    big_names, big_time = measure(20_000)
    assert small_names == big_names == len(writers)  # the registry's names; no shard name is listed
    assert big_time < 4 * small_time + 0.001, (big_time, small_time)


def test_a_gcs_feed_lists_only_each_writers_block_of_new_shards(gcs: GcsEmulator, monkeypatch) -> None:
    log = f"gs://{BUCKET}/{uuid.uuid4().hex}/rollout_log"
    WriterJournal(log, "w", [], fsync=False)
    shards = [ShardName("w", seq, seq, 1) for seq in range(205)]
    for shard in shards:
        storage.write_atomic(shard_location(log, shard.name), b"")
    calls: list[tuple[str, int]] = []
    list_remote = rollout_log_index.list_remote

    def counting(directory: str, prefix: str, start: str) -> dict[str, int]:
        found = list_remote(directory, prefix, start)
        calls.append((prefix, len(found)))
        return found

    monkeypatch.setattr(rollout_log_index, "list_remote", counting)
    feed = ShardFeed(log)
    try:
        found, ages = feed.poll({"w": 150})
        assert found == shards[150:] and set(ages) == {s.name for s in shards[150:]}
        assert calls == [("w_000001", 50), ("w_000002", 5)]  # the full block 1..., then block 2...
        calls.clear()
        assert feed.poll({"w": 205}) == ([], {})
        assert calls == [("w_000002", 0)]
        calls.clear()
        WriterJournal(log, "v", [], fsync=False)  # a new writer, and one only the reader knew of
        storage.write_atomic(shard_location(log, ShardName("v", 0, 0, 2).name), b"")
        found, _ = feed.poll({"w": 205, "old": 3})
        assert found == [ShardName("v", 0, 0, 2)]
        assert sorted(calls) == [("old_000000", 0), ("v_000000", 1), ("w_000002", 0)]
    finally:
        feed.close()


@pytest.mark.parametrize("remote", [False, True])
def test_a_reader_tails_writers_through_the_feed(remote: bool, tmp_path: Path, request) -> None:
    log = f"gs://{BUCKET}/{uuid.uuid4().hex}/rollout_log" if remote else str(tmp_path)
    if remote:
        request.getfixturevalue("gcs")
    first = RolloutLogWriter(log, "first")
    _commit(first, 0)
    iterator = iter(RolloutLogDataset(log, FAST))
    assert next(iterator).seq == 0
    second = RolloutLogWriter(log, "second")
    for group in range(1, 4):
        _commit(first, group)
        _commit(second, 10 + group)
    got = sorted((e.writer_id, e.seq) for e in iterator)
    assert got == [("first", 1), ("first", 2), ("first", 3), ("second", 0), ("second", 1), ("second", 2)]
    iterator.close()

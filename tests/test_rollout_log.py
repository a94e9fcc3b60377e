"""Rollout log: record format, atomic shard commits on flush, restarts, concurrent writers, corruption."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from areal_jax.data.pipeline import PipelineConfig
from areal_jax.data.rollout_log import RolloutLogWriter
from areal_jax.data.rollout_log_reader import read_positions, read_shard
from areal_jax.data.rollout_log_records import LOG_FORMAT_VERSION, RecordFormatError, decode_record, encode_record
from areal_jax.data.rollout_log_shards import TMP_PREFIX, ShardName, list_shards
from areal_jax.data.rollout_log_tail import RolloutLogDataset
from areal_jax.data.trajectory import SCHEMA_VERSION
from tests.rollout_log_worker import append_in_shards, make_trajectory

ROOT = Path(__file__).resolve().parents[1]


def assert_same_trajectory(a, b) -> None:
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype, field.name
            np.testing.assert_array_equal(x, y, err_msg=field.name)
        else:
            assert x == y, field.name


def test_record_roundtrip_keeps_every_field() -> None:
    t = make_trajectory(7, 3, version=5, metadata={"turns": 2, "tags": ["a", "b"], "score": np.float32(0.5)})
    writer, seq, appended_at, back = decode_record(encode_record(t, "w0", 41, 123.5))
    assert (writer, seq, appended_at) == ("w0", 41, 123.5)
    assert back.schema_version == SCHEMA_VERSION
    assert back.metadata["score"] == 0.5
    assert_same_trajectory(dataclasses.replace(t, metadata={**t.metadata, "score": 0.5}), back)


def test_sequence_fields_roundtrip_and_a_schema_1_record_is_one_sequence() -> None:
    import msgpack

    t = dataclasses.replace(make_trajectory(2, 1), sequence_index=1, num_sequences=3)
    assert_same_trajectory(t, decode_record(encode_record(t, "w", 0, 0.0))[3])
    data = msgpack.unpackb(encode_record(make_trajectory(2, 1), "w", 0, 0.0), raw=False)
    old = {k: v for k, v in data.items() if k not in ("sequence_index", "num_sequences")} | {"schema_version": 1}
    back = decode_record(msgpack.packb(old, use_bin_type=True))[3]
    assert (back.sequence_index, back.num_sequences, back.schema_version) == (0, 1, 1)
    with pytest.raises(ValueError, match="sequence_index 3 outside"):
        dataclasses.replace(t, sequence_index=3)


def test_newer_format_or_schema_is_refused() -> None:
    import msgpack

    data = msgpack.unpackb(encode_record(make_trajectory(1), "w", 0, 0.0), raw=False)
    with pytest.raises(RecordFormatError, match="format"):
        decode_record(msgpack.packb({**data, "format": LOG_FORMAT_VERSION + 1}, use_bin_type=True))
    with pytest.raises(RecordFormatError, match="schema"):
        decode_record(msgpack.packb({**data, "schema_version": SCHEMA_VERSION + 1}, use_bin_type=True))


def test_shard_names_parse_and_sort_in_commit_order() -> None:
    shards = [ShardName("w-1", s, 10 * s, 10) for s in (10, 2, 0, 1)]
    names = sorted(s.name for s in shards)
    assert [ShardName.parse(n).shard_seq for n in names] == [0, 1, 2, 10]
    assert ShardName.parse(".tmp-w-1_00000003_abc.arrayrecord") is None
    assert ShardName.parse("notes.txt") is None


def test_commits_on_flush_and_close_and_sequence_numbers(tmp_path: Path) -> None:
    writer = RolloutLogWriter(tmp_path, "w0")
    seqs = [writer.append(make_trajectory(i)) for i in range(3)]
    assert seqs == [0, 1, 2] and writer.buffered == 3 and list_shards(tmp_path) == []  # nothing visible yet
    assert writer.flush() == ShardName("w0", 0, 0, 3)
    assert writer.flush() is None  # nothing buffered
    append_in_shards(writer, (make_trajectory(i) for i in range(3, 9)), 4)
    assert writer.buffered == 2
    writer.close()  # commits the rest
    assert [(s.shard_seq, s.first_record, s.num_records) for s in list_shards(tmp_path)] == [
        (0, 0, 3),
        (1, 3, 4),
        (2, 7, 2),
    ]
    with pytest.raises(ValueError, match="closed"):
        writer.append(make_trajectory(9))
    assert not [p for p in os.listdir(tmp_path) if p.startswith(TMP_PREFIX)]
    entries = [e for s in list_shards(tmp_path) for e in read_shard(tmp_path, s)[0]]
    assert [e.seq for e in entries] == list(range(9))
    assert [e.trajectory.group_id for e in entries] == list(range(9))


def test_restarted_writer_continues_and_cleans_up(tmp_path: Path) -> None:
    with RolloutLogWriter(tmp_path, "w0") as writer:
        append_in_shards(writer, (make_trajectory(i) for i in range(5)), 2)
    stale = tmp_path / f"{TMP_PREFIX}w0_00000009_dead.arrayrecord"
    stale.write_bytes(b"half a shard")
    other = tmp_path / f"{TMP_PREFIX}w0-b_00000000_beef.arrayrecord"  # writer "w0-b" may be live
    other.write_bytes(b"another writer's")
    writer = RolloutLogWriter(tmp_path, "w0")
    assert not stale.exists() and other.exists()
    assert writer.next_record_seq == 5
    writer.append(make_trajectory(5))
    assert writer.flush() == ShardName("w0", 3, 5, 1)


def test_a_second_live_writer_with_the_same_id_is_refused(tmp_path: Path) -> None:
    a = RolloutLogWriter(tmp_path, "same")
    b = RolloutLogWriter(tmp_path, "same")
    a.append(make_trajectory(0))
    b.append(make_trajectory(1))
    a.flush()
    with pytest.raises(FileExistsError, match="same"):
        b.flush()


def test_bad_writer_ids_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="a_b"):
        RolloutLogWriter(tmp_path, "a_b")


def test_read_positions_returns_records_in_the_asked_order(tmp_path: Path) -> None:
    with RolloutLogWriter(tmp_path, "w0") as writer:
        append_in_shards(writer, (make_trajectory(i) for i in range(7)), 3)
    entries = [e for s in list_shards(tmp_path) for e in read_shard(tmp_path, s)[0]]
    wanted = [entries[5].position, entries[0].position, entries[3].position]
    assert [e.seq for e in read_positions(tmp_path, wanted)] == [5, 0, 3]


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_truncated_and_corrupted_shards_are_reported_and_skipped(tmp_path: Path, caplog) -> None:
    with RolloutLogWriter(tmp_path, "w0") as writer:  # ~3 KB of incompressible tokens per record
        append_in_shards(writer, (make_trajectory(i, length=400) for i in range(40)), 10)
    shards = list_shards(tmp_path)
    assert len(shards) == 4
    truncated, corrupted = tmp_path / shards[1].name, tmp_path / shards[2].name
    truncated.write_bytes(truncated.read_bytes()[:-1000])  # the footer and index are lost
    _flip_byte(corrupted, 4000)  # inside the chunk of the second record

    entries, problems = read_shard(tmp_path, shards[1])
    assert entries == [] and len(problems) == 1
    assert problems[0].shard == shards[1].name and problems[0].index is None
    entries, problems = read_shard(tmp_path, shards[2])
    assert len(entries) == 9 and len(problems) == 1
    assert problems[0].shard == shards[2].name and problems[0].index is not None
    assert "hash mismatch" in problems[0].reason
    lost = shards[2].first_record + problems[0].index

    caplog.set_level(logging.WARNING, logger="areal_jax.data.rollout_log_reader")
    config = PipelineConfig(idle_timeout_s=0.3, poll_max_s=0.1)
    iterator = iter(RolloutLogDataset(tmp_path, config))
    seqs = [e.seq for e in iterator]
    assert seqs == [s for s in range(40) if not 10 <= s < 20 and s != lost]
    assert iterator.problems == 2
    logged = caplog.text
    assert shards[1].name in logged and "not a readable ArrayRecord file" in logged
    assert shards[2].name in logged and "hash mismatch" in logged


def test_garbage_under_a_shard_name_is_skipped(tmp_path: Path) -> None:
    with RolloutLogWriter(tmp_path, "w0") as writer:
        writer.append(make_trajectory(0))
    (tmp_path / ShardName("w1", 0, 0, 3).name).write_bytes(os.urandom(3000))
    (tmp_path / ShardName("w0", 1, 1, 1).name).write_bytes(b"")
    config = PipelineConfig(idle_timeout_s=0.3, poll_max_s=0.1)
    iterator = iter(RolloutLogDataset(tmp_path, config))
    assert [e.seq for e in iterator] == [0]
    assert iterator.problems == 2


@pytest.mark.multiprocess
def test_two_writer_processes_and_a_tailing_reader(tmp_path: Path) -> None:
    count = 300
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = str(ROOT / "tests" / "rollout_log_worker.py")
    stop = threading.Event()
    config = PipelineConfig(poll_initial_s=0.005, poll_max_s=0.05, idle_timeout_s=60.0)
    iterator = iter(RolloutLogDataset(tmp_path, config, stop_event=stop))
    procs = [
        subprocess.Popen([sys.executable, script, str(tmp_path), writer, str(count), str(seed)], env=env)
        for seed, writer in enumerate(("alpha", "beta"))
    ]
    seen: dict[str, list[int]] = {"alpha": [], "beta": []}
    for entry in iterator:
        seen[entry.writer_id].append(entry.seq)
        assert entry.trajectory.metadata == {"writer": entry.writer_id, "i": entry.seq}
        if sum(map(len, seen.values())) == 2 * count:
            break
    for proc in procs:
        assert proc.wait(timeout=60) == 0
    stop.set()
    assert seen == {"alpha": list(range(count)), "beta": list(range(count))}
    assert next(iterator, None) is None


def test_a_missing_shard_is_waited_for_then_skipped_and_reported(tmp_path: Path, caplog) -> None:
    with RolloutLogWriter(tmp_path, "w0") as writer:
        append_in_shards(writer, (make_trajectory(i) for i in range(6)), 2)
    (tmp_path / list_shards(tmp_path)[1].name).unlink()
    config = PipelineConfig(idle_timeout_s=0.6, poll_max_s=0.05, gap_timeout_s=0.2)
    iterator = iter(RolloutLogDataset(tmp_path, config))
    assert [e.seq for e in iterator] == [0, 1, 4, 5]
    assert iterator.problems == 1
    assert "shards 1..1 of writer w0 are missing" in caplog.text


def test_writer_ids_name_their_server_and_never_repeat(tmp_path):
    from areal_jax.data.rollout_log import new_writer_id

    ids = {new_writer_id(3) for _ in range(50)}
    assert len(ids) == 50 and all(i.startswith("rollout3-") and i.endswith(f"-{os.getpid()}") for i in ids)
    with RolloutLogWriter(tmp_path, next(iter(ids))):  # a valid id for the log's names
        pass

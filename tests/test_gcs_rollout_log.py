"""The rollout log and its Grain pipeline on a gs:// directory (a local GCS server, tests/gcs_emulator.py):
the same shards, order, resume position and set-aside as on a local disk."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid

import pytest

from areal_jax import storage
from areal_jax.data.pipeline import PipelineConfig, build_pipeline, set_aside_unread
from areal_jax.data.rollout_log import RolloutLogWriter
from areal_jax.data.rollout_log_index import WRITERS_DIR
from areal_jax.data.rollout_log_reader import (
    SCRATCH_PREFIX,
    ShardFetcher,
    logged_groups,
    read_positions,
    read_shard,
)
from areal_jax.data.rollout_log_shards import list_shards
from tests.gcs_emulator import BUCKET, GcsEmulator
from tests.rollout_log_worker import append_in_shards, make_trajectory

FAST = {"poll_initial_s": 0.005, "poll_max_s": 0.05, "idle_timeout_s": 0.3}


def _directory() -> str:
    return f"gs://{BUCKET}/{uuid.uuid4().hex}/rollout_log"


def test_shards_written_to_gcs_read_back_whole_and_in_order(gcs: GcsEmulator, tmp_path) -> None:
    log = _directory()
    with RolloutLogWriter(log, "w0") as writer:
        append_in_shards(writer, (make_trajectory(i // 2, i % 2) for i in range(7)), 3)
    shards = list_shards(log)
    assert [(s.shard_seq, s.first_record, s.num_records) for s in shards] == [(0, 0, 3), (1, 3, 3), (2, 6, 1)]
    entries = [e for s in shards for e in read_shard(log, s)[0]]
    assert [e.seq for e in entries] == list(range(7))
    assert [(e.trajectory.group_id, e.trajectory.sample_index) for e in entries] == [(i // 2, i % 2) for i in range(7)]
    assert [e.seq for e in read_positions(log, [entries[5].position, entries[1].position])] == [5, 1]
    assert logged_groups(log) == dict.fromkeys([0, 1, 2, 3], True)
    # nothing but committed shards and the writer's registry entry: the temporary files stayed on this host
    assert storage.names(log) == [WRITERS_DIR, *(s.name for s in shards)]
    assert storage.names(storage.join(log, WRITERS_DIR)) == ["w0"]

    # a restarted writer continues after its last shard; a second live writer of the same id is refused
    with RolloutLogWriter(log, "w0") as again:
        assert again.next_record_seq == 7
        again.append(make_trajectory(9, 0))
    stale = RolloutLogWriter(log, "w0")
    stale._next_shard = stale._next_record = 0  # a second writer that began before the others' shards
    for sample in range(3):
        stale.append(make_trajectory(10, sample))
    with pytest.raises(FileExistsError, match="another live writer"):
        stale.flush()
    assert [e.trajectory.group_id for e in read_shard(log, shards[0])[0]] == [0, 0, 1]  # not replaced


def test_pipeline_tails_a_gcs_log_and_a_resume_sets_the_unread_shards_aside(gcs: GcsEmulator) -> None:
    root = f"gs://{BUCKET}/{uuid.uuid4().hex}"
    log, aside_dir = storage.join(root, "rollout_log"), storage.join(root, "rollout_log_unused")
    with RolloutLogWriter(log, "w0") as writer:
        for group in range(4):
            writer.append(make_trajectory(group, 0))
            writer.append(make_trajectory(group, 1))
            writer.flush()
    config = PipelineConfig(group_size=2, groups_per_batch=1, **FAST)
    iterator = iter(build_pipeline(log, config))
    assert [t.group_id for t in next(iterator)] == [0, 0]
    state = iterator.get_state()
    assert [t.group_id for t in next(iterator)] == [1, 1]

    aside = set_aside_unread(log, state, aside_dir)
    assert (aside.shards, aside.records, aside.temporaries) == (3, 6, 0)
    assert [s.first_record for s in list_shards(aside_dir)] == [2, 4, 6]
    assert len(list_shards(log)) == 1
    restored = iter(build_pipeline(log, config.replace(idle_timeout_s=0.2)))
    restored.set_state(state)
    assert next(restored, None) is None


def test_a_reader_fetches_the_next_shards_from_the_bucket_in_the_background(
    gcs: GcsEmulator, tmp_path, monkeypatch
) -> None:
    log = _directory()
    with RolloutLogWriter(log, "w0") as writer:
        append_in_shards(writer, (make_trajectory(group, 0) for group in range(5)), 1)
    shards = list_shards(log)
    # download directories left by a reader that was killed (its process gone) and by one still running
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"{SCRATCH_PREFIX}{int(gone.stdout)}-abc"
    running = tmp_path / f"{SCRATCH_PREFIX}{os.getppid()}-def"
    for scratch_dir in (orphan, running):
        scratch_dir.mkdir()
        (scratch_dir / "shard.array_record").write_bytes(b"x")
    fetcher = ShardFetcher(log, ahead=3)
    fetcher.prefetch(shards)
    assert not orphan.exists() and running.is_dir()  # swept when the fetcher made its own
    fetcher.prefetch(shards)  # already fetching: nothing more
    assert sorted(fetcher._fetches) == [s.name for s in shards[:3]]
    downloads = {name: fetch.result() for name, fetch in fetcher._fetches.items()}
    for shard in shards:  # the first three from their downloads (deleted once read), the rest directly
        entries, problems = fetcher.read(shard)
        assert [e.trajectory.group_id for e in entries] == [shard.first_record] and not problems
    assert not any(path.exists() for path in downloads.values())
    scratch = fetcher._scratch
    assert scratch is not None and scratch.is_dir()
    fetcher.close()
    assert not scratch.exists()

    local = ShardFetcher("/nonexistent/local/log")
    local.prefetch(shards)  # a local log is read in place: nothing to fetch
    assert not local._fetches and local._pool is None

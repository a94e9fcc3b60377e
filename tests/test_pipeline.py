"""Grain pipeline over the rollout log: exact resume, staleness filter, group assembly, live tailing, stopping."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from areal_jax.configuration import ConfigError
from areal_jax.data.pipeline import PipelineConfig, build_pipeline, pipeline_stats, set_aside_unread, staleness_of
from areal_jax.data.rollout_log import RolloutLogWriter
from areal_jax.data.rollout_log_shards import list_shards
from tests.rollout_log_worker import make_trajectory

FAST = {"poll_initial_s": 0.005, "poll_max_s": 0.05, "idle_timeout_s": 0.3}


def write_groups(
    directory: Path,
    num_groups: int,
    group_size: int,
    *,
    writers: int = 2,
    versions: dict[int, int] | None = None,
    seed: int = 0,
) -> list[tuple[int, int]]:
    """All samples of `num_groups` groups, shuffled (so groups arrive out of order and split over shards and
    writers), appended by `writers` writers; returns the (group_id, sample_index) pairs in append order."""
    rng = np.random.default_rng(seed)
    samples = [(g, s) for g in range(num_groups) for s in range(group_size)]
    order = [samples[i] for i in rng.permutation(len(samples))]
    logs = [RolloutLogWriter(directory, f"w{k}") for k in range(writers)]
    for i, (g, s) in enumerate(order):
        log = logs[i % writers]
        log.append(make_trajectory(g, s, version=(versions or {}).get(g, 0)))
        if log.buffered == 5:  # shards of 5 records
            log.flush()
    for log in logs:
        log.close()
    return order


def keys(batch) -> list[tuple[int, int]]:
    return [(t.group_id, t.sample_index) for t in batch]


def assert_whole_groups(batch, group_size: int) -> None:
    for start in range(0, len(batch), group_size):
        group = batch[start : start + group_size]
        assert {t.group_id for t in group} == {group[0].group_id}
        assert [t.sample_index for t in group] == list(range(group_size))


def test_groups_are_assembled_from_out_of_order_arrivals(tmp_path: Path) -> None:
    write_groups(tmp_path, num_groups=12, group_size=4)
    config = PipelineConfig(group_size=4, groups_per_batch=3, **FAST)
    batches = list(build_pipeline(tmp_path, config))
    assert len(batches) == 4
    for batch in batches:
        assert len(batch) == 12
        assert_whole_groups(batch, 4)
    assert sorted(k for b in batches for k in keys(b)) == [(g, s) for g in range(12) for s in range(4)]


def test_get_state_set_state_resumes_exactly(tmp_path: Path) -> None:
    write_groups(tmp_path, num_groups=30, group_size=4)
    config = PipelineConfig(group_size=4, groups_per_batch=2, **FAST)
    dataset = build_pipeline(tmp_path, config)

    iterator = iter(dataset)
    first = [next(iterator) for _ in range(5)]
    state = json.loads(json.dumps(iterator.get_state()))  # the state is plain JSON
    iterator.close()
    assert any(state_open_groups(state)), "some groups should be incomplete at the save point"

    resumed = iter(dataset)
    resumed.set_state(state)
    rest = list(resumed)
    consumed = [k for b in first for k in keys(b)]
    remaining = [k for b in rest for k in keys(b)]
    assert not set(consumed) & set(remaining)
    assert sorted(consumed + remaining) == [(g, s) for g in range(30) for s in range(4)]
    for batch in first + rest:
        assert_whole_groups(batch, 4)

    again = iter(dataset)  # the same state twice gives the same stream
    again.set_state(state)
    assert [keys(b) for b in again] == [keys(b) for b in rest]


def state_open_groups(state: dict) -> list:
    """The incomplete groups recorded anywhere in a (nested) pipeline state."""
    if "open_groups" in state:
        return state["open_groups"]
    nested = [state_open_groups(value) for value in state.values() if isinstance(value, dict)]
    return next((found for found in nested if found), [])


def test_a_group_waits_for_every_sequence_of_its_episodes_and_resumes_between_them(tmp_path: Path) -> None:
    """Agent episodes trained as several sequences (`num_sequences`): group 0's sample 1 has 3 sequences, so the
    group is whole after 4 trajectories of 2 samples; a duplicate sequence is ignored; a state saved while
    group 1 has 2 of its 3 sequences resumes to the same group."""
    records = [(1, 1, 0, 1), (0, 0, 0, 1), (1, 0, 0, 2), (0, 1, 2, 3), (0, 1, 0, 3), (0, 1, 0, 3), (0, 1, 1, 3)]
    records.append((1, 0, 1, 2))
    log = RolloutLogWriter(tmp_path, "w0")
    for group, sample, sequence, of in records:
        trajectory = make_trajectory(group, sample, seed=sequence)
        log.append(dataclasses.replace(trajectory, sequence_index=sequence, num_sequences=of))
        log.flush()
    log.close()
    config = PipelineConfig(group_size=2, groups_per_batch=1, **FAST)

    def parts(batch):
        return [(t.group_id, t.sample_index, t.sequence_index) for t in batch]

    iterator = iter(build_pipeline(tmp_path, config))
    assert parts(next(iterator)) == [(0, 0, 0), (0, 1, 0), (0, 1, 1), (0, 1, 2)]
    state = json.loads(json.dumps(iterator.get_state()))
    assert [len(entries) for _, _, entries, _ in state_open_groups(state)] == [2]
    last = parts(next(iterator))
    assert last == [(1, 0, 0), (1, 0, 1), (1, 1, 0)]
    assert pipeline_stats(iterator.get_state())["duplicates"] == 1
    iterator.close()
    resumed = iter(build_pipeline(tmp_path, config))
    resumed.set_state(state)
    assert [parts(b) for b in resumed] == [last]

    bad = tmp_path / "bad"
    log = RolloutLogWriter(bad, "w0")
    for sequence, of in ((0, 2), (1, 3)):
        log.append(dataclasses.replace(make_trajectory(0, 0), sequence_index=sequence, num_sequences=of))
    log.close()
    with pytest.raises(ValueError, match="num_sequences 3, its other sequences 2"):
        list(build_pipeline(bad, config))


def test_staleness_filter_drops_the_right_samples_and_counts_them(tmp_path: Path) -> None:
    # make_trajectory(version=v) has oldest token version v - 1; trainer version 10, bound 2:
    # groups 0, 1 (staleness 2) and 2 (staleness 1) are kept, 3, 4 (staleness 3) and 5 (10) dropped
    versions = {0: 9, 1: 9, 2: 10, 3: 8, 4: 8, 5: 1}
    write_groups(tmp_path, num_groups=6, group_size=2, versions=versions)
    config = PipelineConfig(group_size=2, groups_per_batch=1, max_staleness=2, **FAST)
    iterator = iter(build_pipeline(tmp_path, config, trainer_version=lambda: 10))
    batches = list(iterator)
    assert sorted({t.group_id for b in batches for t in b}) == [0, 1, 2]
    stats = pipeline_stats(iterator.get_state())
    assert stats["kept_by_staleness"] == {1: 2, 2: 4}
    assert stats["dropped_by_staleness"] == {3: 4, 10: 2}
    assert stats["samples_kept"] == 6 and stats["samples_dropped"] == 6
    assert stats["emitted"] == 3 and stats["dropped_groups"] == 3


def test_partly_stale_group_is_emitted_only_above_min_group_size(tmp_path: Path) -> None:
    with RolloutLogWriter(tmp_path, "w0") as writer:
        for s in range(4):
            writer.append(make_trajectory(1, s, version=1 if s < 2 else 5))  # samples 0, 1 are stale
            writer.append(make_trajectory(0, s, version=5 if s else 1))  # sample 0 is stale
    config = PipelineConfig(group_size=4, groups_per_batch=1, max_staleness=1, min_group_size=3, **FAST)
    iterator = iter(build_pipeline(tmp_path, config, trainer_version=lambda: 5))
    batches = list(iterator)
    assert [keys(b) for b in batches] == [[(0, 1), (0, 2), (0, 3)]]
    stats = pipeline_stats(iterator.get_state())
    assert stats["samples_dropped"] == 3 and stats["dropped_groups"] == 1


def test_staleness_of_is_trainer_version_minus_oldest_generated_version() -> None:
    assert staleness_of(make_trajectory(0, version=4), 6) == 3
    assert staleness_of(make_trajectory(0, version=0), 6) == 6
    prompt_only = make_trajectory(0, version=0, length=4, prompt_length=4)
    assert staleness_of(prompt_only, 6) == 0


def test_live_tailing(tmp_path: Path) -> None:
    config = PipelineConfig(group_size=2, groups_per_batch=2, poll_initial_s=0.005, poll_max_s=0.05)
    stop = threading.Event()
    iterator = iter(build_pipeline(tmp_path, config, stop_event=stop))

    def produce() -> None:
        with RolloutLogWriter(tmp_path, "live") as writer:
            for g in range(4):
                for s in (1, 0):
                    writer.append(make_trajectory(g, s))
                    writer.flush()

    producer = threading.Thread(target=produce)
    producer.start()
    assert keys(next(iterator)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert keys(next(iterator)) == [(2, 0), (2, 1), (3, 0), (3, 1)]
    producer.join()
    stop.set()
    with pytest.raises(StopIteration):
        next(iterator)


def test_stop_ends_a_waiting_iterator(tmp_path: Path) -> None:
    config = PipelineConfig(group_size=1, groups_per_batch=1, poll_max_s=0.2)
    stop = threading.Event()
    iterator = iter(build_pipeline(tmp_path, config, stop_event=stop))
    threading.Timer(0.2, stop.set).start()
    with pytest.raises(StopIteration):
        next(iterator)


def test_config_and_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="min_group_size"):
        PipelineConfig(group_size=2, min_group_size=3)
    with pytest.raises(ValueError, match="trainer_version"):
        build_pipeline(tmp_path, PipelineConfig(group_size=1, groups_per_batch=1, max_staleness=1))
    with pytest.raises(ValueError, match="needs group_size and groups_per_batch"):
        build_pipeline(tmp_path, PipelineConfig(group_size=4))
    with RolloutLogWriter(tmp_path, "w0") as writer:
        writer.append(make_trajectory(0, 5))
    with pytest.raises(ValueError, match="sample_index 5"):
        list(build_pipeline(tmp_path, PipelineConfig(group_size=4, groups_per_batch=1, **FAST)))


def test_set_aside_unread_ends_the_log_at_a_saved_position(tmp_path: Path) -> None:
    """A resume moves every shard the saved position has not reached out of the log (kept aside), deletes
    the temporary files of shards never committed, and a pipeline restored there reads nothing more."""
    with RolloutLogWriter(tmp_path / "log", "w0") as writer:
        for group in range(4):
            writer.append(make_trajectory(group, 0))
            writer.append(make_trajectory(group, 1))
            writer.flush()
    config = PipelineConfig(group_size=2, groups_per_batch=1, **FAST)
    iterator = iter(build_pipeline(tmp_path / "log", config))
    assert [t.group_id for t in next(iterator)] == [0, 0]
    state = iterator.get_state()
    (tmp_path / "log" / ".tmp-w9_00000003_abc.arrayrecord").write_bytes(b"half a shard")
    aside = set_aside_unread(tmp_path / "log", state, tmp_path / "aside")
    assert (aside.shards, aside.records, aside.temporaries) == (3, 6, 1)
    assert sorted(p.name for p in (tmp_path / "aside").iterdir()) == [s.name for s in list_shards(tmp_path / "aside")]
    assert not list((tmp_path / "log").glob(".tmp-*"))
    restored = iter(build_pipeline(tmp_path / "log", config.replace(idle_timeout_s=0.2)))
    restored.set_state(state)
    assert next(restored, None) is None

"""Rollout-log refresh cost against the shards already consumed: a listing of the whole log directory (what
each refresh of the pipeline's reader did before the writers' journals, `rollout_log_index`) against the
reader's refresh now, on a local disk and on the tests' GCS server (tests/gcs_emulator.py, on this host);
and what the journal adds to a commit.

The logs hold 4 writers' committed shards, named and journaled as a writer leaves them but empty (a refresh
only lists and stats them); the reader is restored to the end of them. Prints `name: value unit` lines; the
last line is `ratio local_full_listing_vs_refresh_at_<n>: X`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the GCS server of tests/gcs_emulator.py

from areal_jax import storage  # noqa: E402
from areal_jax.data.pipeline import PipelineConfig  # noqa: E402
from areal_jax.data.rollout_log import RolloutLogConfig, RolloutLogWriter  # noqa: E402
from areal_jax.data.rollout_log_index import WriterJournal  # noqa: E402
from areal_jax.data.rollout_log_shards import ShardName, list_shards_and_ages, shard_location  # noqa: E402
from areal_jax.data.rollout_log_tail import RolloutLogDataset, RolloutLogIterator  # noqa: E402
from tests.gcs_emulator import BUCKET, GcsEmulator  # noqa: E402
from tests.rollout_log_worker import make_trajectory  # noqa: E402

WRITERS = [f"rollout{server}-1700000000000000000-{100 + server}" for server in range(4)]


def median_ms(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def fill(log: str, total: int) -> None:
    """`total` empty committed shards of the 4 writers, and their journals (registry entries on gs://)."""
    per_writer = total // len(WRITERS)
    shards = {w: [ShardName(w, seq, 8 * seq, 8) for seq in range(per_writer)] for w in WRITERS}
    storage.make_dirs(log)
    for group in shards.values():
        for shard in group:  # one at a time: the GCS server fails concurrent uploads (and gcsfs backs off)
            if storage.is_remote(log):
                storage.write_atomic(shard_location(log, shard.name), b"")
            else:
                Path(shard_location(log, shard.name)).touch()
    for writer, group in shards.items():
        WriterJournal(log, writer, group, fsync=False)


def restored_reader(log: str, total: int) -> RolloutLogIterator:
    iterator = iter(RolloutLogDataset(log, PipelineConfig()))
    consumed = {w: total // len(WRITERS) for w in WRITERS}
    iterator.set_state({"next_shard": consumed, "shard": None, "record": 0, "problems": 0})
    iterator._refresh()  # a restored reader lists the whole directory once
    return iterator


def compare(where: str, log_at: Callable[[int], str], sizes: list[int], repeats: int) -> dict[int, tuple[float, float]]:
    results = {}
    for total in sizes:
        log = log_at(total)
        fill(log, total)
        full = median_ms(lambda log=log: list_shards_and_ages(log), repeats)
        reader = restored_reader(log, total)
        refresh = median_ms(reader._refresh, repeats)
        reader.close()
        print(f"{where}_full_listing_{total}: {full:.3f} ms")
        print(f"{where}_refresh_{total}: {refresh:.3f} ms")
        results[total] = (full, refresh)
    return results


def commit_cost(directory: Path, commits: int) -> None:
    """Per-commit time of a one-record shard with fsync, with the journal and with its append skipped, the
    two writers' commits alternating (the disk's fsync time drifts)."""
    trajectory = make_trajectory(0)
    times: dict[bool, list[float]] = {True: [], False: []}
    writers = {journal: RolloutLogWriter(directory / str(journal), "w", RolloutLogConfig()) for journal in times}
    writers[False]._journal.announce = lambda shard: None
    for _ in range(commits):
        for journal, writer in writers.items():
            started = time.perf_counter()
            writer.append(trajectory)
            writer.flush()
            times[journal].append(time.perf_counter() - started)
    for journal, measured in times.items():
        print(f"local_commit_{'with' if journal else 'without'}_journal: {1e3 * statistics.median(measured):.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="GCS logs of 100 and 300 shards, not 100 and 1,000: under a minute"
    )
    args = parser.parse_args()
    local_sizes = [100, 2_000, 20_000]
    gcs_sizes = [100, 300] if args.quick else [100, 1_000]
    with tempfile.TemporaryDirectory() as scratch:
        local = compare("local", lambda total: f"{scratch}/log{total}", local_sizes, 20)
        commit_cost(Path(scratch), 200)
    emulator = GcsEmulator()
    emulator.apply()
    try:
        root = f"gs://{BUCKET}/{uuid.uuid4().hex}"
        compare("gcs", lambda total: f"{root}/log{total}", gcs_sizes, 5)
    finally:
        emulator.close()
    full, refresh = local[local_sizes[-1]]
    print(f"ratio local_full_listing_vs_refresh_at_{local_sizes[-1]}: {full / refresh:.1f}")


if __name__ == "__main__":
    main()

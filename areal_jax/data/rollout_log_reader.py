"""Reading the rollout log: the records of a shard, of chosen log positions, and every group id written.

On gs:// a shard is read from a local download of it (ArrayRecord reads local files only); `ShardFetcher`
downloads the next shards of a reader in the background. Corruption: ArrayRecord checksums every chunk. A
shard that cannot be opened (truncated, bad footer) is reported with its file name and the reason and
skipped whole; a record whose chunk or payload does not decode is reported and skipped, and the shard's
other records are read.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from array_record.python import array_record_module

from areal_jax import storage
from areal_jax.data.rollout_log_records import RecordFormatError, decode_record
from areal_jax.data.rollout_log_shards import SHARD_SUFFIX, TMP_PREFIX, ShardName, list_shards, shard_location
from areal_jax.data.trajectory import Trajectory

logger = logging.getLogger(__name__)

_READ_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"
_REMOTE_READERS = 16  # shards fetched at once from gs://
SCRATCH_PREFIX = "areal-jax-log-"  # then the owner's pid and "-": `ShardFetcher`'s download directories


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def sweep_orphaned_scratch(root: Path | None = None) -> list[Path]:
    """Remove the download directories of readers whose process is gone (a killed process never reaches
    `ShardFetcher.close`) under `root` (the temporary directory); the removed paths."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        pid = path.name[len(SCRATCH_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@dataclasses.dataclass(frozen=True)
class LogEntry:
    """One record read back: where it lies (shard file name, index in it), who wrote it, and the trajectory."""

    shard: str
    index: int
    writer_id: str
    seq: int
    appended_at: float
    trajectory: Trajectory

    @property
    def position(self) -> tuple[str, int]:
        return self.shard, self.index


@dataclasses.dataclass(frozen=True)
class ReadProblem:
    """A shard (index None) or one record of it that could not be read, and why."""

    shard: str
    index: int | None
    reason: str

    def __str__(self) -> str:
        where = self.shard if self.index is None else f"{self.shard}[{self.index}]"
        return f"{where}: {self.reason}"


class _LocalCopy:
    """A shard as a local file to open: the file itself, or a downloaded copy deleted on exit."""

    def __init__(self, directory: str | os.PathLike[str], name: str):
        self.location = shard_location(directory, name)
        self.path = Path(self.location)
        self._download: str | None = None

    def __enter__(self) -> Path:
        if not storage.is_remote(self.location):
            return self.path
        handle, self._download = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=SHARD_SUFFIX)
        os.close(handle)
        storage.download(self.location, self._download)
        return Path(self._download)

    def __exit__(self, *exc: object) -> None:
        if self._download is not None:
            Path(self._download).unlink(missing_ok=True)


def _report(problem: ReadProblem, problems: list[ReadProblem]) -> None:
    logger.warning("skipping unreadable rollout-log data: %s", problem)
    problems.append(problem)


def _entry(shard: ShardName, index: int, data: bytes) -> LogEntry:
    writer_id, seq, appended_at, trajectory = decode_record(data)
    if writer_id != shard.writer_id or seq != shard.first_record + index:
        raise ValueError(
            f"record header says writer {writer_id!r} seq {seq}, the shard name implies "
            f"{shard.writer_id!r} seq {shard.first_record + index}"
        )
    return LogEntry(shard.name, index, writer_id, seq, appended_at, trajectory)


def _open_reader(path: Path) -> tuple[array_record_module.ArrayRecordReader | None, str]:
    """An open reader, or None and why the file cannot be read."""
    try:
        reader = array_record_module.ArrayRecordReader(str(path), _READ_OPTIONS)
    except (OSError, RuntimeError, ValueError) as err:
        return None, f"cannot open: {err}"
    if reader.ok():
        return reader, ""
    try:
        reader.close()  # a reader that failed to open reports why on close
    except RuntimeError as err:
        return None, f"not a readable ArrayRecord file: {err}"
    return None, "not a readable ArrayRecord file (truncated or corrupt)"


def read_shard(
    directory: str | os.PathLike[str], shard: ShardName, start: int = 0
) -> tuple[list[LogEntry], list[ReadProblem]]:
    """The readable records of `shard` from index `start` on, and what could not be read (reported)."""
    problems: list[ReadProblem] = []
    with _LocalCopy(directory, shard.name) as local:
        return _read_local_shard(local, shard, start, problems)


def _read_local_shard(
    path: Path, shard: ShardName, start: int, problems: list[ReadProblem]
) -> tuple[list[LogEntry], list[ReadProblem]]:
    reader, reason = _open_reader(path)
    if reader is None:
        _report(ReadProblem(shard.name, None, reason), problems)
        return [], problems
    try:
        count = reader.num_records()
        if count != shard.num_records:
            _report(
                ReadProblem(shard.name, None, f"holds {count} records but its name says {shard.num_records}"),
                problems,
            )
            return [], problems
        try:
            payloads: Sequence[bytes | None] = reader.read(list(range(start, count))) if start < count else []
        except RuntimeError:
            payloads = [_read_one(reader, shard, i, problems) for i in range(start, count)]
        entries = []
        for index, data in enumerate(payloads, start=start):
            if data is None:
                continue
            try:
                entries.append(_entry(shard, index, data))
            except RecordFormatError:
                raise
            except Exception as err:  # a corrupt payload may fail anywhere in msgpack or Trajectory checks
                _report(ReadProblem(shard.name, index, f"cannot decode: {err}"), problems)
        return entries, problems
    finally:
        reader.close()


class ShardFetcher:
    """Reads shards for one reader thread; on gs:// it downloads the next ones in the background.

    A pipeline reads a log of one shard per group one shard at a time; fetched one after another from GCS
    (tens of ms each) a step of hundreds of groups would wait seconds on the bucket. `prefetch` starts the
    downloads of up to `ahead` shards (in the order given) into a private temporary directory; `read`
    uses a finished download (deleting it after) or reads directly. Locally it only reads. Only its owner
    thread calls it; the pool's threads only download."""

    def __init__(self, directory: str | os.PathLike[str], ahead: int = _REMOTE_READERS):
        self.directory = str(directory)
        self.ahead = ahead
        self._remote = storage.is_remote(directory)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._scratch: Path | None = None
        self._fetches: dict[str, concurrent.futures.Future[Path]] = {}

    def prefetch(self, shards: Iterable[ShardName]) -> None:
        if not self._remote:
            return
        for shard in shards:
            if len(self._fetches) >= self.ahead:
                return
            if shard.name not in self._fetches:
                self._fetches[shard.name] = self._executor().submit(self._download, shard.name)

    def read(self, shard: ShardName, start: int = 0) -> tuple[list[LogEntry], list[ReadProblem]]:
        """`read_shard(directory, shard, start)`, from a finished download when there is one."""
        fetch = self._fetches.pop(shard.name, None)
        if fetch is None:
            return read_shard(self.directory, shard, start)
        try:
            path = fetch.result()
        except Exception:  # gone since it was listed, a failed request: a direct read reports or retries it
            return read_shard(self.directory, shard, start)
        try:
            return _read_local_shard(path, shard, start, [])
        finally:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        for fetch in self._fetches.values():
            fetch.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._fetches.clear()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            sweep_orphaned_scratch()
            self._scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
            self._pool = concurrent.futures.ThreadPoolExecutor(self.ahead, thread_name_prefix="areal-log-fetch")
        return self._pool

    def _download(self, name: str) -> Path:
        assert self._scratch is not None
        path = self._scratch / name
        storage.download(shard_location(self.directory, name), path)
        return path


def _read_one(
    reader: array_record_module.ArrayRecordReader, shard: ShardName, index: int, problems: list[ReadProblem]
) -> bytes | None:
    try:
        return reader.read([index])[0]
    except RuntimeError as err:
        _report(ReadProblem(shard.name, index, str(err)), problems)
        return None


def logged_groups(directory: str | os.PathLike[str]) -> dict[int, bool]:
    """The group ids of every readable record in the committed shards of `directory`, each with whether it
    trains (False: logged but kept out of training, `Trajectory.trains`): a restarted rollout server's view
    of which of its groups were written. On gs:// the shards (one per group) are fetched `_REMOTE_READERS` at
    a time: one after another, a long run's would take minutes."""

    def groups(shard: ShardName) -> dict[int, bool]:
        return {entry.trajectory.group_id: entry.trajectory.trains for entry in read_shard(directory, shard)[0]}

    shards = list_shards(directory)
    if not storage.is_remote(directory):
        found = list(map(groups, shards))
    else:
        with concurrent.futures.ThreadPoolExecutor(_REMOTE_READERS) as pool:
            found = list(pool.map(groups, shards))
    return {group: trains for part in found for group, trains in part.items()}


def read_positions(directory: str | os.PathLike[str], positions: Iterable[tuple[str, int]]) -> list[LogEntry]:
    """The records at (shard file name, index) `positions`, in the given order; each shard opened once.

    A position that cannot be read raises, since it was readable when it was first consumed.
    """
    positions = [(str(name), int(index)) for name, index in positions]
    by_shard: dict[str, list[int]] = {}
    for name, index in positions:
        by_shard.setdefault(name, []).append(index)
    found: dict[tuple[str, int], LogEntry] = {}
    for name, indices in by_shard.items():
        shard = ShardName.parse(name)
        if shard is None:
            raise ValueError(f"{name!r} is not a rollout-log shard name")
        with _LocalCopy(directory, name) as local:
            reader, reason = _open_reader(local)
            if reader is None:
                raise OSError(f"rollout-log shard {shard_location(directory, name)}: {reason}")
            try:
                for index, data in zip(indices, reader.read(indices), strict=True):
                    found[(name, index)] = _entry(shard, index, data)
            finally:
                reader.close()
    return [found[position] for position in positions]

"""The rollout log: a durable, sequence-numbered log of `Trajectory` records in ArrayRecord shards.

Layout. One directory holds the shards of every writer (one writer per rollout process). A committed
shard is named `<writer>_<shard:08d>_<first:012d>_<count>.arrayrecord`: the writer id, the writer's shard
sequence number (0, 1, 2, ... in commit order), the sequence number of its first record and its record
count. Record sequence numbers count a writer's committed records from 0 without gaps, so
(writer, record seq) names a record for good, and the names of one writer sort in commit order.

Commit. A writer buffers appended records in memory and commits them as one shard when `max_records`
records are buffered, when the oldest buffered record is older than `max_age_s` (checked on `append`
and `flush_if_due`), or on `flush()`/`close()`. The shard is written under a dot-prefixed temporary name,
fsynced, then hard-linked to its final name (which fails rather than overwrite an existing shard) and the
temporary name removed; the directory is fsynced. Readers only ever see whole shards. A record is durable
once `flush()` (or the commit triggered by `append`) has returned; a crash loses only uncommitted
records, and a restarted writer continues after its last committed shard (its stale temporary files are
removed). Two live writers must not share a writer id.

Record format (format version 1): one msgpack map per ArrayRecord record
  {"format": 1, "writer": str, "seq": int, "appended_at": float (unix time),
   "schema_version": int (Trajectory.schema_version),
   "token_ids" | "behav_logprobs" | "versions" | "loss_mask": {"dtype": "<i4", "shape": [T], "data": bytes},
   "prompt_length": int, "reward": float, "prompt_id": str, "group_id": int, "sample_index": int,
   "reward_components": {str: float}, "timings": {str: float}, "metadata": {str: msgpack value}}
Arrays are stored little-endian with their dtype. A reader refuses a newer format or schema version.

Storage. The directory may be local or a gs:// URL (`areal_jax.storage`). ArrayRecord 0.8.6 writes through a
local file descriptor only, so on GCS a writer writes the shard to a local temporary file and uploads it
to its final object name (an object appears only once its upload is complete: readers still see whole
shards only), refusing to replace an existing one; readers list the prefix and read a shard from a local
download of it.

Corruption. ArrayRecord checksums every chunk. A shard that cannot be opened (truncated, bad footer) is
reported with its file name and the reason and skipped whole; a record whose chunk or payload does not
decode is reported and skipped, and the shard's other records are read.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from array_record.python import array_record_module

from areal_jax import storage
from areal_jax.configuration import Config, option
from areal_jax.data.trajectory import SCHEMA_VERSION, Trajectory

logger = logging.getLogger(__name__)

LOG_FORMAT_VERSION = 1
SHARD_SUFFIX = ".arrayrecord"
TMP_PREFIX = ".tmp-"
_WRITER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")
_SHARD_NAME = re.compile(r"(?P<writer>[A-Za-z0-9][A-Za-z0-9-]*)_(?P<shard>\d{8,})_(?P<first>\d{12,})_(?P<count>\d+)")
_ARRAY_FIELDS = ("token_ids", "behav_logprobs", "versions", "loss_mask")
_READ_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"
_REMOTE_READERS = 16  # shards fetched at once from gs://


class RecordFormatError(ValueError):
    """A record was written by a newer log format or trajectory schema than this reader understands."""


@dataclasses.dataclass(frozen=True)
class RolloutLogConfig(Config):
    """When a writer commits its buffered records as a shard, and how shards are written."""

    max_records: int = option(256, ge=1, doc="commit a shard once this many records are buffered")
    max_age_s: float = option(
        2.0, gt=0, doc="commit once the oldest buffered record is this old (checked on append and flush_if_due)"
    )
    array_record_options: str = option(
        "group_size:1", doc="ArrayRecord writer options; group_size 1 keeps records independently readable"
    )
    fsync: bool = option(True, doc="fsync every shard and the directory before and after its commit")


@dataclasses.dataclass(frozen=True, order=True)
class ShardName:
    """A committed shard's identity, parsed from (and printed as) its file name."""

    writer_id: str
    shard_seq: int
    first_record: int
    num_records: int

    @property
    def name(self) -> str:
        return f"{self.writer_id}_{self.shard_seq:08d}_{self.first_record:012d}_{self.num_records}{SHARD_SUFFIX}"

    @classmethod
    def parse(cls, name: str) -> ShardName | None:
        """The shard of a committed file name; None for temporary or foreign files."""
        if not name.endswith(SHARD_SUFFIX):
            return None
        match = _SHARD_NAME.fullmatch(name[: -len(SHARD_SUFFIX)])
        if match is None:
            return None
        return cls(match["writer"], int(match["shard"]), int(match["first"]), int(match["count"]))


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


def _encode_array(array: np.ndarray) -> dict[str, Any]:
    array = np.asarray(array)
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return {"dtype": little.dtype.str, "shape": list(little.shape), "data": np.ascontiguousarray(little).tobytes()}


def _decode_array(value: dict[str, Any]) -> np.ndarray:
    array = np.frombuffer(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
    return array.astype(array.dtype.newbyteorder("="), copy=True)


def _plain(value: Any) -> Any:
    """msgpack fallback for NumPy scalars and small arrays in metadata."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot serialise a value of type {type(value).__name__} in a trajectory record")


def new_writer_id(server: int) -> str:
    """A writer id for rollout server (or in-process rollout side) `server`, unique across its restarts and hosts:
    the server, the time in ns, the process id."""
    return f"rollout{server}-{time.time_ns()}-{os.getpid()}"


def encode_record(trajectory: Trajectory, writer_id: str, seq: int, appended_at: float) -> bytes:
    """The record bytes of `trajectory` (format in the module docstring)."""
    record: dict[str, Any] = {
        "format": LOG_FORMAT_VERSION,
        "writer": writer_id,
        "seq": seq,
        "appended_at": appended_at,
        "schema_version": trajectory.schema_version,
        "prompt_length": int(trajectory.prompt_length),
        "reward": float(trajectory.reward),
        "prompt_id": trajectory.prompt_id,
        "group_id": int(trajectory.group_id),
        "sample_index": int(trajectory.sample_index),
        "reward_components": {k: float(v) for k, v in trajectory.reward_components.items()},
        "timings": {k: float(v) for k, v in trajectory.timings.items()},
        "metadata": dict(trajectory.metadata),
    }
    for name in _ARRAY_FIELDS:
        record[name] = _encode_array(getattr(trajectory, name))
    return msgpack.packb(record, default=_plain, use_bin_type=True)


def decode_record(data: bytes) -> tuple[str, int, float, Trajectory]:
    """(writer id, record seq, append time, trajectory) of record bytes written by `encode_record`."""
    record = msgpack.unpackb(data, raw=False)
    if not isinstance(record, dict) or "format" not in record:
        raise ValueError(f"not a rollout-log record (decoded a {type(record).__name__})")
    if record["format"] > LOG_FORMAT_VERSION:
        raise RecordFormatError(
            f"record format {record['format']} is newer than this reader's {LOG_FORMAT_VERSION}; upgrade the reader"
        )
    if record["schema_version"] > SCHEMA_VERSION:
        raise RecordFormatError(
            f"trajectory schema {record['schema_version']} is newer than this reader's {SCHEMA_VERSION}"
        )
    arrays = {name: _decode_array(record[name]) for name in _ARRAY_FIELDS}
    trajectory = Trajectory(
        **arrays,
        prompt_length=record["prompt_length"],
        reward=record["reward"],
        prompt_id=record["prompt_id"],
        group_id=record["group_id"],
        sample_index=record["sample_index"],
        reward_components=record["reward_components"],
        timings=record["timings"],
        metadata=record["metadata"],
        schema_version=record["schema_version"],
    )
    return record["writer"], record["seq"], record["appended_at"], trajectory


def _shard_location(directory: str | os.PathLike[str], name: str) -> str:
    return storage.join(directory, name)


class _LocalCopy:
    """A shard as a local file to open: the file itself, or a downloaded copy deleted on exit."""

    def __init__(self, directory: str | os.PathLike[str], name: str):
        self.location = _shard_location(directory, name)
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


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_shards(directory: str | os.PathLike[str]) -> list[ShardName]:
    """Committed shards in `directory`, sorted by writer id then shard sequence (commit order per writer)."""
    shards = [ShardName.parse(name) for name in storage.names(directory)]
    return sorted(s for s in shards if s is not None)


def shard_age(directory: str | os.PathLike[str], name: str, listed: dict[str, int] | None = None) -> int:
    """When committed shard `name` appeared (modification time, ns; 0 when gone): from `listed` (a gs://
    listing carries it for free), else one stat of the local file."""
    if listed is not None and name in listed:
        return listed[name]
    try:
        return os.stat(_shard_location(directory, name)).st_mtime_ns
    except FileNotFoundError:
        return 0


def list_shards_and_ages(directory: str | os.PathLike[str]) -> tuple[list[ShardName], dict[str, int] | None]:
    """`list_shards`, and on gs:// each shard's age from the same listing (None locally: stat when needed)."""
    if not storage.is_remote(directory):
        return list_shards(directory), None
    entries = storage.listing(directory)
    shards = sorted(s for s in map(ShardName.parse, entries) if s is not None)
    return shards, {name: mtime for name, (_, mtime) in entries.items()}


class RolloutLogWriter:
    """Appends trajectories of one writer (one rollout process) to the log directory; thread-safe."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        writer_id: str,
        config: RolloutLogConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not _WRITER_ID.fullmatch(writer_id):
            raise ValueError(
                f"writer id {writer_id!r} must be 1-64 letters, digits or '-', starting with a letter or digit"
            )
        self.directory = str(directory)
        self.remote = storage.is_remote(directory)
        self.writer_id = writer_id
        self.config = config or RolloutLogConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._buffer: list[bytes] = []
        self._oldest: float | None = None
        self._closed = False
        storage.make_dirs(self.directory)
        if not self.remote:  # on GCS the temporary files are local to the writer's host
            for stale in Path(self.directory).glob(f"{TMP_PREFIX}{writer_id}_*"):
                logger.warning(
                    "removing uncommitted shard %s left by an earlier run of writer %s", stale.name, writer_id
                )
                stale.unlink(missing_ok=True)
        own = [s for s in list_shards(self.directory) if s.writer_id == writer_id]
        self._next_shard = own[-1].shard_seq + 1 if own else 0
        self._next_record = own[-1].first_record + own[-1].num_records if own else 0
        if own:
            logger.info(
                "writer %s resumes at shard %d, record %d in %s",
                writer_id,
                self._next_shard,
                self._next_record,
                self.directory,
            )

    @property
    def next_record_seq(self) -> int:
        """The sequence number the next appended record will get."""
        return self._next_record

    @property
    def buffered(self) -> int:
        """Records appended but not yet committed."""
        return len(self._buffer)

    def append(self, trajectory: Trajectory) -> int:
        """Buffer one trajectory; commit a shard if the count or age limit is reached. Returns its seq."""
        record_time = time.time()
        with self._lock:
            if self._closed:
                raise ValueError(f"writer {self.writer_id} is closed")
            seq = self._next_record
            self._buffer.append(encode_record(trajectory, self.writer_id, seq, record_time))
            self._next_record += 1
            if self._oldest is None:
                self._oldest = self._clock()
            if len(self._buffer) >= self.config.max_records or self._due():
                self._commit()
        return seq

    def flush_if_due(self) -> ShardName | None:
        """Commit the buffer if its oldest record is older than `max_age_s`; the committed shard or None."""
        with self._lock:
            return self._commit() if self._due() else None

    def flush(self) -> ShardName | None:
        """Commit every buffered record now; the committed shard, or None if nothing was buffered."""
        with self._lock:
            return self._commit()

    def close(self) -> None:
        """Commit what is buffered and refuse further appends."""
        with self._lock:
            if not self._closed:
                self._commit()
                self._closed = True

    def __enter__(self) -> RolloutLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _publish(self, tmp: Path, final: str) -> None:
        """Make the finished temporary shard visible under its final name, whole, never over another."""
        if self.remote:
            storage.upload(tmp, final, exclusive=True)
            return
        if self.config.fsync:
            _fsync_path(tmp)
        os.link(tmp, final)  # FileExistsError rather than replacing a shard
        if self.config.fsync:
            _fsync_path(Path(self.directory), directory=True)

    def _due(self) -> bool:
        return self._oldest is not None and self._clock() - self._oldest >= self.config.max_age_s

    def _commit(self) -> ShardName | None:
        if not self._buffer:
            return None
        started = time.perf_counter()
        shard = ShardName(self.writer_id, self._next_shard, self._next_record - len(self._buffer), len(self._buffer))
        temporary_name = f"{TMP_PREFIX}{self.writer_id}_{shard.shard_seq:08d}_{uuid.uuid4().hex}{SHARD_SUFFIX}"
        tmp = Path(tempfile.gettempdir() if self.remote else self.directory) / temporary_name
        final = storage.join(self.directory, shard.name)
        writer = array_record_module.ArrayRecordWriter(str(tmp), self.config.array_record_options)
        for record in self._buffer:
            writer.write(record)
        if not writer.ok():
            writer.close()
            tmp.unlink(missing_ok=True)
            raise OSError(f"ArrayRecord writer failed on {tmp}")
        writer.close()
        nbytes = tmp.stat().st_size
        try:
            self._publish(tmp, final)
        except FileExistsError:
            raise FileExistsError(
                f"shard {final} already exists: is another live writer using writer id {self.writer_id!r}?"
            ) from None
        finally:
            tmp.unlink(missing_ok=True)
        logger.debug(
            "committed %s: %d records, %d bytes in %.3f s",
            shard.name,
            shard.num_records,
            nbytes,
            time.perf_counter() - started,
        )
        self._buffer.clear()
        self._oldest = None
        self._next_shard += 1
        return shard


class GroupLogSink:
    """Where finished groups go: the rollout log, one shard per group (the trainer sees each group as soon
    as it is done); called from the controller's threads."""

    def __init__(self, writer: RolloutLogWriter):
        self.writer = writer
        self.lock = threading.Lock()

    def __call__(self, trajectories: list[Trajectory]) -> None:
        with self.lock:
            for trajectory in trajectories:
                self.writer.append(trajectory)
            self.writer.flush()

    def close(self) -> None:
        with self.lock:
            self.writer.close()


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
            self._scratch = Path(tempfile.mkdtemp(prefix="areal-jax-log-"))
            self._pool = concurrent.futures.ThreadPoolExecutor(self.ahead, thread_name_prefix="areal-log-fetch")
        return self._pool

    def _download(self, name: str) -> Path:
        assert self._scratch is not None
        path = self._scratch / name
        storage.download(_shard_location(self.directory, name), path)
        return path


def _read_one(
    reader: array_record_module.ArrayRecordReader, shard: ShardName, index: int, problems: list[ReadProblem]
) -> bytes | None:
    try:
        return reader.read([index])[0]
    except RuntimeError as err:
        _report(ReadProblem(shard.name, index, str(err)), problems)
        return None


def logged_group_ids(directory: str | os.PathLike[str]) -> set[int]:
    """The group ids of every readable record in the committed shards of `directory` (a restarted rollout
    server's view of which of its groups were written). On gs:// the shards (one per group) are fetched
    `_REMOTE_READERS` at a time: one after another, a long run's would take minutes."""

    def group_ids(shard: ShardName) -> set[int]:
        return {entry.trajectory.group_id for entry in read_shard(directory, shard)[0]}

    shards = list_shards(directory)
    if not storage.is_remote(directory):
        return set().union(*map(group_ids, shards))
    with concurrent.futures.ThreadPoolExecutor(_REMOTE_READERS) as pool:
        return set().union(*pool.map(group_ids, shards))


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
                raise OSError(f"rollout-log shard {_shard_location(directory, name)}: {reason}")
            try:
                for index, data in zip(indices, reader.read(indices), strict=True):
                    found[(name, index)] = _entry(shard, index, data)
            finally:
                reader.close()
    return [found[position] for position in positions]

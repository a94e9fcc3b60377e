"""The rollout log: a durable, sequence-numbered log of `Trajectory` records in ArrayRecord shards, and
its writer.

The log's parts: the shard layout (`rollout_log_shards`), the record bytes (`rollout_log_records`), reading
(`rollout_log_reader`), tailing it for the trainer's pipeline (`rollout_log_tail`), and here the writer.

Commit. A writer buffers appended records in memory and commits them as one shard on `flush()` or
`close()` (the rollout side's `GroupLogSink` flushes after every group: one shard per group). The shard
is written under a dot-prefixed temporary name, fsynced, then hard-linked to its final name (which fails
rather than overwrite an existing shard) and the temporary name removed; the directory is fsynced.
Readers only ever see whole shards. Before the link the shard's name is appended to the writer's journal
(`rollout_log_index`: how readers find new shards without listing the directory). A record is durable
once `flush()` has returned; a crash loses only uncommitted records, and a restarted writer continues
after its last committed shard (its stale temporary files are removed, its journal rewritten from its
committed shards). Two live writers must not share a writer id.

Storage. ArrayRecord 0.8.6 writes through a local file descriptor only, so on GCS a writer writes the
shard to a local temporary file and uploads it to its final object name (an object appears only once its
upload is complete: readers still see whole shards only), refusing to replace an existing one; it registers
once, with an empty object, and keeps no journal (readers list each writer's newest names instead).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import ClassVar

from array_record.python import array_record_module

from areal_jax import storage
from areal_jax.configuration import Config, option
from areal_jax.data.rollout_log_index import WriterJournal, fsync_path
from areal_jax.data.rollout_log_records import encode_record
from areal_jax.data.rollout_log_shards import SHARD_SUFFIX, TMP_PREFIX, ShardName, list_shards, shard_location
from areal_jax.data.trajectory import Trajectory

logger = logging.getLogger(__name__)

_WRITER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")


@dataclasses.dataclass(frozen=True)
class RolloutLogConfig(Config):
    """How a writer writes its shards."""

    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "max_records": "every group is committed as its own shard",
        "max_age_s": "every group is committed as its own shard",
    }

    array_record_options: str = option(
        "group_size:1", doc="ArrayRecord writer options; group_size 1 keeps records independently readable"
    )
    fsync: bool = option(True, doc="fsync every shard and the directory before and after its commit")


def new_writer_id(server: int) -> str:
    """A writer id for rollout server (or in-process rollout side) `server`, unique across its restarts and hosts:
    the server, the time in ns, the process id."""
    return f"rollout{server}-{time.time_ns()}-{os.getpid()}"


class RolloutLogWriter:
    """Appends trajectories of one writer (one rollout process) to the log directory; thread-safe."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        writer_id: str,
        config: RolloutLogConfig | None = None,
    ):
        if not _WRITER_ID.fullmatch(writer_id):
            raise ValueError(
                f"writer id {writer_id!r} must be 1-64 letters, digits or '-', starting with a letter or digit"
            )
        self.directory = str(directory)
        self.remote = storage.is_remote(directory)
        self.writer_id = writer_id
        self.config = config or RolloutLogConfig()
        self._lock = threading.Lock()
        self._buffer: list[bytes] = []
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
        self._journal = WriterJournal(self.directory, writer_id, own, self.config.fsync)
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
        """Buffer one trajectory (committed by the next `flush` or `close`); returns its seq."""
        record_time = time.time()
        with self._lock:
            if self._closed:
                raise ValueError(f"writer {self.writer_id} is closed")
            seq = self._next_record
            self._buffer.append(encode_record(trajectory, self.writer_id, seq, record_time))
            self._next_record += 1
        return seq

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
            fsync_path(tmp)
        os.link(tmp, final)  # FileExistsError rather than replacing a shard
        if self.config.fsync:
            fsync_path(Path(self.directory), directory=True)

    def _commit(self) -> ShardName | None:
        if not self._buffer:
            return None
        started = time.perf_counter()
        shard = ShardName(self.writer_id, self._next_shard, self._next_record - len(self._buffer), len(self._buffer))
        temporary_name = f"{TMP_PREFIX}{self.writer_id}_{shard.shard_seq:08d}_{uuid.uuid4().hex}{SHARD_SUFFIX}"
        tmp = Path(tempfile.gettempdir() if self.remote else self.directory) / temporary_name
        final = shard_location(self.directory, shard.name)
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
            self._journal.announce(shard)
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

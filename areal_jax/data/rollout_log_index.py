"""Finding a rollout log's new shards without listing its directory: the writers' registry and journals.

A log of one shard per group holds many thousands of shards by the end of a run, so a reader that lists
the whole directory on every poll pays more per poll as the run goes on (on gs:// a full object listing,
a request per 1,000 names). Instead each writer registers itself under `<log>/.writers/<writer id>`, and a
reader's poll (`ShardFeed.poll`) looks only at what each writer committed after the shards it already has:

- Local disk: the registry entry is the writer's journal, one committed shard name per line. The writer
  appends a shard's name before it links the shard under that name, so every shard a reader can see is
  in the journal. The append is not fsynced (it would add a third fsync to each commit): a live reader
  sees it through the page cache (on NFS it reaches the server when the journal is closed, right after
  the append); only a machine crash can lose it, and that ends the local readers too, which list the
  directory when they start again. A reader keeps its offset in each journal and reads only the new lines, then
  stats the named shards in order (a name whose shard is not there yet is checked again at the next poll).
  A restarted writer rewrites its journal whole from its committed shards (dropping a line whose shard
  was never linked, or a half-written one); a reader sees the new file and reads it again from the start.
- gs://: objects cannot be appended to, so the registry entry is an empty object, and a poll lists, per
  writer, the names of its block of 100 shard numbers that holds the next one (`<writer>_<seq // 100>`,
  a name prefix; GCS's `startOffset` skips the names before it), and the next block while the current one
  is full: at most a page per writer, whatever the log's size. The listings (and the registry's) run
  concurrently.

Cost of a poll: one listing of the registry (one name per writer) and, per writer, one stat of its journal
(local) or one bounded listing (gs://), plus what is new. A reader still lists the whole directory once
when it starts or restores a state (the directory is the truth: shards of writers that predate the
registry, or copied in by hand, are found then).
"""

from __future__ import annotations

import collections
import concurrent.futures
import datetime
import os
import uuid
from collections.abc import Iterable

from fsspec.core import url_to_fs

from areal_jax import storage
from areal_jax.data.rollout_log_shards import ShardName, shard_location

WRITERS_DIR = ".writers"
_BLOCK = 100  # shard numbers per gs:// listing: `<writer>_<shard:08d>` less its last two digits
_REMOTE_LISTINGS = 16  # gs:// listings in flight at once


def fsync_path(path: str | os.PathLike[str], directory: bool = False) -> None:
    """fsync file (or directory) `path`."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WriterJournal:
    """A writer's registry entry, and on a local disk its journal of committed shard names (module doc)."""

    def __init__(self, directory: str, writer_id: str, committed: Iterable[ShardName], fsync: bool):
        location = storage.join(directory, WRITERS_DIR, writer_id)
        if storage.is_remote(directory):
            self.path = None
            storage.write_atomic(location, b"")
            return
        self.path = location
        journals = os.path.dirname(location)
        os.makedirs(journals, exist_ok=True)
        for name in os.listdir(journals):  # a rewrite this writer id began and did not finish
            if name.startswith(f".{writer_id}."):
                os.unlink(os.path.join(journals, name))
        temporary = os.path.join(journals, f".{writer_id}.{uuid.uuid4().hex}")
        with open(temporary, "wb") as file:
            file.write("".join(f"{shard.name}\n" for shard in committed).encode())
            file.flush()
            if fsync:
                os.fsync(file.fileno())
        os.replace(temporary, location)
        if fsync:
            fsync_path(journals, directory=True)

    def announce(self, shard: ShardName) -> None:
        """Record `shard` in the journal before it becomes visible under its name (see the module doc)."""
        if self.path is None:
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, f"{shard.name}\n".encode())
        finally:
            os.close(fd)


class ShardFeed:
    """A reader's view of the shards committed after the ones it has; see the module doc."""

    def __init__(self, directory: str):
        self.directory = directory
        self._remote = storage.is_remote(directory)
        self._journals = storage.join(directory, WRITERS_DIR)
        self._offsets: dict[str, tuple[int, int]] = {}  # writer -> (journal inode, bytes read)
        self._announced: dict[str, collections.deque[ShardName]] = {}  # read from journals, not yet returned
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def reset(self) -> None:
        """Forget what was read: the next poll reads every journal from its start (after a full listing)."""
        self._offsets.clear()
        self._announced.clear()

    def poll(self, after: dict[str, int]) -> tuple[list[ShardName], dict[str, int] | None]:
        """The committed shards of each writer numbered `after[writer]` (0 for a writer not in it) or
        higher, in order per writer; and on gs:// their commit times (ns) from the listing."""
        if self._remote:
            return self._poll_remote(after)
        return self._poll_local(after), None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _poll_local(self, after: dict[str, int]) -> list[ShardName]:
        try:
            writers = [name for name in os.listdir(self._journals) if not name.startswith(".")]
        except FileNotFoundError:
            return []
        found = []
        for writer in writers:
            queue = self._announced.setdefault(writer, collections.deque())
            queue.extend(self._read_journal(writer))
            floor = after.get(writer, 0)
            while queue:
                head = queue[0]
                if head.shard_seq < floor:
                    queue.popleft()
                elif os.path.exists(shard_location(self.directory, head.name)):
                    found.append(queue.popleft())
                    floor = head.shard_seq + 1
                else:
                    break  # announced, not linked yet: a writer's shards appear in order
        return found

    def _read_journal(self, writer: str) -> list[ShardName]:
        """The whole lines of `writer`'s journal not read yet (from the start when it was rewritten)."""
        try:
            file = open(os.path.join(self._journals, writer), "rb")  # noqa: SIM115 (closed below)
        except FileNotFoundError:
            return []
        with file:
            status = os.fstat(file.fileno())
            inode, offset = self._offsets.get(writer, (status.st_ino, 0))
            if inode != status.st_ino:
                offset = 0
                self._announced[writer].clear()
            if status.st_size == offset:
                return []
            file.seek(offset)
            data = file.read()
        whole = data.rfind(b"\n") + 1  # a line still being appended waits for the next poll
        self._offsets[writer] = (status.st_ino, offset + whole)
        shards = (ShardName.parse(line) for line in data[:whole].decode().split())
        return [shard for shard in shards if shard is not None and shard.writer_id == writer]

    def _poll_remote(self, after: dict[str, int]) -> tuple[list[ShardName], dict[str, int]]:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(_REMOTE_LISTINGS, thread_name_prefix="areal-log-list")
        registry = self._pool.submit(storage.names, self._journals)  # along with the known writers' listings
        listings = {writer: self._pool.submit(self._list_writer, writer, first) for writer, first in after.items()}
        for writer in registry.result():
            if writer not in listings:
                listings[writer] = self._pool.submit(self._list_writer, writer, 0)
        found: list[ShardName] = []
        ages: dict[str, int] = {}
        for listing in listings.values():
            shards, mtimes = listing.result()
            found.extend(shards)
            ages.update(mtimes)
        return found, ages

    def _list_writer(self, writer: str, first: int) -> tuple[list[ShardName], dict[str, int]]:
        """`writer`'s shards numbered `first` or higher, block by block while a block is full."""
        shards: list[ShardName] = []
        mtimes: dict[str, int] = {}
        while True:
            start = f"{writer}_{first:08d}"
            names = list_remote(self.directory, start[:-2], start)
            block = sorted(s for s in map(ShardName.parse, names) if s is not None and s.writer_id == writer)
            shards.extend(block)
            mtimes.update(names)
            block_end = first - first % _BLOCK + _BLOCK - 1
            if not block or block[-1].shard_seq < block_end:
                return shards, mtimes
            first = block_end + 1


def list_remote(directory: str, prefix: str, start: str) -> dict[str, int]:
    """The names in remote `directory` that begin with `prefix` and sort at or after `start`, each with
    its modification time (ns): on GCS one listing request per 1,000 names that match; any other fsspec
    store lists the whole directory and filters it."""
    fs, path = url_to_fs(directory)
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    if "gs" not in protocols:  # not gcsfs
        return {n: t for n, (_, t) in storage.listing(directory).items() if n.startswith(prefix) and n >= start}
    bucket, key, _ = fs.split_path(path)
    key = f"{key.rstrip('/')}/"
    found: dict[str, int] = {}
    token = None
    while True:
        page = fs.call(
            "GET",
            "b/{}/o",
            bucket,
            json_out=True,
            prefix=key + prefix,
            startOffset=key + start,
            delimiter="/",
            maxResults=1000,
            pageToken=token,
        )
        for item in page.get("items", []):
            name = item["name"][len(key) :]
            if name >= start:  # a server that ignores startOffset (the tests' emulator) sends the rest too
                updated = datetime.datetime.fromisoformat(item["updated"].replace("Z", "+00:00"))
                found[name] = round(updated.timestamp() * 1e9)
        token = page.get("nextPageToken")
        if token is None:
            return found

"""The rollout log's layout: the committed shards of a log directory, named so they sort in commit order.

One directory (local, or a gs:// URL: `areal_jax.storage`) holds the shards of every writer (one writer per
rollout process). A committed shard is named `<writer>_<shard:08d>_<first:012d>_<count>.arrayrecord`: the
writer id, the writer's shard sequence number (0, 1, 2, ... in commit order), the sequence number of its
first record and its record count. Record sequence numbers count a writer's committed records from 0
without gaps, so (writer, record seq) names a record for good, and the names of one writer sort in commit
order. A shard being written has a dot-prefixed temporary name (`TMP_PREFIX`), which no listing returns.
"""

from __future__ import annotations

import dataclasses
import os
import re

from areal_jax import storage

SHARD_SUFFIX = ".arrayrecord"
TMP_PREFIX = ".tmp-"
_SHARD_NAME = re.compile(r"(?P<writer>[A-Za-z0-9][A-Za-z0-9-]*)_(?P<shard>\d{8,})_(?P<first>\d{12,})_(?P<count>\d+)")


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


def shard_location(directory: str | os.PathLike[str], name: str) -> str:
    """Where shard file `name` of the log in `directory` lies."""
    return storage.join(directory, name)


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
        return os.stat(shard_location(directory, name)).st_mtime_ns
    except FileNotFoundError:
        return 0


def list_shards_and_ages(directory: str | os.PathLike[str]) -> tuple[list[ShardName], dict[str, int] | None]:
    """`list_shards`, and on gs:// each shard's age from the same listing (None locally: stat when needed)."""
    if not storage.is_remote(directory):
        return list_shards(directory), None
    entries = storage.listing(directory)
    shards = sorted(s for s in map(ShardName.parse, entries) if s is not None)
    return shards, {name: mtime for name, (_, mtime) in entries.items()}

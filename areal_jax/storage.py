"""Files of a run directory that may be a local path or a `gs://` URL.

Everything that crosses between processes and hosts (the rollout log, the control files, the run's marker
and config) is read and written through these functions, so the same code serves a local disk, a shared
file system and a GCS bucket. Each operation is written once, over the fsspec filesystem that holds the
location (`LocalFileSystem` for a path, gcsfs for gs://; any other fsspec URL, `memory://` in the tests,
works the same way); only two things a local file system has are chosen by kind: an atomic rename
(`write_atomic`, `move`) and a plain list of names (`names`, polled on large directories). Orbax
(checkpoints, weight versions) reaches gs:// through TensorStore on its own; the trainer's records
(metrics, logs, TensorBoard) go through a local working copy (`run_mirror.py`).

What each operation promises on both kinds of location:
- `write_atomic`: readers see the old content or the new, never a part. Locally a temporary file renamed
  over the target; on GCS one upload (an object appears only when its upload completes).
- `upload`: a local file becomes `location` whole (the same reason); with `exclusive` it refuses to
  replace an existing object (checked just before the upload: it catches a second writer of the same
  name, not a race between two at the same instant).
- listings are fresh: GCS listings are strongly consistent, and no gs:// filesystem of this process keeps
  fsspec's listing cache (set at import, for etils/Orbax too): a cached listing would hide what another
  process wrote after it, for as long as this process lives.
- `move` is atomic locally; on GCS it is a copy then a delete, so a crash in between leaves the object in
  both places (callers make moving again harmless).
"""

from __future__ import annotations

import datetime
import json
import os
import posixpath
from pathlib import Path
from typing import Any

from fsspec import config as fsspec_config
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

Location = str | os.PathLike[str]

# No listing cache for any gs:// filesystem fsspec makes in this process, ours or the one etils.epath (and so
# Orbax) uses: a cached listing hides what other processes wrote after it (a rollout server would never see
# a new weight version; tests/test_storage.py). Set at import, before any of them is made.
for _protocol in ("gs", "gcs"):
    fsspec_config.conf.setdefault(_protocol, {})["use_listings_cache"] = False

_LOCAL_PROTOCOLS = ("file", "local")


def is_remote(location: Location) -> bool:
    """A URL (`gs://bucket/...`, or any fsspec protocol but `file://`), not a path on this host."""
    protocol, separator, _ = str(location).partition("://")
    return bool(separator) and "/" not in protocol and protocol not in _LOCAL_PROTOCOLS


def join(location: Location, *names: str) -> str:
    """`location` / names, as a string (a gs:// URL keeps its `//`)."""
    if is_remote(location):
        return posixpath.join(str(location), *names)
    return os.path.join(os.fspath(location), *names)


def name_of(location: Location) -> str:
    return posixpath.basename(str(location).rstrip("/"))


def parent_of(location: Location) -> str:
    if is_remote(location):
        return posixpath.dirname(str(location).rstrip("/"))
    return os.path.dirname(os.fspath(location))


def _located(location: Location) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem that holds `location` (made once per protocol and options), and the path on it."""
    return url_to_fs(os.fspath(location))


def exists(location: Location) -> bool:
    fs, path = _located(location)
    return bool(fs.exists(path))


def is_dir(location: Location) -> bool:
    """A directory (on GCS: a prefix with at least one object under it)."""
    fs, path = _located(location)
    return bool(fs.isdir(path))


def _entries(fs: AbstractFileSystem, path: str, detail: bool) -> list[Any]:
    """What `fs.ls` finds directly in directory `path`, without `path` itself (a GCS "directory marker"
    object, or the one entry of a file); [] when there is no such directory."""
    try:
        found = fs.ls(path, detail=detail)
    except (FileNotFoundError, NotADirectoryError):
        return []
    itself = path.rstrip("/")
    return [entry for entry in found if (entry["name"] if detail else entry).rstrip("/") != itself]


def listing(location: Location) -> dict[str, tuple[bool, int]]:
    """The entries directly in directory `location`: name -> (is a directory, modification time in ns;
    0 for directories on GCS). Empty when there is no such directory."""
    fs, path = _located(location)
    entries = {}
    for info in _entries(fs, path, detail=True):
        directory = info["type"] == "directory" or (info.get("islink", False) and fs.isdir(info["name"]))
        entries[name_of(info["name"])] = (directory, _mtime_ns(info))
    return entries


def names(location: Location) -> list[str]:
    """The sorted names directly in directory `location` ([] when it does not exist). Locally no entry is
    stat'ed: a rollout log of one shard per group holds many thousands, listed on every poll."""
    fs, path = _located(location)
    if isinstance(fs, LocalFileSystem):  # fsspec's `ls` normalises every entry's path: 4x os.listdir's time
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
    return sorted(name_of(entry) for entry in _entries(fs, path, detail=False))


def _mtime_ns(info: dict[str, Any]) -> int:
    """An fsspec entry's modification time in ns: seconds locally, a datetime from gcsfs, the creation time
    in memory://; 0 where there is none (a GCS directory)."""
    stamp = info.get("mtime", info.get("created"))
    if stamp is None:
        return 0
    if isinstance(stamp, str):
        stamp = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    if isinstance(stamp, datetime.datetime):
        stamp = stamp.timestamp()
    return round(stamp * 1e9)


def read_bytes(location: Location) -> bytes:
    """The content of file `location`; FileNotFoundError when there is none."""
    fs, path = _located(location)
    return bytes(fs.cat_file(path))


def read_text(location: Location) -> str:
    return read_bytes(location).decode("utf-8")


def write_atomic(location: Location, data: bytes | str) -> None:
    """Write file `location` so that readers see the old content or the new one, never a part."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fs, path = _located(location)
    if not isinstance(fs, LocalFileSystem):  # an object store: an object appears whole, once uploaded
        fs.pipe_file(path, payload)
        return
    parent = posixpath.dirname(path)
    fs.makedirs(parent, exist_ok=True)
    temporary = posixpath.join(parent, f".{name_of(path)}.{os.getpid()}.tmp")
    fs.pipe_file(temporary, payload)
    _replace(fs, temporary, path)


def remove(location: Location) -> bool:
    """Delete file `location`; False when there was none."""
    fs, path = _located(location)
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        return False
    return True


def remove_tree(location: Location) -> None:
    """Delete directory `location` and everything below it (nothing when it does not exist)."""
    fs, path = _located(location)
    if fs.isdir(path):
        fs.rm(path, recursive=True)


def make_dirs(location: Location) -> None:
    """Create directory `location` and its parents (nothing to do on GCS: prefixes need no creation)."""
    fs, path = _located(location)
    fs.makedirs(path, exist_ok=True)


def move(source: Location, target: Location) -> None:
    """Move file `source` to `target` (replacing it). Atomic locally; on GCS a copy, then a delete."""
    fs, source_path = _located(source)
    target_fs, target_path = _located(target)
    if target_fs is not fs:
        raise ValueError(f"cannot move {source} to {target}: they are on different file systems")
    fs.makedirs(posixpath.dirname(target_path), exist_ok=True)
    _replace(fs, source_path, target_path)


def _replace(fs: AbstractFileSystem, source: str, target: str) -> None:
    """File `source` becomes `target`: on a local file system one atomic rename; an object store has no
    rename, so a copy on the server, then a delete (gcsfs's `mv` would first try GCS's move API, which
    not every GCS-compatible server has: the emulator answers 501 after half a minute of retries)."""
    if isinstance(fs, LocalFileSystem):
        os.replace(source, target)
    else:
        fs.cp_file(source, target)
        fs.rm_file(source)


def upload(local_file: Location, location: Location, *, exclusive: bool = False) -> None:
    """Copy local file `local_file` to `location` (a whole object on GCS, appearing only once complete).
    With `exclusive`, refuse (FileExistsError) when `location` exists."""
    if not is_remote(location):
        raise ValueError(f"upload goes to a remote location, not {location}")
    fs, path = _located(location)
    if exclusive and fs.exists(path):
        raise FileExistsError(location)
    fs.put_file(os.fspath(local_file), path)


def download(location: Location, local_file: Location) -> None:
    """Copy remote file `location` to `local_file` (written under a temporary name, then renamed)."""
    if not is_remote(location):
        raise ValueError(f"download comes from a remote location, not {location}")
    fs, path = _located(location)
    target = Path(local_file)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.part")
    fs.get_file(path, os.fspath(temporary))
    os.replace(temporary, target)


def files_below(location: Location) -> list[str]:
    """The relative paths ('a/b.json') of every file below directory `location`, sorted."""
    found: list[str] = []
    for name, (directory, _) in listing(location).items():
        if directory:
            found.extend(f"{name}/{below}" for below in files_below(join(location, name)))
        else:
            found.append(name)
    return sorted(found)


def upload_tree(local_dir: Location, location: Location) -> None:
    """Copy every file below local directory `local_dir` to the same relative path below `location`."""
    for relative in files_below(local_dir):
        upload(os.path.join(local_dir, relative), join(location, relative))


def download_tree(location: Location, local_dir: Location) -> None:
    """Copy every file below remote directory `location` to the same relative path below `local_dir`."""
    for relative in files_below(location):
        download(join(location, relative), os.path.join(local_dir, relative))


def write_json_atomic(location: Location, value: Any) -> None:
    """Readers see the old file or the new one, never a half-written one (local or gs://)."""
    write_atomic(location, json.dumps(value, sort_keys=True))


def read_json(location: Location) -> Any | None:
    try:
        return json.loads(read_text(location))
    except FileNotFoundError:
        return None

"""Files of a run directory that may be a local path or a `gs://` URL.

Everything that crosses between processes and hosts (the rollout log, the control files, the run's marker
and config) is read and written through these functions, so the same code serves a local disk, a shared
file system and a GCS bucket. Orbax (checkpoints, weight versions) reaches gs:// through TensorStore on its
own; the trainer's records (metrics, logs, TensorBoard) go through a local working copy (`run_mirror.py`).

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

import functools
import json
import os
import posixpath
import shutil
from pathlib import Path
from typing import Any

from fsspec import config as fsspec_config

Location = str | os.PathLike[str]

# No listing cache for any gs:// filesystem fsspec makes in this process, ours or the one etils.epath (and so
# Orbax) uses: a cached listing hides what other processes wrote after it (a rollout server would never see
# a new weight version; tests/test_storage.py). Set at import, before any of them is made.
for _protocol in ("gs", "gcs"):
    fsspec_config.conf.setdefault(_protocol, {})["use_listings_cache"] = False

REMOTE_SCHEMES = ("gs://",)


def is_remote(location: Location) -> bool:
    return str(location).startswith(REMOTE_SCHEMES)


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


@functools.cache
def _gcs() -> Any:
    try:
        import fsspec
        import gcsfs  # noqa: F401  (fsspec finds it by the protocol name)
    except ImportError as err:  # pragma: no cover - gcsfs is in requirements.txt
        raise ImportError("a gs:// run directory needs gcsfs (pip install -r requirements.txt)") from err
    return fsspec.filesystem("gs", use_listings_cache=False)


def _remote_path(location: Location) -> str:
    return str(location)[len("gs://") :].rstrip("/")


def exists(location: Location) -> bool:
    if is_remote(location):
        return bool(_gcs().exists(_remote_path(location)))
    return os.path.exists(location)


def is_dir(location: Location) -> bool:
    """A directory (on GCS: a prefix with at least one object under it)."""
    if is_remote(location):
        return bool(_gcs().isdir(_remote_path(location)))
    return os.path.isdir(location)


def listing(location: Location) -> dict[str, tuple[bool, int]]:
    """The entries directly in directory `location`: name -> (is a directory, modification time in ns;
    0 for directories on GCS). Empty when there is no such directory."""
    if is_remote(location):
        fs = _gcs()
        try:
            found = fs.ls(_remote_path(location), detail=True)
        except FileNotFoundError:
            return {}
        entries = {}
        for info in found:
            name = posixpath.basename(info["name"].rstrip("/"))
            if not name:
                continue
            directory = info["type"] == "directory"
            entries[name] = (directory, 0 if directory else _gcs_mtime_ns(info))
        entries.pop(name_of(location), None)  # a "directory marker" object of the prefix itself
        return entries
    try:
        with os.scandir(location) as scan:
            return {e.name: (e.is_dir(), e.stat().st_mtime_ns) for e in scan}
    except (FileNotFoundError, NotADirectoryError):
        return {}


def names(location: Location) -> list[str]:
    """The sorted names directly in directory `location` ([] when it does not exist). Locally no entry is
    stat'ed: a rollout log of one shard per group holds many thousands, listed on every poll."""
    if is_remote(location):
        return sorted(listing(location))
    try:
        return sorted(os.listdir(location))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _gcs_mtime_ns(info: dict[str, Any]) -> int:
    import datetime

    stamp = info.get("updated") or info.get("timeCreated")
    if not stamp:
        return 0
    if isinstance(stamp, datetime.datetime):
        when = stamp
    else:
        when = datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
    return int(when.timestamp() * 1e9)


def read_bytes(location: Location) -> bytes:
    """The content of file `location`; FileNotFoundError when there is none."""
    if is_remote(location):
        return bytes(_gcs().cat_file(_remote_path(location)))
    with open(location, "rb") as f:
        return f.read()


def read_text(location: Location) -> str:
    return read_bytes(location).decode("utf-8")


def write_atomic(location: Location, data: bytes | str) -> None:
    """Write file `location` so that readers see the old content or the new one, never a part."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    if is_remote(location):
        _gcs().pipe_file(_remote_path(location), payload)
        return
    path = Path(location)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(payload)
    os.replace(temporary, path)


def remove(location: Location) -> bool:
    """Delete file `location`; False when there was none."""
    try:
        if is_remote(location):
            _gcs().rm_file(_remote_path(location))
        else:
            os.unlink(location)
    except FileNotFoundError:
        return False
    return True


def remove_tree(location: Location) -> None:
    """Delete directory `location` and everything below it (nothing when it does not exist)."""
    if is_remote(location):
        fs = _gcs()
        found = fs.find(_remote_path(location), withdirs=False)
        for path in found:  # one by one: the batch endpoint is not on every GCS-compatible server
            fs.rm_file(path)
        return
    if os.path.isdir(location):
        shutil.rmtree(location)


def make_dirs(location: Location) -> None:
    """Create directory `location` and its parents (nothing to do on GCS: prefixes need no creation)."""
    if not is_remote(location):
        os.makedirs(location, exist_ok=True)


def move(source: Location, target: Location) -> None:
    """Move file `source` to `target` (replacing it). Atomic locally; on GCS a copy, then a delete."""
    if is_remote(source) != is_remote(target):
        raise ValueError(f"cannot move {source} to {target}: one is local, the other remote")
    if is_remote(source):
        fs = _gcs()
        fs.copy(_remote_path(source), _remote_path(target))
        fs.rm_file(_remote_path(source))
        return
    os.makedirs(os.path.dirname(os.fspath(target)) or ".", exist_ok=True)
    os.replace(source, target)


def upload(local_file: Location, location: Location, *, exclusive: bool = False) -> None:
    """Copy local file `local_file` to `location` (a whole object on GCS, appearing only once complete).
    With `exclusive`, refuse (FileExistsError) when `location` exists."""
    if not is_remote(location):
        raise ValueError(f"upload goes to a remote location, not {location}")
    fs = _gcs()
    if exclusive and fs.exists(_remote_path(location)):
        raise FileExistsError(location)
    fs.put_file(os.fspath(local_file), _remote_path(location))


def download(location: Location, local_file: Location) -> None:
    """Copy remote file `location` to `local_file` (written under a temporary name, then renamed)."""
    if not is_remote(location):
        raise ValueError(f"download comes from a remote location, not {location}")
    target = Path(local_file)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.part")
    _gcs().get_file(_remote_path(location), os.fspath(temporary))
    os.replace(temporary, target)


def files_below(location: Location) -> list[str]:
    """The relative paths ('a/b.json') of every file below directory `location`, sorted."""
    found = []
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

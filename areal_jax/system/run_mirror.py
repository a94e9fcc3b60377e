"""The local copy of a gs:// run's records, and the thread that uploads it.

A run on a bucket (`output_dir=gs://...`) writes what crosses between processes straight to the bucket
(`areal_jax.storage`, Orbax), but its records (metrics.jsonl, train.log, TensorBoard events, plots,
trained_groups.jsonl, evaluation reports, the HF export, profiles) are appended to, rewritten and written by
libraries that need a local file. They are written into `cfg.run_dir`, the run's local copy, and a
`RunMirror` thread uploads every file that changed: every `every_s` seconds (`local_copy_upload_s`), when
asked (`sync`, which waits: the trainer calls it before writing each checkpoint, so the bucket always holds
the records up to its newest checkpoint) and once more when it closes. Each upload replaces the object
whole, so a reader of the bucket sees a file as it was at some sync, never a part of one; of a `.jsonl` file
only its whole lines (the trainer may be appending one), so a run killed at any moment leaves records its
resume can parse.

The bucket is the truth: a trainer starting a new run empties its local copy (records of an earlier run of
the same name on this host must not be uploaded into the new one); a resumed trainer fills it from the
bucket first (`pull_records`), so it appends to the run's own metrics, possibly on another host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from areal_jax import storage
from areal_jax.run_layout import HF_FINAL_DIR, PROFILE_DIR, SHARED_ENTRIES

if TYPE_CHECKING:
    from areal_jax.config import ExperimentConfig

logger = logging.getLogger(__name__)

# Records a resumed trainer does not need locally (large, and never appended to).
NOT_PULLED = frozenset({PROFILE_DIR, HF_FINAL_DIR})

_SYNC, _STOP = "sync", "stop"


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Relative path -> (size, mtime ns) of every file below `root`, leaving out temporary names."""
    found: dict[str, tuple[int, int]] = {}
    if not root.is_dir():
        return found
    for directory, _, names in os.walk(root):
        for name in names:
            if name.startswith("."):
                continue
            path = Path(directory) / name
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue  # removed while we walked
            found[path.relative_to(root).as_posix()] = (stat.st_size, stat.st_mtime_ns)
    return found


class RunMirror:
    """Uploads the files below `local` that changed to the same relative paths below the gs:// `remote`.

    `only` limits it to those top-level entries (a rollout server uploads its `eval/` reports, a trainer
    process other than 0 its profile). Files present when it starts count as uploaded: a trainer's local
    copy was just emptied or pulled from the bucket, and anything else on the host (an earlier run's
    leftovers) is not this process's to upload. The thread alone keeps the list of what was
    uploaded; others send it requests through a queue."""

    def __init__(
        self,
        local: Path,
        remote: str,
        *,
        every_s: float = 30.0,
        only: frozenset[str] | None = None,
    ):
        if not storage.is_remote(remote):
            raise ValueError(f"a run mirror uploads to a gs:// location, not {remote}")
        self.local, self.remote, self.every_s, self.only = Path(local), remote, every_s, only
        self.uploads = 0
        self._requests: queue.Queue[str | threading.Event] = queue.Queue()  # an Event: set once synced
        self._uploaded = self._scan()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name="areal-run-mirror")
        self._thread.start()

    def sync(self) -> None:
        """Upload what changed now and return once it is uploaded (raises what made it fail)."""
        done = threading.Event()
        self._requests.put(done)
        done.wait()
        if self._failure is not None:
            raise self._failure

    def close(self) -> None:
        """Upload what changed one last time and stop; raises what made the last upload fail."""
        self._requests.put(_STOP)
        self._thread.join()
        if self._failure is not None:
            raise self._failure

    def _scan(self) -> dict[str, tuple[int, int]]:
        """The records below `local`: never a shared entry (a warm start copied down, a run's own files)."""
        files = {path: stat for path, stat in _files(self.local).items() if path.split("/", 1)[0] not in SHARED_ENTRIES}
        if self.only is None:
            return files
        return {path: stat for path, stat in files.items() if path.split("/", 1)[0] in self.only}

    def _loop(self) -> None:
        while True:
            try:
                request = self._requests.get(timeout=self.every_s)
            except queue.Empty:
                request = _SYNC
            try:
                self._sync()
                self._failure = None
            except Exception as err:  # a bucket hiccup: the next sync tries again; close reports the last
                logger.warning("uploading the run's records to %s failed (trying again): %s", self.remote, err)
                self._failure = err
            if isinstance(request, threading.Event):
                request.set()
            if request == _STOP:
                return

    def _sync(self) -> None:
        for path, stat in sorted(self._scan().items()):
            if self._uploaded.get(path) == stat:
                continue
            if path.endswith(".jsonl"):  # whole lines only: a line being appended waits for the next sync
                data = (self.local / path).read_bytes()
                storage.write_atomic(storage.join(self.remote, path), data[: data.rfind(b"\n") + 1])
            else:
                storage.upload(self.local / path, storage.join(self.remote, path))
            self._uploaded[path] = stat
            self.uploads += 1


@contextlib.contextmanager
def mirroring(cfg: ExperimentConfig, *, only: frozenset[str] | None = None) -> Iterator[RunMirror | None]:
    """A `RunMirror` of `cfg.run_dir` for the time of the block, for a gs:// run (None for a local one)."""
    if not storage.is_remote(cfg.run_location):
        yield None
        return
    mirror = RunMirror(cfg.run_dir, cfg.run_location, every_s=cfg.local_copy_upload_s, only=only)
    try:
        yield mirror
    finally:
        mirror.close()


def reset_local_copy(local: Path) -> None:
    """A new run on a bucket: nothing of an earlier run's records on this host may be uploaded into it."""
    if local.exists():
        logger.info("emptying %s, the local copy of an earlier run of this name", local)
        shutil.rmtree(local)
    local.mkdir(parents=True, exist_ok=True)


def pull_records(remote: str, local: Path) -> int:
    """A resumed run on a bucket: its records, copied into an emptied local copy; how many files."""
    reset_local_copy(local)
    fs_root = remote.rstrip("/")
    pulled = 0
    for name, (is_dir, _) in storage.listing(fs_root).items():
        if name in SHARED_ENTRIES or name in NOT_PULLED:
            continue
        below = [f"{name}/{path}" for path in storage.files_below(storage.join(fs_root, name))] if is_dir else [name]
        for relative in below:
            storage.download(storage.join(fs_root, relative), local / relative)
            pulled += 1
    logger.info("copied %d record files of %s into %s", pulled, remote, local)
    return pulled

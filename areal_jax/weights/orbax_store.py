"""The cross-process weight channel: versioned params in an Orbax `CheckpointManager` directory.

Version == step. The publisher saves asynchronously (the arrays are copied to host before `publish`
returns, so the trainer may donate them), uncompressed in OCDBT files, and keeps the `max_to_keep`
newest versions. A save is written
into `<version>.orbax-checkpoint-tmp-<n>/` and becomes `<version>/` by one rename after every file and the
`commit_success.txt` marker are written (on GCS, where there is no rename, the marker alone commits);
Orbax lists only committed versions, so a reader never sees a half-written one. Stale temporary
directories of a killed publisher are removed when the next publisher opens the directory.

Readers open the directory read-only (in a program of several processes, `process_local` readers each
read on their own, with none of Orbax's collectives: a rollout server's processes restore the version
process 0 names, each its own shards), poll `reload()` + `latest_step()` (on a local directory only when
its names changed), and restore straight onto their own mesh: the target is abstract arrays carrying the
reader's shardings, so each reader process reads only the slices its devices hold (a mesh shape
different from the writer's is fine). If the version
being read is deleted meanwhile (the publisher moved on), the newest version is loaded instead.
The directory may be local or gs:// (through TensorStore).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from areal_jax import storage
from areal_jax.weights.base import (
    LoadedWeights,
    checkpoint_location,
    list_live_steps,
    poll_for_version,
    target_shardings,
    tree_nbytes,
)

logger = logging.getLogger(__name__)

# Its own namespace for Orbax's cross-process barriers, apart from the training checkpoints' (their saves
# overlap; see `trainer/checkpoint.py: BARRIER_PREFIX`).
BARRIER_PREFIX = "areal-weights"

_LOAD_ATTEMPTS = 5


def _handler(compress: bool = False) -> ocp.PyTreeCheckpointHandler:
    """One unnamed pytree item per version. Naming the handler keeps Orbax from guessing the layout from a
    step directory (which fails for good if the first one it looks at was just deleted). OCDBT packs the
    arrays into few files (what GCS wants); zstd is off unless asked for: weights barely compress and
    compressing costs more time than it saves in bytes."""
    return ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_compression=compress)


class OrbaxWeightPublisher:
    """Saves each published version into `directory` (async), keeping the `max_to_keep` newest."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int = 2,
        async_save: bool = True,
        compress: bool = False,
    ):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self.directory = directory
        self._async = async_save
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._written) if async_save else None,
            enable_background_delete=True,
            cleanup_tmp_directories=True,
            multiprocessing_options=ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=BARRIER_PREFIX),
        )
        self._manager = ocp.CheckpointManager(
            checkpoint_location(directory), options=options, item_handlers=_handler(compress)
        )
        self._pending: tuple[int, int, float] | None = None  # version, bytes, start time of the save in flight

    def latest_version(self) -> int | None:
        """The newest version saved (committed or in flight) in the directory."""
        return self._manager.latest_step()

    def publish(self, params: Any, version: int) -> None:
        latest = self._manager.latest_step()
        if latest is not None and version <= latest:
            raise ValueError(f"version {version} is not newer than the latest published version {latest}")
        self._manager.wait_until_finished()  # the previous version first (Orbax would wait for it anyway)
        nbytes = tree_nbytes(params)
        started = time.perf_counter()
        self._pending = (version, nbytes, started)
        if not self._manager.save(version, args=ocp.args.PyTreeSave(params)):
            raise RuntimeError(f"Orbax refused to save version {version} in {self.directory}")
        logger.info(
            "publishing weights version %d: %d bytes, %.3f s blocking",
            version,
            nbytes,
            time.perf_counter() - started,
        )
        if not self._async:
            self._written()

    def _written(self) -> None:
        """Log the save in flight; Orbax calls this (async mode) when every file is written, just before
        the rename that commits the version."""
        if self._pending is None:
            return
        version, nbytes, started = self._pending
        seconds = time.perf_counter() - started
        logger.info(
            "wrote weights version %d: %d bytes in %.3f s (%.1f MB/s); committing",
            version,
            nbytes,
            seconds,
            nbytes / max(seconds, 1e-9) / 1e6,
        )

    def wait(self) -> None:
        """Block until the last published version is committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self.wait()
        self._manager.close()


class OrbaxWeightSubscriber:
    """Reads versions from a publisher's directory, read-only; polls with a bounded backoff."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        poll_initial_s: float = 0.05,
        poll_max_s: float = 1.0,
        process_local: bool = False,
    ):
        if not 0 < poll_initial_s <= poll_max_s:
            raise ValueError(f"need 0 < poll_initial_s ({poll_initial_s}) <= poll_max_s ({poll_max_s})")
        self.directory = directory
        self._poll = (poll_initial_s, poll_max_s)
        processes = ocp.options.MultiprocessingOptions()
        if process_local:  # this process alone: no barrier or broadcast with the others in listing or restoring
            me = jax.process_index()
            processes = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
        options = ocp.CheckpointManagerOptions(
            read_only=True, save_interval_steps=0, create=False, multiprocessing_options=processes
        )
        self._manager = ocp.CheckpointManager(checkpoint_location(directory), options=options, item_handlers=_handler())
        self._closed = threading.Event()
        self._listed: frozenset[str] | None = None  # the local directory's names when Orbax last listed it
        self._steps: list[int] = []

    def latest_version(self) -> int | None:
        steps = self._versions()
        return max(steps) if steps else None

    def _versions(self) -> list[int]:
        """The committed versions, listed again (the publisher may delete one while Orbax lists it). Orbax's
        listing reads every version's metadata on a new thread pool, too costly for every poll; a local
        directory's names change whenever a version is committed (a rename) or deleted, so Orbax is asked
        again only when they did."""
        listing = self._local_listing()  # before Orbax lists: a change after this is seen at the next poll
        if listing is not None and listing == self._listed:
            return self._steps

        def read() -> list[int]:
            self._manager.reload()
            return list(self._manager.all_steps())

        self._listed, self._steps = listing, list_live_steps(read, self.directory)
        return self._steps

    def _local_listing(self) -> frozenset[str] | None:
        """The names in the store directory; None where it is remote (gs://) or not there yet."""
        path = os.fspath(self.directory)
        if storage.is_remote(path):
            return None
        try:
            return frozenset(os.listdir(path))
        except FileNotFoundError:
            return None

    def wait_for_version(self, min_version: int, timeout_s: float | None = None) -> int | None:
        first, most = self._poll
        backoff = (min(first * 2**k, most) for k in itertools.count())
        return poll_for_version(self.latest_version, min_version, timeout_s, self._closed, backoff)

    def load(self, version: int, target: Any) -> LoadedWeights:
        target_shardings(target)  # refuse a target without shardings before reading anything
        args = ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
        failures_on_version = 0
        for _ in range(_LOAD_ATTEMPTS):
            started = time.perf_counter()
            try:
                params = self._manager.restore(version, args=args)
            except Exception as err:  # a version deleted mid-read fails anywhere in Orbax/TensorStore
                steps = self._versions()
                if version in steps:
                    failures_on_version += 1
                    if failures_on_version > 1:  # still there after a second try: a real error
                        raise
                    continue  # its deletion may still be under way
                newer = [step for step in steps if step > version]
                if not newer:
                    raise
                logger.warning(
                    "weights version %d vanished while being read (%s: %s); loading version %d",
                    version,
                    type(err).__name__,
                    err,
                    max(newer),
                )
                version, failures_on_version = max(newer), 0
                continue
            seconds = time.perf_counter() - started
            nbytes = tree_nbytes(params)
            logger.info(
                "loaded weights version %d: %d bytes in %.3f s (%.1f MB/s)",
                version,
                nbytes,
                seconds,
                nbytes / max(seconds, 1e-9) / 1e6,
            )
            return LoadedWeights(params, version, nbytes, seconds, published_at=self._commit_time(version))
        raise RuntimeError(
            f"gave up loading weights from {self.directory} after {_LOAD_ATTEMPTS} attempts: "
            "versions keep vanishing while being read; raise the publisher's max_to_keep"
        )

    def _commit_time(self, version: int) -> float | None:
        """When `version` was committed (its directory's rename); None where unknown (e.g. on GCS)."""
        try:
            return os.stat(os.path.join(os.fspath(self.directory), str(version))).st_mtime
        except OSError:
            return None

    def close(self) -> None:
        self._closed.set()
        self._manager.close()

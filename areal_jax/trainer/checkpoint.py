"""Training checkpoints: the trainer's arrays plus JSON metadata, with Orbax, every N steps and when asked.

A checkpoint is one Orbax step directory with two items: `state`, any pytree of arrays the trainer passes
(params and optimizer state), written with `StandardSave`; and `metadata`, the JSON object the caller
passes (a training run's `RunState`: its policy version, the data pipeline's `get_state()` and the groups
consumed; no RNG key), to which the step is added. Saves
are asynchronous and atomic (Orbax writes a temporary directory and renames it).

Saving. The training loop calls `maybe_save(step, state, metadata)` after each step (it saves when `step`
is a multiple of `every_steps`) and `save(..., wait=True)` for its last step or on a stop request (the loop's
`StopControl` owns signals); in a multi-process job every process takes part in each save. `restore(target)`
places the arrays as the caller's target says (abstract arrays with the current mesh's shardings), whatever
mesh shape they were saved from.

Verification. Orbax 0.12.8 does not check what it reads back: its only checksum is the crc32c of the zarr3
shard index, not of the data, so a checkpoint with a few KB overwritten restores silently (NaN from the next
step on) or fails deep in TensorStore. Hence our own manifest: `areal_manifest.json` inside each step
directory lists the size and crc32 (zlib, ~4 GB/s, streamed in 8 MiB chunks) of every other file of the
step. Process 0 writes it in a background thread once Orbax has committed the step (the thread waits for
the commit), under a temporary name renamed into place; the next `save`, `wait`, `restore` or `close` waits
for it, so the step cannot be garbage-collected meanwhile. A crash in between leaves a committed checkpoint
without a manifest. `restore_verified` (and `restore` without a step) tries the newest checkpoint first and
rejects one whose files do not match its manifest, that Orbax cannot read, or whose restored floating arrays
hold a NaN or an infinity, with a warning, falling back to the previous one. A checkpoint without a
(readable) manifest is accepted, with a warning, when Orbax reads it and its arrays are finite: Orbax
committed it. `save` raises `CheckpointError` for a state with a non-finite floating array, writing nothing,
so a NaN never becomes the newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.configuration import Config, option
from areal_jax.weights.base import checkpoint_location, list_live_steps, target_shardings, tree_nbytes

logger = logging.getLogger(__name__)

Metadata = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Config):
    """When training checkpoints are written and how many are kept."""

    every_steps: int = option(100, ge=1, doc="save after every step that is a multiple of this")
    max_to_keep: int = option(2, ge=1, doc="newest checkpoints kept on disk")
    async_save: bool = option(True, doc="write in the background; the loop only waits for the device-to-host copy")


MANIFEST = "areal_manifest.json"
# Orbax names its cross-process barriers by fixed strings ("ThreadSaveMultiHostValueHolder:set_value_start",
# per-step keys): two CheckpointManagers saving at once in one multi-process program (these checkpoints and
# the weight versions, `weights/orbax_store.py`) would meet in each other's barriers and deadlock. A prefix
# per manager keeps their barriers apart.
BARRIER_PREFIX = "areal-train"
_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: a state that may not be saved, or no checkpoint that restores well.

    `rejected` lists (step, reason) for each checkpoint tried, newest first.
    """

    def __init__(self, message: str, rejected: Iterable[tuple[int, str]] = ()):
        super().__init__(message)
        self.rejected = tuple(rejected)


@dataclasses.dataclass(frozen=True)
class RestoredCheckpoint:
    """What `restore` returns: the step, the arrays on the target shardings, and the JSON metadata.

    `verified`: its files matched its manifest (False: it had none, see the module notes); `rejected`:
    (step, reason) of the newer checkpoints passed over, newest first.
    """

    step: int
    state: Any
    metadata: dict[str, Any]
    verified: bool = True
    rejected: tuple[tuple[int, str], ...] = ()


def nonfinite_leaves(tree: Any) -> list[str]:
    """Key paths of the floating leaves of `tree` that hold a NaN or an infinity.

    One jitted reduction per device assignment (usually one for the whole tree), so it works on sharded
    arrays; in a multi-process job it is collective and every process gets the same answer.
    """
    bad: list[str] = []
    groups: dict[tuple[jax.Device, ...], list[tuple[str, jax.Array]]] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        name = jax.tree_util.keystr(path)
        if isinstance(leaf, jax.Array):
            if jnp.issubdtype(leaf.dtype, jnp.inexact):
                # jit needs one ordered device assignment for all its inputs; `_device_assignment` is it.
                groups.setdefault(tuple(leaf.sharding._device_assignment), []).append((name, leaf))
        elif isinstance(leaf, np.ndarray | np.generic | float):
            values = np.asarray(leaf)
            if np.issubdtype(values.dtype, np.inexact) and not np.all(np.isfinite(values)):
                bad.append(name)
    for devices, leaves in groups.items():
        finite = np.asarray(_finite_flags(devices)([leaf for _, leaf in leaves]))
        bad.extend(name for (name, _), ok in zip(leaves, finite, strict=True) if not ok)
    return bad


@functools.cache
def _finite_flags(devices: tuple[jax.Device, ...]) -> Callable[[list[jax.Array]], jax.Array]:
    """A jitted map from arrays on `devices` to one bool per array (all finite), replicated on every device."""
    replicated = NamedSharding(Mesh(np.asarray(devices, dtype=object), ("d",)), PartitionSpec())
    return jax.jit(lambda xs: jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]), out_shardings=replicated)


def _describe_nonfinite(names: list[str]) -> str:
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"non-finite values in {', '.join(names[:3])}{more}"


def _file_checksums(step_dir: epath.Path) -> dict[str, tuple[int, int]]:
    """Size and crc32 of every file under `step_dir` but the manifest, by path relative to it."""
    paths = [root / name for root, _, names in step_dir.walk() for name in names]
    return {
        os.fspath(path.relative_to(step_dir)): _checksum(path)
        for path in sorted(paths)
        if path.name not in (MANIFEST, f".{MANIFEST}.tmp")
    }


def _checksum(path: epath.Path) -> tuple[int, int]:
    size, crc = 0, 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            size += len(chunk)
            crc = zlib.crc32(chunk, crc)
    return size, crc


def write_manifest(step_dir: str | os.PathLike[str]) -> int:
    """Write the manifest of a committed step directory (under a temporary name, then renamed into place);
    the number of bytes checksummed."""
    directory = epath.Path(step_dir)
    files = _file_checksums(directory)
    record = {"format": 1, "checksum": "crc32", "files": {name: list(sc) for name, sc in files.items()}}
    temporary = directory / f".{MANIFEST}.tmp"
    temporary.write_text(json.dumps(record, indent=0))
    temporary.replace(directory / MANIFEST)
    return sum(size for size, _ in files.values())


def check_manifest(step_dir: str | os.PathLike[str]) -> tuple[bool, str | None]:
    """(whether `step_dir` has a readable manifest, why its files do not match it or None when they do).

    Files the manifest does not list are ignored; a listed file that is missing, of another size or of
    another checksum is a mismatch.
    """
    directory = epath.Path(step_dir)
    try:
        listed = json.loads((directory / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return False, None
    except (ValueError, KeyError, TypeError) as err:
        logger.warning("unreadable manifest in %s (%s); treating the checkpoint as unverified", directory, err)
        return False, None
    for name, (size, _) in listed.items():
        path = directory / name
        if not path.is_file():
            return True, f"file {name} is missing"
        actual = path.stat().length
        if actual != size:
            return True, f"file {name} has {actual} bytes, its manifest says {size}"
    for name, (_, crc) in listed.items():
        if _checksum(directory / name)[1] != crc:
            return True, f"file {name} does not match its checksum"
    return True, None


class TrainCheckpointer:
    """Saves and restores training checkpoints in `directory` (local or gs://)."""

    STATE = "state"
    METADATA = "metadata"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        config: CheckpointConfig | None = None,
        *,
        before_save: Callable[[], None] | None = None,
    ):
        """`before_save` runs before each checkpoint is written (a gs:// run uploads its records up to the
        step first, so a crash never leaves a checkpoint newer than the bucket's metrics)."""
        self.directory = directory
        self.config = config or CheckpointConfig()
        self.before_save = before_save
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.config.max_to_keep,
            enable_async_checkpointing=self.config.async_save,
            cleanup_tmp_directories=True,
            multiprocessing_options=ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=BARRIER_PREFIX),
        )
        self._manager = ocp.CheckpointManager(
            checkpoint_location(directory), item_names=(self.STATE, self.METADATA), options=options
        )
        self._manifests = ThreadPoolExecutor(max_workers=1, thread_name_prefix="areal-ckpt-manifest")
        self._manifest_job: tuple[int, Future[int]] | None = None

    # -- saving --------------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    @classmethod
    def latest_in(cls, directory: str | os.PathLike[str]) -> int | None:
        """The newest finished checkpoint step in `directory`, creating nothing (None when there is none)."""
        location = checkpoint_location(directory)
        if not epath.Path(location).exists():
            return None
        manager = list_live_steps(lambda: cls.reader(location), directory)
        try:
            return manager.latest_step()
        finally:
            manager.close()

    @classmethod
    def reader(cls, location: str | os.PathLike[str]) -> ocp.CheckpointManager:
        """A read-only manager of the Orbax `location` (creating it lists the steps: call it through
        `list_live_steps` where a live run may be deleting them)."""
        return ocp.CheckpointManager(
            location, item_names=(cls.STATE, cls.METADATA), options=ocp.CheckpointManagerOptions(read_only=True)
        )

    def maybe_save(self, step: int, state: Any, metadata: Metadata | Callable[[], Metadata]) -> bool:
        """Save when `step` is a multiple of `every_steps`; whether it did. `metadata` may be a callable,
        evaluated only when a checkpoint is written."""
        if step % self.config.every_steps:
            return False
        self.save(step, state, metadata() if callable(metadata) else metadata)
        return True

    def save(self, step: int, state: Any, metadata: Metadata, *, wait: bool = False) -> None:
        """Write checkpoint `step` (skipped if it exists); `wait` blocks until it is committed and verifiable.

        Raises `CheckpointError`, writing nothing, when a floating array of `state` is not finite.
        """
        self._finish_manifest()
        latest = self._manager.latest_step()
        if latest is not None and step < latest:
            raise ValueError(f"checkpoint step {step} is older than the newest checkpoint {latest} in {self.directory}")
        if step == latest:
            logger.debug("checkpoint %d exists; not saving it again", step)
        else:
            record = {**metadata, "step": step}
            try:
                json.dumps(record)
            except (TypeError, ValueError) as err:
                raise TypeError(f"checkpoint metadata at step {step} is not JSON-serialisable: {err}") from None
            if self.before_save is not None:
                self.before_save()
            started = time.perf_counter()
            nonfinite = nonfinite_leaves(state)
            if nonfinite:
                raise CheckpointError(
                    f"refusing to save checkpoint {step} in {self.directory}: {_describe_nonfinite(nonfinite)}; "
                    f"the newest checkpoint stays {latest}"
                )
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(
                    **{self.STATE: ocp.args.StandardSave(state), self.METADATA: ocp.args.JsonSave(record)}
                ),
            )
            if not saved:
                raise RuntimeError(f"Orbax refused to save checkpoint step {step} in {self.directory}")
            logger.info(
                "saving checkpoint %d: %d bytes, %.3f s blocking",
                step,
                tree_nbytes(state),
                time.perf_counter() - started,
            )
            if jax.process_index() == 0:
                self._manifest_job = (step, self._manifests.submit(self._commit_then_write_manifest, step))
        if wait:
            self.wait()

    def wait(self) -> None:
        """Block until every started save is committed and its manifest written."""
        self._manager.wait_until_finished()
        self._finish_manifest()

    def _step_dir(self, step: int) -> epath.Path:
        return epath.Path(self._manager.directory) / str(step)

    def _commit_then_write_manifest(self, step: int) -> int:
        """(background thread) Wait for Orbax to commit `step`, then write its manifest; the bytes covered.

        Orbax's `save` of the next step waits for the same commit, and `save` joins this job before it, so
        the step cannot be garbage-collected while it is checksummed.
        """
        self._manager.wait_until_finished()
        started = time.perf_counter()
        nbytes = write_manifest(self._step_dir(step))
        logger.info("manifest of checkpoint %d: %d bytes in %.3f s", step, nbytes, time.perf_counter() - started)
        return nbytes

    def _finish_manifest(self) -> None:
        """Wait for the manifest of the last save; a failure leaves that checkpoint unverified, not lost."""
        if self._manifest_job is None:
            return
        step, job = self._manifest_job
        self._manifest_job = None
        try:
            job.result()
        except Exception as err:  # the checkpoint stands without its manifest
            logger.error("no manifest for checkpoint %d (it will restore unverified): %s", step, err)

    # -- restoring -----------------------------------------------------------------------------

    def restore(self, target: Any, step: int | None = None) -> RestoredCheckpoint:
        """Checkpoint `step` with its arrays placed as `target` says (abstract arrays carrying the current
        mesh's shardings, e.g. `weights.abstract_target(fresh_state)`), verified as `restore_verified` does;
        raises `CheckpointError` when it is bad. Without `step`: `restore_verified(target)`."""
        if step is None:
            return self.restore_verified(target)
        target_shardings(target)
        self._finish_manifest()
        self._manager.reload()
        if step not in self._manager.all_steps():
            raise FileNotFoundError(f"no training checkpoint {step} in {self.directory}")
        restored = self._restore_checked(target, step)
        if isinstance(restored, str):
            raise CheckpointError(f"checkpoint {step} in {self.directory} is unusable: {restored}", [(step, restored)])
        return restored

    def restore_verified(self, target: Any, min_step: int | None = None) -> RestoredCheckpoint:
        """The newest good checkpoint (of step `min_step` or later) on `target`'s shardings.

        A checkpoint whose files do not match its manifest, that Orbax cannot read, or whose floating arrays
        are not all finite is rejected with a warning naming it and why, and the previous one is tried; the
        result lists the rejected ones. Raises `FileNotFoundError` when there is no checkpoint, and
        `CheckpointError` (listing each step and its reason) when none is good. Collective in a multi-process
        job: process 0 checks the manifests and tells the others.
        """
        target_shardings(target)
        self._finish_manifest()
        self._manager.reload()
        steps = sorted((s for s in self._manager.all_steps() if min_step is None or s >= min_step), reverse=True)
        if not steps:
            since = "" if min_step is None else f" of step {min_step} or later"
            raise FileNotFoundError(f"no training checkpoint{since} in {self.directory}")
        rejected: list[tuple[int, str]] = []
        for step in steps:
            restored = self._restore_checked(target, step)
            if not isinstance(restored, str):
                return dataclasses.replace(restored, rejected=tuple(rejected))
            logger.warning("checkpoint %d in %s rejected: %s", step, self.directory, restored)
            rejected.append((step, restored))
        listing = "; ".join(f"step {step}: {reason}" for step, reason in rejected)
        raise CheckpointError(f"no good training checkpoint in {self.directory} ({listing})", rejected)

    def _restore_checked(self, target: Any, step: int) -> RestoredCheckpoint | str:
        """Checkpoint `step` restored and checked, or why it is bad."""
        started = time.perf_counter()
        has_manifest, mismatch = self._agreed_manifest_check(step)
        if mismatch is not None:
            return mismatch
        checked = time.perf_counter()
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    **{self.STATE: ocp.args.StandardRestore(target), self.METADATA: ocp.args.JsonRestore()}
                ),
            )
            failure = None
        except Exception as err:  # whatever Orbax or TensorStore raise
            restored, failure = None, f"Orbax could not read it ({type(err).__name__}: {str(err)[:300]})"
        if not _all_processes(failure is None):
            return failure or "Orbax could not read it on another process"
        state = restored[self.STATE]
        nonfinite = nonfinite_leaves(state)
        if nonfinite:
            return _describe_nonfinite(nonfinite)
        if not has_manifest:
            logger.warning(
                "checkpoint %d in %s has no manifest (its save ended before one was written, or it predates "
                "manifests); accepted unverified: Orbax read it and its arrays are finite",
                step,
                self.directory,
            )
        logger.info(
            "restored checkpoint %d: %d bytes in %.3f s (manifest check %.3f s)",
            step,
            tree_nbytes(state),
            time.perf_counter() - started,
            checked - started,
        )
        return RestoredCheckpoint(step, state, dict(restored[self.METADATA]), verified=has_manifest)

    def _agreed_manifest_check(self, step: int) -> tuple[bool, str | None]:
        """`check_manifest` of `step`, run on process 0 and broadcast to the others."""
        if jax.process_count() == 1:
            return check_manifest(self._step_dir(step))
        has_manifest = False
        mismatch: str | None = "its files do not match its manifest (checked on process 0)"
        if jax.process_index() == 0:
            has_manifest, mismatch = check_manifest(self._step_dir(step))
        code = 2 if mismatch else int(has_manifest)
        code = int(multihost_utils.broadcast_one_to_all(np.int32(code)))
        return code != 0, mismatch if code == 2 else None

    def close(self) -> None:
        """Wait for pending saves, put back the previous signal handlers and release Orbax's resources."""
        self.wait()
        self._manifests.shutdown()
        self._manager.close()


def _all_processes(ok: bool) -> bool:
    """Whether `ok` holds on every process (an all-gather in a multi-process job)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))

"""Training checkpoints: the trainer's arrays plus JSON metadata, with Orbax, every N steps and on a signal.

A checkpoint is one Orbax step directory with two items: `state`, any pytree of arrays the trainer passes
(params and optimizer state), written with `StandardSave`; and `metadata`, a JSON object (policy version,
RNG key data via `rng_to_json`, the data pipeline's `get_state()`, staleness counters, ...), to which the
step is added. Saves are asynchronous and atomic (Orbax writes a temporary directory and renames it).

Signals. `install_signal_handlers()` makes SIGTERM/SIGINT only set a flag (a second one acts as before
the handler was installed). The training loop calls `maybe_save(step, state, metadata)` after each step;
it saves when `step` is a multiple of `every_steps`, or, when the flag is set, saves synchronously and
returns True, and the loop then exits cleanly; in a multi-process job the flag of any process counts for
all (every process must take part in the save). `restore(target)` places the arrays as the caller's target
says (abstract arrays with the current mesh's shardings), whatever mesh shape they were saved from.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import FrameType
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from areal_jax.configuration import Config, option
from areal_jax.weights.base import checkpoint_location, target_shardings, tree_nbytes

logger = logging.getLogger(__name__)

Metadata = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Config):
    """When training checkpoints are written and how many are kept."""

    every_steps: int = option(100, ge=1, doc="save after every step that is a multiple of this")
    max_to_keep: int = option(2, ge=1, doc="newest checkpoints kept on disk")
    async_save: bool = option(True, doc="write in the background; the loop only waits for the device-to-host copy")


@dataclasses.dataclass(frozen=True)
class RestoredCheckpoint:
    """What `restore` returns: the step, the arrays on the target shardings, and the JSON metadata."""

    step: int
    state: Any
    metadata: dict[str, Any]


def rng_to_json(key: jax.Array) -> dict[str, Any]:
    """A JSON-ready record of a PRNG key (typed `jax.random.key` or raw uint32 `PRNGKey`)."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return {"impl": str(jax.random.key_impl(key)), "data": np.asarray(jax.random.key_data(key)).tolist()}
    return {"impl": None, "data": np.asarray(key).tolist()}


def rng_from_json(record: Mapping[str, Any]) -> jax.Array:
    """The key `rng_to_json` recorded."""
    data = np.asarray(record["data"], dtype=np.uint32)
    if record["impl"] is None:
        return jax.numpy.asarray(data)
    return jax.random.wrap_key_data(data, impl=record["impl"])


class TrainCheckpointer:
    """Saves and restores training checkpoints in `directory` (local or gs://)."""

    STATE = "state"
    METADATA = "metadata"

    def __init__(self, directory: str | os.PathLike[str], config: CheckpointConfig | None = None):
        self.directory = directory
        self.config = config or CheckpointConfig()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.config.max_to_keep,
            enable_async_checkpointing=self.config.async_save,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(
            checkpoint_location(directory), item_names=(self.STATE, self.METADATA), options=options
        )
        self._stop = threading.Event()
        self._signal: int | None = None
        self._previous: dict[int, Any] = {}

    # -- signals -------------------------------------------------------------------------------

    def install_signal_handlers(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
        """Make the given signals request a final save instead of ending the process (main thread only)."""
        for signum in signals:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def uninstall_signal_handlers(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum
        self._stop.set()
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    def request_stop(self) -> None:
        """Ask the loop to save and stop, as a signal would."""
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def _stop_agreed(self) -> bool:
        """This process's stop flag, or in a multi-process job whether any process has it (an all-gather),
        so that every process takes the collective final save together."""
        if jax.process_count() == 1:
            return self._stop.is_set()
        flags = multihost_utils.process_allgather(np.asarray(self._stop.is_set()))
        return bool(np.any(flags))

    # -- saving --------------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    @classmethod
    def latest_in(cls, directory: str | os.PathLike[str]) -> int | None:
        """The newest finished checkpoint step in `directory`, creating nothing (None when there is none)."""
        location = checkpoint_location(directory)
        if not epath.Path(location).exists():
            return None
        manager = ocp.CheckpointManager(
            location, item_names=(cls.STATE, cls.METADATA), options=ocp.CheckpointManagerOptions(read_only=True)
        )
        try:
            return manager.latest_step()
        finally:
            manager.close()

    def maybe_save(self, step: int, state: Any, metadata: Metadata | Callable[[], Metadata]) -> bool:
        """Save if `step` is due or a stop was requested; True when the loop should stop now.

        `metadata` may be a callable, evaluated only when a checkpoint is written.
        """
        stopping = self._stop_agreed()
        if stopping or step % self.config.every_steps == 0:
            self.save(step, state, metadata() if callable(metadata) else metadata, wait=stopping)
        if stopping:
            name = signal.Signals(self._signal).name if self._signal is not None else "a stop request"
            logger.info("stopping after step %d on %s; checkpoint saved", step, name)
        return stopping

    def save(self, step: int, state: Any, metadata: Metadata, *, wait: bool = False) -> None:
        """Write checkpoint `step` (skipped if it exists); `wait` blocks until it is committed."""
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
            started = time.perf_counter()
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
        if wait:
            self.wait()

    def wait(self) -> None:
        """Block until every started save is committed."""
        self._manager.wait_until_finished()

    # -- restoring -----------------------------------------------------------------------------

    def restore(self, target: Any, step: int | None = None) -> RestoredCheckpoint:
        """Checkpoint `step` (default: the newest) with its arrays placed as `target` says (abstract arrays
        carrying the current mesh's shardings, e.g. `weights.abstract_target(fresh_state)`)."""
        target_shardings(target)
        self._manager.reload()
        if step is None:
            step = self._manager.latest_step()
            if step is None:
                raise FileNotFoundError(f"no training checkpoint in {self.directory}")
        started = time.perf_counter()
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                **{self.STATE: ocp.args.StandardRestore(target), self.METADATA: ocp.args.JsonRestore()}
            ),
        )
        state = restored[self.STATE]
        logger.info(
            "restored checkpoint %d: %d bytes in %.3f s", step, tree_nbytes(state), time.perf_counter() - started
        )
        return RestoredCheckpoint(step, state, dict(restored[self.METADATA]))

    def close(self) -> None:
        """Wait for pending saves, put back the previous signal handlers and release Orbax's resources."""
        self.wait()
        self.uninstall_signal_handlers()
        self._manager.close()

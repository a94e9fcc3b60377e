"""The in-process weight channel: one JAX program, trainer and inference meshes, reshard by `device_put`.

The published params are copied device-to-device (`sharding.copy_to`: never aliasing the source, no host
round trip) at publish time, onto the inference shardings if they were given, so the trainer may donate its
buffers to the next step as soon as `publish` returns. Only the newest version is kept.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import jax

from areal_jax.sharding import copy_to
from areal_jax.weights.base import LoadedWeights, target_shardings, tree_nbytes

logger = logging.getLogger(__name__)


class InProcessWeights:
    """Publisher and subscriber in one object; thread-safe (the trainer and the generator may be threads)."""

    def __init__(self, target: Any | None = None):
        """`target`: the inference side's shardings (leaves `Sharding` or `ShapeDtypeStruct`); None keeps
        published copies on the trainer's shardings and reshards on `load`."""
        self._shardings = None if target is None else target_shardings(target)
        self._cond = threading.Condition()
        self._params: Any = None
        self._version: int | None = None

    def publish(self, params: Any, version: int) -> None:
        with self._cond:
            latest = self._version
        if latest is not None and version <= latest:
            raise ValueError(f"version {version} is not newer than the latest published version {latest}")
        started = time.perf_counter()
        destination = self._shardings if self._shardings is not None else jax.tree.map(lambda a: a.sharding, params)
        copy = jax.block_until_ready(copy_to(params, destination))
        seconds = time.perf_counter() - started
        nbytes = tree_nbytes(copy)
        with self._cond:
            self._params, self._version = copy, version
            self._cond.notify_all()
        logger.info("published weights version %d in process: %d bytes in %.3f s", version, nbytes, seconds)

    def latest_version(self) -> int | None:
        with self._cond:
            return self._version

    def wait_for_version(self, min_version: int, timeout_s: float | None = None) -> int | None:
        with self._cond:
            ready = self._cond.wait_for(
                lambda: self._version is not None and self._version >= min_version, timeout=timeout_s
            )
            return self._version if ready else None

    def load(self, version: int, target: Any) -> LoadedWeights:
        with self._cond:
            params, latest = self._params, self._version
        if latest is None:
            raise LookupError("no weights were published yet")
        if version > latest:
            raise ValueError(f"version {version} was not published; the latest is {latest}")
        if version < latest:
            logger.debug("weights version %d was replaced; loading %d", version, latest)
        started = time.perf_counter()
        loaded = jax.block_until_ready(jax.device_put(params, target_shardings(target)))
        seconds = time.perf_counter() - started
        nbytes = tree_nbytes(loaded)
        logger.info("loaded weights version %d in process: %d bytes in %.3f s", latest, nbytes, seconds)
        return LoadedWeights(loaded, latest, nbytes, seconds)

    def close(self) -> None:
        with self._cond:
            self._params = None

"""The weight channel's interface (publisher / subscriber), the loaded-weights record and pytree helpers."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import jax
from jax.sharding import Sharding

from areal_jax import storage

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoadedWeights:
    """Params loaded onto the reader's shardings, the version they are, and what the load cost."""

    params: Any
    version: int
    nbytes: int
    seconds: float
    source: str = "orbax"  # the path they came by: "orbax" (the store) or "direct" (the transfer server)
    published_at: float | None = None  # wall-clock time the version became loadable by that path, if known
    fell_back: bool = False  # a direct pull failed and the store delivered instead


class WeightPublisher(Protocol):
    """The trainer's end: hand out params under a strictly increasing version."""

    def publish(self, params: Any, version: int) -> None:
        """Make `params` (a pytree of arrays) available as `version`; the caller may donate them afterwards."""
        ...

    def close(self) -> None: ...


class WeightSubscriber(Protocol):
    """The rollout side's end: find the newest version and load it onto its own shardings."""

    def latest_version(self) -> int | None:
        """The newest complete version, or None if nothing was published yet."""
        ...

    def wait_for_version(self, min_version: int, timeout_s: float | None = None) -> int | None:
        """Block until a version >= `min_version` exists; that version, or None after `timeout_s`."""
        ...

    def load(self, version: int, target: Any) -> LoadedWeights:
        """`version` (or, if it was replaced meanwhile, the newest one) placed as `target` says.

        `target` is a pytree like the published params whose leaves are `jax.ShapeDtypeStruct`s carrying
        the reader's shardings (see `abstract_target`).
        """
        ...

    def close(self) -> None: ...


def poll_for_version(
    latest_version: Callable[[], int | None],
    min_version: int,
    timeout_s: float | None,
    closed: threading.Event,
    delays: Iterator[float],
) -> int | None:
    """`WeightSubscriber.wait_for_version` by polling: call `latest_version` until it is >= `min_version`
    (returned), the timeout passes or `closed` is set (None), sleeping the next of `delays` in between."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        latest = latest_version()
        if latest is not None and latest >= min_version:
            return latest
        remaining = None if deadline is None else deadline - time.monotonic()
        if (remaining is not None and remaining <= 0) or closed.is_set():
            return None
        delay = next(delays)
        closed.wait(delay if remaining is None else min(delay, remaining))


def abstract_target(tree: Any, shardings: Any | None = None) -> Any:
    """Abstract arrays (shape, dtype, sharding) to load or restore onto.

    `tree` holds arrays or `jax.ShapeDtypeStruct`s; `shardings` (same structure, `Sharding` leaves)
    replaces their shardings, e.g. `state_shardings(abstract_state, reader_mesh)`.
    """
    if shardings is None:
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def target_shardings(target: Any) -> Any:
    """The `Sharding` of every leaf of a target (leaves: `ShapeDtypeStruct` with a sharding, or `Sharding`)."""

    def one(path: Any, leaf: Any) -> Sharding:
        sharding = leaf if isinstance(leaf, Sharding) else getattr(leaf, "sharding", None)
        if not isinstance(sharding, Sharding):
            raise ValueError(
                f"target leaf {jax.tree_util.keystr(path)} ({leaf!r}) carries no sharding; "
                "build the target with abstract_target(tree, shardings)"
            )
        return sharding

    return jax.tree_util.tree_map_with_path(one, target)


def tree_nbytes(tree: Any) -> int:
    """Total bytes of the arrays (or abstract arrays) of a pytree."""
    return sum(int(leaf.size) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def checkpoint_location(directory: str | os.PathLike[str]) -> str | Path:
    """An Orbax-ready location: a `gs://` URL unchanged, a local path made absolute (Orbax requires it)."""
    text = os.fspath(directory)
    return text if storage.is_remote(text) else Path(text).absolute()


_Listed = TypeVar("_Listed")
_LISTING_ATTEMPTS = 20


def list_live_steps(read: Callable[[], _Listed], directory: str | os.PathLike[str]) -> _Listed:
    """`read()` (anything that makes Orbax list the steps of `directory`), tried again while a step vanishes
    under it: Orbax lists the step names and then reads each one's metadata, and a live writer may delete the
    oldest step (`max_to_keep`) in between."""
    for _ in range(_LISTING_ATTEMPTS):
        try:
            return read()
        except (FileNotFoundError, NotADirectoryError):
            continue
    raise RuntimeError(f"cannot list the steps of {directory}: they keep vanishing while listed")

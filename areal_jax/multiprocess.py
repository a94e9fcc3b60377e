"""This process's place among the trainer's processes, and the small collectives that carry process 0's
decisions to the others (`jax.experimental.multihost_utils`: an all-gather of flags, a broadcast of bytes, an
all-gather of bytes). With one process every method returns the local value and no collective runs. A leaf:
the weight paths and the system layer both use it (`system/trainer_processes.py` says what the trainer's
processes share).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

T = TypeVar("T")

_MIN_BROADCAST_WORDS = 1024  # byte broadcasts are padded to powers of two (few shapes: few compilations)


class ProcessZeroFailed(RuntimeError):
    """Process 0 failed at something it does alone; its message, on the other processes."""


class TrainerProcesses:
    """This process's place among the trainer's processes, and the collectives that share process 0's
    decisions. Every process must make the same calls in the same order."""

    def __init__(self) -> None:
        self.index = jax.process_index()
        self.count = jax.process_count()

    @property
    def primary(self) -> bool:
        """Process 0: reads the rollout log, writes the run's files, decides."""
        return self.index == 0

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any process."""
        if self.count == 1:
            return flag
        return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))

    def share_bytes(self, data: bytes | None) -> bytes:
        """Process 0's `data` on every process (the others pass None)."""
        if self.count == 1:
            assert data is not None
            return data
        length = 0
        if self.primary:
            assert data is not None
            length = len(data)
        size = int(multihost_utils.broadcast_one_to_all(np.int32(length)))
        shared = multihost_utils.broadcast_one_to_all(_words(data if self.primary else None, size))
        return _bytes(np.asarray(shared), size)

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every process's `data`, in process order, on every process."""
        if self.count == 1:
            return [data]
        sizes = np.asarray(multihost_utils.process_allgather(np.int32(len(data)))).reshape(-1)
        gathered = np.asarray(multihost_utils.process_allgather(_words(data, int(sizes.max()))))
        return [_bytes(row, int(size)) for row, size in zip(gathered, sizes, strict=True)]

    def share(self, value: Any) -> Any:
        """Process 0's JSON-ready `value` on every process."""
        if self.count == 1:
            return value
        return json.loads(self.share_bytes(json.dumps(value).encode() if self.primary else None))

    def gather(self, value: Any) -> list[Any]:
        """Every process's JSON-ready `value`, in process order, on every process."""
        return [json.loads(data) for data in self.gather_bytes(json.dumps(value).encode())]

    def on_primary(self, action: Callable[[], T]) -> T | None:
        """`action()` on process 0 alone, the others waiting for it; None on the others. An exception on
        process 0 is raised there and, as `ProcessZeroFailed` with its message, on every other process."""
        if self.count == 1:
            return action()
        result, failure = None, None
        if self.primary:
            try:
                result = action()
            except Exception as err:
                failure = err
        message = self.share(None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        if message is not None:
            raise ProcessZeroFailed(f"trainer process 0 failed: {message}")
        return result

    def barrier(self, name: str) -> None:
        if self.count > 1:
            multihost_utils.sync_global_devices(name)


def _words(data: bytes | None, size: int) -> np.ndarray:
    """`data` (None: zeros) as uint32 words, padded to hold `size` bytes in a power of two of words (few
    shapes: few compilations). Words, as a collective sums or moves uint8 widened to 4 bytes anyway."""
    words = max(_MIN_BROADCAST_WORDS, 1 << (-(-size // 4) - 1).bit_length())
    buffer = np.zeros(words * 4, np.uint8)
    if data is not None:
        buffer[: len(data)] = np.frombuffer(data, np.uint8)
    return buffer.view(np.uint32)


def _bytes(words: np.ndarray, size: int) -> bytes:
    return np.asarray(words, np.uint32).view(np.uint8)[:size].tobytes()

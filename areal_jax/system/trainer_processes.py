"""The trainer's processes (`distributed.enabled`): what process 0 alone decides, and how the others learn it.

Every trainer process runs the same loop on one global mesh, and each step's computations are collective:
every process must call them in the same order, on the same batch. So process 0 alone reads the rollout
log and decides each batch, when to stop, what a checkpoint's metadata says, and writes the run's files;
the others receive its decisions through small collectives (`jax.experimental.multihost_utils`: an
all-gather of flags, a broadcast of bytes; an all-gather of bytes for what each process holds, e.g. its
direct weight offers). With one process every method returns the local value and no collective runs, so
the one-process paths are unchanged.

`SharedBatches` is the batch source of several processes: process 0 takes each batch from its pipeline in
a helper thread while every process meets it once per `ROUND_S` in an all-gather of stop flags, so a
signal to any process reaches process 0's pipeline within a round (and no process sits in one collective
while process 0 waits minutes for the rollout servers). A ready batch is broadcast as rollout-log records.
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import msgpack
import numpy as np
from jax.experimental import multihost_utils

from areal_jax.data.rollout_log_records import decode_record, encode_record
from areal_jax.data.trajectory import Trajectory
from areal_jax.multiprocess import ProcessZeroFailed, TrainerProcesses

logger = logging.getLogger(__name__)


ROUND_S = 0.5  # how often the processes meet while process 0 waits for a batch


def encode_batch(batch: Sequence[Trajectory]) -> bytes:
    return msgpack.packb([encode_record(t, "batch", i, 0.0) for i, t in enumerate(batch)], use_bin_type=True)


def decode_batch(data: bytes) -> list[Trajectory]:
    return [decode_record(record)[3] for record in msgpack.unpackb(data, raw=False)]


def batch_digest(batch: Sequence[Trajectory]) -> int:
    """A checksum of what training reads from a batch, in order (to compare what processes trained on)."""
    crc = 0
    for t in batch:
        for array in (t.token_ids, t.behav_logprobs, t.versions, t.loss_mask):
            crc = zlib.crc32(np.ascontiguousarray(array).tobytes(), crc)
        head = np.asarray([t.group_id, t.sample_index, t.sequence_index, t.prompt_length], np.int64).tobytes()
        crc = zlib.crc32(head + np.float64(t.reward).tobytes() + t.prompt_id.encode(), crc)
    return crc


class SharedBatches:
    """Process 0's batches on every trainer process (see the module docstring).

    `take` (process 0 only) returns the next batch to train or None to stop; it runs in a helper thread,
    one call at a time, so the pipeline's position is always that of the batches handed out. `local_stop`
    is this process's stop flag (a signal); once any process has it, `peer_stop` is set on every process
    (process 0's pipeline stops on it).
    """

    def __init__(
        self,
        processes: TrainerProcesses,
        take: Callable[[], list[Trajectory] | None] | None,
        local_stop: Callable[[], bool],
        peer_stop: threading.Event,
    ):
        if processes.primary and take is None:
            raise ValueError("process 0 needs the function that takes its batches")
        self.processes = processes
        self.take = take
        self.local_stop = local_stop
        self.peer_stop = peer_stop
        self._executor = ThreadPoolExecutor(1, "areal-batches") if processes.primary else None
        self._pending: Future[list[Trajectory] | None] | None = None

    def next(self, step: int) -> list[Trajectory] | None:
        """The batch of step `step` on every process, None on every process to stop."""
        while True:
            ready = False
            if self._executor is not None:
                assert self.take is not None
                if self._pending is None:
                    self._pending = self._executor.submit(self.take)
                try:
                    self._pending.exception(timeout=ROUND_S)
                    ready = True
                except TimeoutError:
                    pass
            flags = multihost_utils.process_allgather(np.asarray([self.local_stop(), ready], np.int32))
            if np.any(flags[:, 0]):
                self.peer_stop.set()
            if flags[0, 1]:
                return self._share(step)

    def _share(self, step: int) -> list[Trajectory] | None:
        payload: dict[str, bytes | str | None] | None = None
        failure = None
        if self._pending is not None:
            try:
                batch = self._pending.result()
                payload = {"batch": None if batch is None else encode_batch(batch), "error": None}
            except Exception as err:
                failure = err
                payload = {"batch": None, "error": f"{type(err).__name__}: {err}"}
            finally:
                self._pending = None
        shared = msgpack.unpackb(
            self.processes.share_bytes(None if payload is None else msgpack.packb(payload, use_bin_type=True)),
            raw=False,
        )
        if failure is not None:
            raise failure
        if shared["error"] is not None:
            raise ProcessZeroFailed(f"trainer process 0 failed to read its batch: {shared['error']}")
        if shared["batch"] is None:
            return None
        batch = decode_batch(shared["batch"])
        logger.info(
            "batch of step %d on process %d: %d trajectories of %d groups, digest %08x",
            step,
            self.processes.index,
            len(batch),
            len({t.group_id for t in batch}),
            batch_digest(batch),
        )
        return batch

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

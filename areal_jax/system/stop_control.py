"""Every reason a training run stops, owned by one object the trainer loop asks once per step.

Sources, and what each means for the run:
- `train_steps` reached: the normal end (the last step is checkpointed and the policy exported);
- a stop request: SIGTERM/SIGINT (`watching_signals`: the first one only sets a flag, a second one acts as
  the handler it replaced) on any trainer process. The run saves a checkpoint, exports nothing as final
  and ends resumable;
- the rollout side failed (its failure budget, `rollout.failures`): `RunFailed` after the loop;
- every update of `trainer.max_skipped_steps` steps in a row skipped as non-finite: `RunFailed` at once.

`requested()` is this process's view (cheap, for the pipeline's waits); `agreed()` is the decision of all
trainer processes together, one all-gather per step (`TrainerProcesses.any`; none with one process), so
every process takes the collective final save together or none does.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

from areal_jax.multiprocess import TrainerProcesses

logger = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """The run cannot go on (rollouts keep failing, every update is skipped); the message says why."""


class StopControl:
    """See the module docstring. `failed` reports the rollout side's failure (set once known)."""

    def __init__(
        self,
        processes: TrainerProcesses,
        train_steps: int,
        max_skipped_steps: int,
        updates_per_step: int,
    ):
        self.processes = processes
        self.train_steps = train_steps
        self.max_skipped_steps = max_skipped_steps
        self.updates_per_step = updates_per_step
        self.peer = threading.Event()  # another trainer process asked to stop (set by the shared batch source)
        self.ended = threading.Event()  # the loop is over: whatever still waits for data gives up
        self.failed: Callable[[], bool] = lambda: False
        self._signal: int | None = None
        self._agreed = False
        self._skipped_in_a_row = 0

    @contextlib.contextmanager
    def watching_signals(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[None]:
        """Within: each of `signals` requests a stop once (main thread only); the old handlers come back after."""
        previous: dict[int, Any] = {}

        def on_signal(signum: int, frame: FrameType | None) -> None:
            self._signal = signum
            signal.signal(signum, previous.get(signum, signal.SIG_DFL))  # a second one acts as before

        for signum in signals:
            previous[signum] = signal.signal(signum, on_signal)
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    @property
    def signalled(self) -> bool:
        """This process has a stop request (a signal)."""
        return self._signal is not None

    def requested(self) -> bool:
        """Any reason known to this process to stop waiting for data: a request here or on another process,
        the rollout side failed, or the loop is over."""
        return self.signalled or self.peer.is_set() or self.ended.is_set() or self.failed()

    def is_set(self) -> bool:  # the pipeline's stop check takes an Event-like object
        return self.requested()

    def agreed(self) -> bool:
        """Whether any trainer process has a stop request: the same answer on every process. Asked once per
        step (by `go_on`); sticky once true."""
        if not self._agreed:
            self._agreed = self.processes.any(self.signalled)
        return self._agreed

    def go_on(self, version: int) -> bool:
        """Whether the loop trains another step after `version`."""
        return version < self.train_steps and not self.agreed()

    @property
    def stopped_by_request(self) -> bool:
        """After the loop: it ended on a stop request (agreed by all processes), not on its steps or data."""
        return self._agreed

    def describe(self) -> str:
        return signal.Signals(self._signal).name if self._signal is not None else "a stop request"

    def count_skipped(self, skipped_updates: float) -> None:
        """After each step: raise `RunFailed` once every update of `max_skipped_steps` steps in a row was skipped."""
        if skipped_updates < self.updates_per_step:
            self._skipped_in_a_row = 0
            return
        self._skipped_in_a_row += 1
        if self._skipped_in_a_row >= self.max_skipped_steps:
            limit = self.max_skipped_steps
            raise RunFailed(
                f"every update of the last {limit} steps was skipped (non-finite loss or gradient; "
                f"trainer.max_skipped_steps={limit}); the newest checkpoint holds the last finite policy"
            )

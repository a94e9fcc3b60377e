"""The rollout controller: keeps the generator busy with workflows, as far ahead as staleness allows.

A background thread runs an asyncio loop. It admits one prompt at a time through the
`StalenessManager` (blocking while the bound is reached), takes the next `(group_id, task)` pair from
`tasks` (the task source decides group ids, so a resumed run can re-issue lost groups), starts
`workflow.run(generator, task, group_id)` as a task, and when a group finishes hands its trajectories to
`sink` (the rollout log's writer, or any callable) and reports the prompt accepted; a group dynamic sampling
drops (`rollout/dynamic_sampling.py`) is handed on marked untrained and reported rejected, so another prompt
takes its place; a failed workflow is logged and reported rejected, so capacity is never leaked; a group that
failed with `ReissueGroup` (kind 'external': its outside agents died) is counted the same way and issued again,
same group id, before the next task. Past the `FailureBudget` the controller stops admitting, records a
`RolloutFailure` in `failure` and calls `on_failure`. When `tasks` runs out, the running groups are finished
(any re-issued ones too) and `exhausted` is set. `stop()` stops admitting, cancels running workflows (which
abort their generator requests) and joins the thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from areal_jax.data.trajectory import Trajectory
from areal_jax.inference.generator import Generator
from areal_jax.rollout.dynamic_sampling import DynamicSampler, DynamicSamplingConfig, marked_untrained
from areal_jax.rollout.failures import FailureBudget, FailureBudgetConfig, ReissueGroup, RolloutFailure
from areal_jax.rollout.staleness import Admission, StalenessManager
from areal_jax.rollout.workflow import RolloutWorkflow

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ControllerStats:
    started: int = 0
    accepted: int = 0
    dropped: int = 0  # by dynamic sampling: logged, not trained
    failed: int = 0
    reissued: int = 0  # failed groups issued again (`ReissueGroup`), counted in `failed` too
    trajectories: int = 0


class RolloutController:
    """Drives `workflow` over `tasks` on `generator`; see the module docstring."""

    def __init__(
        self,
        generator: Generator,
        workflow: RolloutWorkflow,
        tasks: Iterator[tuple[int, Any]],
        staleness: StalenessManager,
        sink: Callable[[list[Trajectory]], None],
        failures: FailureBudgetConfig | None = None,
        on_failure: Callable[[], None] | None = None,
        dynamic_sampling: DynamicSamplingConfig | None = None,
    ):
        self.generator = generator
        self.workflow = workflow
        self.tasks = tasks
        self.staleness = staleness
        self.sink = sink
        self.stats = ControllerStats()
        self.exhausted = threading.Event()  # set once `tasks` ran out and every admitted group ended
        self.failure: RolloutFailure | None = None  # set when failing rollouts spent the budget
        self._budget = FailureBudget(failures or FailureBudgetConfig())
        self._sampler = DynamicSampler(dynamic_sampling or DynamicSamplingConfig())
        self._on_failure = on_failure
        self._next_group_id = 0
        self._reissue: collections.deque[tuple[int, Any]] = collections.deque()  # on the controller's loop
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._woken: asyncio.Event | None = None  # set by stop(): ends the wait for running groups
        self._error: BaseException | None = None

    def start(self) -> RolloutController:
        self._thread = threading.Thread(target=self._thread_main, name="areal-rollout", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self.staleness.close()  # wakes the admission wait; running workflows are cancelled on exit
        loop, woken = self._loop, self._woken
        if loop is not None and woken is not None:  # wakes the wait for running groups once the tasks ran out
            with contextlib.suppress(RuntimeError):  # its loop has ended already
                loop.call_soon_threadsafe(woken.set)
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise RuntimeError("rollout controller failed") from self._error

    @property
    def next_group_id(self) -> int:
        """One past the highest group id admitted so far (0 before the first)."""
        return self._next_group_id

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as err:
            logger.exception("rollout controller failed")
            self._error = err

    async def _main(self) -> None:
        self._loop, self._woken = asyncio.get_running_loop(), asyncio.Event()
        running: set[asyncio.Task] = set()
        try:
            await self._admit(running)
            if not self._stopping.is_set():
                self.exhausted.set()
        finally:
            for job in running:
                job.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)

    async def _admit(self, running: set[asyncio.Task]) -> None:
        """Admit and start groups until stopped or until the tasks (and the groups to issue again) ran out."""
        exhausted = False
        while not self._stopping.is_set():
            if exhausted and not self._reissue:
                if not running:
                    return
                await self._any_done(running)  # one may be issued again
                continue
            admission = await asyncio.to_thread(self.staleness.wait_for_capacity)  # stop(), a failure close() it
            if admission is None:
                continue
            item = self._reissue.popleft() if self._reissue else next(self.tasks, None)
            if item is None:
                self.staleness.finish(admission, accepted=False)
                logger.info("task source exhausted; waiting for %d running groups", len(running))
                exhausted = True
                continue
            group_id, task = item
            self._next_group_id = max(self._next_group_id, group_id + 1)
            self.stats.started += 1
            job = asyncio.create_task(self._one(task, group_id, admission))
            running.add(job)
            job.add_done_callback(running.discard)

    async def _any_done(self, running: set[asyncio.Task]) -> None:
        """Returns once a running group ended, or stop() was called."""
        assert self._woken is not None  # made by _main
        woken = asyncio.ensure_future(self._woken.wait())
        try:
            await asyncio.wait([*running, woken], return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()

    async def _one(self, task: Any, group_id: int, admission: Admission) -> None:
        handed_on = dropped = False
        try:
            trajectories = await self.workflow.run(self.generator, task, group_id)
            if dropped := self._sampler.drops(trajectories):
                trajectories = marked_untrained(trajectories)
            handoff = asyncio.ensure_future(asyncio.to_thread(self.sink, trajectories))
            try:
                await asyncio.shield(handoff)
            except asyncio.CancelledError:
                # a hand-over that started always completes and is counted, or the bound would drift
                await asyncio.wait([handoff])
                handed_on = handoff.exception() is None
                raise
            handed_on = True
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self._failed(err, f"task {getattr(task, 'id', task)} (group {group_id})")
            if isinstance(err, ReissueGroup) and self.failure is None:
                self.stats.reissued += 1
                self._reissue.append((group_id, task))
        finally:
            if handed_on:
                self._budget.succeeded()
                self.stats.dropped += dropped
                self.stats.accepted += not dropped
                self.stats.trajectories += len(trajectories)
            # a dropped group counts as rejected: the trainer never consumes it, so its place admits another
            self.staleness.finish(admission, accepted=handed_on and not dropped)
        if handed_on and dropped and (stop := self._sampler.exhausted()) is not None:
            self._stop_with(stop)

    def _failed(self, error: Exception, where: str) -> None:
        self.stats.failed += 1
        if self._budget.should_log():
            logger.error("workflow failed for %s (%d failures so far): %s", where, self._budget.failed + 1, error)
        stop = self._budget.failed_with(error, where)
        if self._budget.failed == 1:
            logger.error("the first failure's traceback:\n%s", self._budget.first_failure)
        if stop is not None:
            self._stop_with(stop)

    def _stop_with(self, failure: RolloutFailure) -> None:
        if self.failure is not None:
            return
        logger.error("stopping the rollouts: %s", failure)
        self.failure = failure
        self._stopping.set()
        self.staleness.close()
        if self._on_failure is not None:
            self._on_failure()

"""When failing rollouts stop a run: a budget over the recent outcomes of the rollout workflows.

A workflow fails when generation, the reward or the environment raises. One failure is logged and
skipped; a run whose rollouts keep failing (a reward that always raises, a prompt the engine cannot
take) must stop with an error that says why, instead of retrying forever. The budget trips when
`max_consecutive` rollouts in a row failed, or when more than `max_failed_share` of the last `window`
rollouts failed (checked once the window is full). The first failure's traceback is kept for the error.
"""

from __future__ import annotations

import collections
import dataclasses
import traceback

from areal_jax.configuration import Config, option

_LOGGED_FAILURES = 10


@dataclasses.dataclass(frozen=True)
class FailureBudgetConfig(Config):
    """How many failed rollouts a run tolerates."""

    max_consecutive: int = option(16, ge=1, doc="stop after this many failed rollouts in a row")
    window: int = option(64, ge=1, doc="recent rollouts the failure share is taken over")
    max_failed_share: float = option(
        0.5, gt=0, le=1, doc="stop when more than this share of the last `window` rollouts failed"
    )


class ReissueGroup(RuntimeError):
    """A group failed in a way that its task is run again: the controller counts the failure and issues the
    same group id again (kind 'external': the outside agents that had it died)."""


class RolloutFailure(RuntimeError):
    """Rollouts failed beyond the budget; the message names the counts and the first failure."""


class FailureBudget:
    """Counts rollout outcomes (one owner: the rollout controller's thread)."""

    def __init__(self, config: FailureBudgetConfig):
        self.config = config
        self.failed = 0
        self.consecutive = 0
        self.first_failure: str | None = None
        self._recent: collections.deque[bool] = collections.deque(maxlen=config.window)

    def succeeded(self) -> None:
        self.consecutive = 0
        self._recent.append(True)

    def failed_with(self, error: BaseException, where: str) -> RolloutFailure | None:
        """Record a failure; the error to stop the run with when the budget is spent, else None."""
        self.failed += 1
        self.consecutive += 1
        self._recent.append(False)
        if self.first_failure is None:
            self.first_failure = f"{where}: " + "".join(traceback.format_exception(error)).rstrip()
        cfg = self.config
        failed_recent = self._recent.count(False)
        if self.consecutive >= cfg.max_consecutive:
            why = (
                f"{self.consecutive} rollouts in a row failed (rollout.failures.max_consecutive={cfg.max_consecutive})"
            )
        elif len(self._recent) == cfg.window and failed_recent > cfg.max_failed_share * cfg.window:
            why = (
                f"{failed_recent} of the last {cfg.window} rollouts failed "
                f"(rollout.failures.max_failed_share={cfg.max_failed_share})"
            )
        else:
            return None
        return RolloutFailure(f"{why}; the first failure was {self.first_failure}")

    def should_log(self) -> bool:
        """Whether this failure gets its own log line (the first few, then every 100th)."""
        return self.failed <= _LOGGED_FAILURES or self.failed % 100 == 0

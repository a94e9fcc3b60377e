"""Progress of the long phases of a start (checkpoint load, compiles, the first batch), as log lines: a
counted phase logs where it is at most every few seconds and once when done; a wait logs its status
periodically until it ends. A run at real size is never silent for minutes."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)


class Progress:
    """`total` counted steps of `what`; `advance(detail)` after each step. Logs `what i/total (detail), N s`
    when `every_s` passed since the last line, and a closing line from `done()`."""

    def __init__(self, what: str, total: int, every_s: float = 10.0, log: logging.Logger = logger):
        self.what, self.total, self.every_s, self.log = what, total, every_s, log
        self.count = 0
        self.started = self._last = time.perf_counter()

    def advance(self, detail: str = "") -> None:
        self.count += 1
        now = time.perf_counter()
        if now - self._last >= self.every_s and self.count < self.total:
            self._last = now
            suffix = f" ({detail})" if detail else ""
            self.log.info("%s: %d/%d%s, %.0f s so far", self.what, self.count, self.total, suffix, now - self.started)

    def done(self, summary: str = "") -> float:
        """Log the closing line; returns the phase's seconds."""
        seconds = time.perf_counter() - self.started
        suffix = f", {summary}" if summary else ""
        self.log.info("%s: %d/%d done in %.1f s%s", self.what, self.count, self.total, seconds, suffix)
        return seconds


@contextlib.contextmanager
def heartbeat(
    what: str, status: Callable[[], str], every_s: float = 15.0, log: logging.Logger = logger
) -> Iterator[None]:
    """While the block runs, log `what: <status()>, N s` every `every_s` seconds (from a daemon thread; `status`
    must only read values another thread may read)."""
    stop = threading.Event()
    started = time.perf_counter()

    def beat() -> None:
        while not stop.wait(every_s):
            log.info("%s: %s, %.0f s so far", what, status(), time.perf_counter() - started)

    thread = threading.Thread(target=beat, daemon=True, name="areal-heartbeat")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()

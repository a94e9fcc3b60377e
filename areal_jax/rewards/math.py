"""Math answer reward: extract the final answer, judge it with math-verify in a killable process pool.

The answer is taken from the last well-formed `\\boxed{...}` (nested braces allowed), else from the
configured fallbacks ("the answer is X", the last number). Equivalence (fractions, radicals, intervals,
units, sets) is decided by `math_verify.parse` / `math_verify.verify` inside worker processes; a call
that runs past `timeout_s` has its worker killed and replaced, so a pathological answer such as
`9^{9^{9^{9}}}` costs one timeout, never a stalled trainer. `format` and `correct` are reported apart.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import logging
import multiprocessing
import os
import queue
import re
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Literal, TypeVar

from areal_jax.configuration import Config, ConfigError, option

logger = logging.getLogger(__name__)

R = TypeVar("R")
Fallback = Literal["answer_is", "last_number"]
Status = Literal["ok", "no_answer", "too_long", "timeout", "worker_died"]


@dataclasses.dataclass(frozen=True)
class MathRewardConfig(Config):
    """Settings of the math answer reward."""

    timeout_s: float = option(5.0, gt=0, doc="wall-clock limit of one verification; past it the worker is killed")
    num_workers: int = option(2, ge=1, le=256, doc="verification worker processes (and concurrent calls)")
    fallbacks: tuple[Fallback, ...] = option(
        ("answer_is", "last_number"), doc="answer extractors tried, in order, when no \\boxed{} answer is found"
    )
    fallback_counts_as_format: bool = option(
        False, doc="whether an answer found only by a fallback earns the format reward"
    )
    max_answer_chars: int = option(1000, gt=0, doc="longer extracted answers score 0 without being parsed")
    float_rounding: int = option(6, ge=0, le=30, doc="decimal places math-verify rounds floats to")
    start_method: Literal["forkserver", "spawn"] = option("forkserver", doc="how worker processes are started")
    startup_timeout_s: float = option(120.0, gt=0, doc="limit for a worker to start and import math-verify")

    def validate(self) -> None:
        if len(set(self.fallbacks)) != len(self.fallbacks):
            raise ConfigError("fallbacks", f"got {list(self.fallbacks)!r}; each extractor may appear once")


@dataclasses.dataclass(frozen=True)
class MathReward:
    """Score of one response: `correct` and `format` in {0, 1}, plus how the answer was found."""

    correct: float
    format: float
    answer: str | None
    source: Literal["boxed", "answer_is", "last_number", "none"]
    status: Status

    def components(self) -> dict[str, float]:
        return {"correct": self.correct, "format": self.format}


class CallTimeout(TimeoutError):
    """A pool call ran past its deadline; its worker was killed and replaced."""


# ---------------------------------------------------------------------------------------------- extraction

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\b")
_ANSWER_IS_RE = re.compile(r"answer is[:\s]*", re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
_TOKEN_RE = re.compile(r"[^\s$]+")


def _closing_braces(text: str) -> dict[int, int]:
    """Position of each "{" mapped to its matching "}" (unclosed ones absent), honouring `\\{` escapes; linear."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            pairs[stack.pop()] = i
        i += 1
    return pairs


def last_boxed(text: str) -> str | None:
    """The content of the last well-formed `\\boxed{...}` (or `\\boxed x`) in `text`, stripped; None if none."""
    matches = list(_BOXED_RE.finditer(text))
    closing = _closing_braces(text) if matches else {}
    for match in reversed(matches):
        rest = match.end()
        while rest < len(text) and text[rest] == " ":
            rest += 1
        if rest < len(text) and text[rest] == "{":
            end = closing.get(rest)
            content = text[rest + 1 : end] if end is not None else None
        else:
            token = _TOKEN_RE.match(text, rest)
            content = token.group(0) if token else None
        if content is not None and content.strip():
            return content.strip()
    return None


def _answer_is(text: str) -> str | None:
    matches = list(_ANSWER_IS_RE.finditer(text))
    if not matches:
        return None
    tail = text[matches[-1].end() :].split("\n", 1)[0]
    return tail.strip().strip("$").rstrip(". \t").strip("$").strip() or None


def _last_number(text: str) -> str | None:
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


_FALLBACKS: dict[str, Callable[[str], str | None]] = {"answer_is": _answer_is, "last_number": _last_number}


def extract_answer(
    text: str, fallbacks: Sequence[Fallback] = ("answer_is", "last_number")
) -> tuple[str | None, Literal["boxed", "answer_is", "last_number", "none"]]:
    """The final answer in `text` and which extractor found it: the last `\\boxed{}`, then each fallback."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    for name in fallbacks:
        found = _FALLBACKS[name](text)
        if found:
            return found, name
    return None, "none"


# ---------------------------------------------------------------------------------------------- worker side


def _worker_init() -> None:
    """Import math-verify (sympy: ~0.8 s, paid by the workers, not by every process that reads a reward config),
    silence its 'timeout disabled' notice (the pool enforces the timeout) and ignore Ctrl-C."""
    import math_verify  # noqa: F401

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list[Any]:
    from math_verify import parse

    return parse("\\boxed{" + gold + "}", parsing_timeout=None)


def judge(answer: str, gold: str, float_rounding: int = 6) -> tuple[bool, bool]:
    """(answer parses to a math object, answer is equivalent to gold), judged by math-verify without a timeout."""
    from math_verify import parse, verify

    parsed = parse("\\boxed{" + answer + "}", parsing_timeout=None)
    if not parsed:
        return False, False
    parsable = any(not isinstance(item, str) for item in parsed)
    equal = verify(_parse_gold(gold), parsed, float_rounding=float_rounding, timeout_seconds=None)
    return parsable, bool(equal)


# ---------------------------------------------------------------------------------------------- process pool


class _Worker:
    """One single-process executor whose process id is known, so it can be killed."""

    def __init__(self, context: multiprocessing.context.BaseContext, initializer: Callable[[], None] | None):
        self.executor = cf.ProcessPoolExecutor(max_workers=1, mp_context=context, initializer=initializer)
        self._pid = self.executor.submit(os.getpid)

    def pid(self, timeout_s: float) -> int:
        return self._pid.result(timeout=timeout_s)

    def kill(self) -> None:
        """SIGKILL the process and reap it; a worker still starting is abandoned to finish on its own."""
        started = self._pid.done() and self._pid.exception() is None
        if started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid.result(), signal.SIGKILL)
        self.executor.shutdown(wait=started, cancel_futures=True)


class KillablePool:
    """Process pool whose calls have a hard deadline: a worker that overruns is killed and a fresh one started.

    Each worker is its own one-process `ProcessPoolExecutor`; a call borrows an idle worker, waits until it
    has started (bounded by `startup_timeout_s`, not counted against the call), then waits `timeout_s`.
    Thread-safe; at most `num_workers` calls run at once and further callers block.
    """

    def __init__(
        self,
        num_workers: int,
        start_method: str = "forkserver",
        initializer: Callable[[], None] | None = None,
        startup_timeout_s: float = 120.0,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self._context = multiprocessing.get_context(start_method)
        self._initializer = initializer
        self._startup_timeout_s = startup_timeout_s
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._all: set[_Worker] = set()
        for _ in range(num_workers):
            self._idle.put(self._new_worker())

    def _new_worker(self) -> _Worker:
        worker = _Worker(self._context, self._initializer)
        with self._lock:
            self._all.add(worker)
        return worker

    def _replace(self, worker: _Worker) -> _Worker:
        with self._lock:
            self._all.discard(worker)
        worker.kill()
        return self._new_worker()

    def call(self, fn: Callable[..., R], *args: Any, timeout_s: float) -> R:
        """`fn(*args)` in a worker; raises `CallTimeout` past `timeout_s` and `BrokenProcessPool` if it died."""
        if self._closed:
            raise RuntimeError("KillablePool.call after close()")
        worker = self._idle.get()
        try:
            try:
                worker.pid(self._startup_timeout_s)
            except (cf.TimeoutError, BrokenProcessPool) as err:
                worker = self._replace(worker)
                raise BrokenProcessPool(f"worker did not start within {self._startup_timeout_s}s: {err!r}") from err
            future = worker.executor.submit(fn, *args)
            try:
                return future.result(timeout=timeout_s)
            except cf.TimeoutError:
                worker = self._replace(worker)
                raise CallTimeout(f"{getattr(fn, '__name__', fn)} ran past {timeout_s}s; worker killed") from None
            except BrokenProcessPool:
                worker = self._replace(worker)
                raise
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        """Kill every worker and wait for the executors to wind down."""
        self._closed = True
        with self._lock:
            workers, self._all = list(self._all), set()
        for worker in workers:
            worker.kill()

    def __enter__(self) -> KillablePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------- reward


class MathVerifier:
    """Scores responses against gold answers; owns the verification pool (close it, or use `with`)."""

    def __init__(self, config: MathRewardConfig | None = None):
        self.config = config or MathRewardConfig()
        self._pool = KillablePool(
            self.config.num_workers,
            start_method=self.config.start_method,
            initializer=_worker_init,
            startup_timeout_s=self.config.startup_timeout_s,
        )

    def score(self, response: str, gold: str) -> MathReward:
        """Reward components of one response against one gold answer (a LaTeX or plain string)."""
        cfg = self.config
        answer, source = extract_answer(response, cfg.fallbacks)
        if answer is None:
            return MathReward(0.0, 0.0, None, "none", "no_answer")
        if len(answer) > cfg.max_answer_chars:
            return MathReward(0.0, 0.0, answer[: cfg.max_answer_chars], source, "too_long")
        try:
            parsable, equal = self._pool.call(judge, answer, gold, cfg.float_rounding, timeout_s=cfg.timeout_s)
        except CallTimeout:
            logger.warning("math verification timed out after %ss for answer %.80r", cfg.timeout_s, answer)
            return MathReward(0.0, 0.0, answer, source, "timeout")
        except BrokenProcessPool as err:
            logger.warning("math verification worker died for answer %.80r: %s", answer, err)
            return MathReward(0.0, 0.0, answer, source, "worker_died")
        earns_format = parsable and (source == "boxed" or cfg.fallback_counts_as_format)
        return MathReward(float(equal), float(earns_format), answer, source, "ok")

    def score_batch(self, items: Sequence[tuple[str, str]]) -> list[MathReward]:
        """`score` over (response, gold) pairs, `num_workers` at a time, results in input order."""
        with cf.ThreadPoolExecutor(max_workers=self.config.num_workers) as threads:
            return list(threads.map(lambda pair: self.score(*pair), items))

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

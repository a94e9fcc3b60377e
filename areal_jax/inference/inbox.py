"""The generator loop's inbox: the commands other threads post to the loop, and the one locked object
through which they reach it."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading

from areal_jax.inference.engine import VersionedParams
from areal_jax.inference.requests import Request


@dataclasses.dataclass(eq=False)
class Submit:
    """Register a request."""

    request: Request


@dataclasses.dataclass(eq=False)
class Abort:
    """Finish a request's samples now, with reason 'abort'."""

    request_id: str


@dataclasses.dataclass(eq=False)
class Update:
    """Swap in new weights between two decode steps; `done` resolves with their version once in use."""

    params: VersionedParams
    interrupt: bool
    done: concurrent.futures.Future


class Close:
    """Stop the loop: the last command it takes."""


Command = Submit | Abort | Update | Close


class Inbox:
    """The loop's only link to other threads: any thread posts commands, the loop takes all of them at
    once. Once shut (closed, or the loop failed) it refuses new commands."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._commands: list[Command] = []
        self._shut = False
        self._error: BaseException | None = None

    def post(self, command: Command) -> None:
        """Deliver `command`; raises RuntimeError when the generator is closed or its loop failed."""
        with self._cond:
            if self._error is not None:
                raise RuntimeError("generator loop failed") from self._error
            if self._shut:
                raise RuntimeError("generator is closed")
            self._commands.append(command)
            self._cond.notify()

    def offer(self, command: Command) -> bool:
        """Deliver `command` unless the inbox is shut; True when delivered."""
        with self._cond:
            if self._shut:
                return False
            self._commands.append(command)
            self._cond.notify()
            return True

    def take(self, block: bool) -> list[Command]:
        """Every command posted so far, in order; with `block`, waits for at least one."""
        with self._cond:
            while block and not self._commands:
                self._cond.wait()
            commands, self._commands = self._commands, []
        return commands

    def close(self) -> None:
        """Refuse new commands; the loop stops after those already posted."""
        with self._cond:
            if not self._shut:
                self._shut = True
                self._commands.append(Close())
                self._cond.notify()

    def shut(self, error: BaseException | None) -> list[Command]:
        """Refuse new commands (naming `error` when the loop failed); returns those never taken."""
        with self._cond:
            self._shut = True
            self._error = self._error or error
            commands, self._commands = self._commands, []
        return commands


def resolve(future: concurrent.futures.Future, result: object = None, error: BaseException | None = None) -> None:
    """Answer `future` unless its caller already cancelled it."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

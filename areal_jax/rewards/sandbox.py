"""Run untrusted Python source in a contained process and report how it ended.

`Sandbox.run` supervises a run from the outside: a private temporary directory, a minimal environment, a
wall-clock deadline and output caps, and afterwards a kill of the process group plus a sweep of every
process of the run's uid. Inside, `sandbox_launcher.py` (run as a script) contains the run and executes
the solution. Linux only (>= 5.3 for pidfd). docs/rewards.md lists each measure and its fallback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from areal_jax.configuration import Config, option
from areal_jax.rewards import sandbox_launcher
from areal_jax.rewards.sandbox_launcher import MEMORY_EXIT, WORLD_WRITABLE, uid_pids


@dataclasses.dataclass(frozen=True)
class SandboxLimits(Config):
    """Resource limits of one run (the code reward's config carries them: `reward.code.timeout_s`, ...)."""

    timeout_s: float = option(6.0, gt=0, doc="wall-clock limit of one test case; the whole run is killed past it")
    cpu_s: int = option(0, ge=0, doc="CPU-seconds rlimit of one case; 0 means ceil(timeout_s)")
    memory_mb: int = option(1024, ge=64, doc="address-space rlimit of the solution process, MiB")
    file_mb: int = option(16, ge=1, doc="largest file the solution may write, MiB")
    open_files: int = option(64, ge=16, doc="open file descriptors rlimit")
    processes: int = option(32, ge=1, doc="process-count rlimit (enforced when run as root with a per-run uid)")
    max_output_bytes: int = option(1 << 20, ge=1024, doc="stdout beyond this ends the case as output_limit")
    max_stderr_bytes: int = option(1 << 16, ge=1024, doc="stderr kept for diagnostics; the rest is discarded")
    tmpfs_mb: int = option(64, ge=1, doc="size of each private tmpfs (/tmp, /var/tmp, /dev/shm) of a run")

    @property
    def cpu_limit_s(self) -> int:
        """The CPU-seconds rlimit: `cpu_s`, or the wall-clock limit rounded up when `cpu_s` is 0."""
        return self.cpu_s or math.ceil(self.timeout_s)


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """How a run ended: exit code or signal, captured output, which limits tripped, and the containment used."""

    exit_code: int | None
    signal: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    output_limited: bool
    memory_error: bool
    error: str | None
    wall_s: float
    cpu_s: float
    containment: dict[str, Any]


class Sandbox:
    """Runs Python source under `limits`; thread-safe, one uid per concurrent run.

    `uid_base`/`uid_span`: the range of unprivileged uids runs are given when this process is root (a
    uid is leased with an abstract-socket lock, so concurrent runs, in this or other processes, never
    share one). `namespaces`: try network/mount/PID/IPC namespaces. `work_root`: where run directories go.
    """

    def __init__(
        self,
        limits: SandboxLimits = SandboxLimits(),
        *,
        python: str = "",
        work_root: str = "",
        uid_base: int = 200_000_000,
        uid_span: int = 4096,
        namespaces: bool = True,
        site_packages: bool = False,
    ):
        self.limits = limits
        self.python = python or sys.executable
        self.work_root = work_root or tempfile.gettempdir()
        self.uid_base = uid_base
        self.uid_span = uid_span
        self.namespaces = namespaces
        self.site_packages = site_packages
        self.is_root = os.geteuid() == 0

    def run(self, source: str, *, stdin: str = "", call: tuple[str, list[Any]] | None = None) -> SandboxResult:
        """Execute `source`: as a script reading `stdin`, or, with `call=(fn_name, args)`, call that function."""
        with self._lease_uid() as uid:
            started = time.monotonic()
            try:
                workdir = tempfile.mkdtemp(prefix="areal-sbx-", dir=self.work_root)
            except OSError as err:
                return _failed(f"cannot make a run directory in {self.work_root!r}: {err}", 0.0)
            try:
                self._prepare(workdir, uid, source, stdin, call)
            except (OSError, TypeError, ValueError) as err:
                self._cleanup(workdir, uid)
                return _failed(f"cannot prepare the run directory {workdir!r}: {err!r}", time.monotonic() - started)
            try:
                return self._launch(workdir, uid, call)
            finally:
                self._cleanup(workdir, uid)

    @contextlib.contextmanager
    def _lease_uid(self) -> Iterator[int | None]:
        if not self.is_root:
            yield None
            return
        start = random.randrange(self.uid_span)
        for k in range(self.uid_span):
            uid = self.uid_base + (start + k) % self.uid_span
            lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                lock.bind(f"\0areal-sandbox-uid-{uid}")
            except OSError:
                lock.close()
                continue
            try:
                yield uid
            finally:
                lock.close()
            return
        raise RuntimeError(f"all {self.uid_span} sandbox uids from {self.uid_base} are in use")

    def _prepare(self, workdir: str, uid: int | None, source: str, stdin: str, call: Any) -> None:
        with open(os.path.join(workdir, "solution.py"), "w", encoding="utf-8") as f:
            f.write(source)
        if call is None:
            with open(os.path.join(workdir, "input.txt"), "w", encoding="utf-8") as f:
                f.write(stdin)
        else:
            with open(os.path.join(workdir, "args.json"), "w", encoding="utf-8") as f:
                json.dump(call[1], f)
        if uid is not None:
            for name in [workdir, *(os.path.join(workdir, n) for n in os.listdir(workdir))]:
                os.chown(name, uid, uid)

    def _launch(self, workdir: str, uid: int | None, call: Any) -> SandboxResult:
        lim = self.limits
        spec = {
            "workdir": workdir,
            "uid": uid,
            "mode": "stdin" if call is None else "call",
            "fn_name": None if call is None else call[0],
            "limits": {**dataclasses.asdict(lim), "cpu_s": lim.cpu_limit_s},
            "namespaces": self.namespaces,
        }
        status_r, status_w = os.pipe()
        spec["status_fd"] = status_w
        flags = ["-I", "-B"] + ([] if self.site_packages else ["-S"])
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": "/tmp"}
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                [self.python, *flags, os.path.abspath(sandbox_launcher.__file__), json.dumps(spec)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=env,
                start_new_session=True,
                pass_fds=(status_w,),
            )
        except OSError as err:
            os.close(status_r)
            return _failed(f"could not start the launcher {self.python!r}: {err}", time.monotonic() - started)
        finally:
            os.close(status_w)
        try:
            stdout, stderr, timed_out, limited = self._supervise(proc, started + lim.timeout_s)
        finally:
            _stop(proc)
            leftovers = _sweep_uid(uid) if uid is not None else []
            proc.wait()
            status = _read_status(status_r)
        wall = time.monotonic() - started
        containment = dict(status.get("containment", {}))
        containment.update(uid=uid, leftover_pids=leftovers, proc_private=status.get("proc_private", False))
        end = status.get("end", {})
        error = status.get("error")
        if error is None and not (timed_out or limited) and not end:
            error = f"launcher ended without a report (exit {proc.returncode}): {stderr[-500:]!r}"
        exit_code, sig = end.get("exit"), end.get("signal")
        return SandboxResult(
            exit_code=exit_code,
            signal=sig,
            stdout=stdout,
            stderr=stderr,
            timed_out=timed_out,
            output_limited=limited,
            memory_error=exit_code == MEMORY_EXIT,
            error=error,
            wall_s=wall,
            cpu_s=float(end.get("cpu_s", 0.0)),
            containment=containment,
        )

    def _supervise(self, proc: subprocess.Popen[bytes], deadline: float) -> tuple[bytes, bytes, bool, bool]:
        """Drain stdout/stderr until the launcher exits, the deadline passes or stdout exceeds its cap."""
        assert proc.stdout is not None and proc.stderr is not None
        caps = {proc.stdout.fileno(): self.limits.max_output_bytes, proc.stderr.fileno(): self.limits.max_stderr_bytes}
        chunks: dict[int, list[bytes]] = {fd: [] for fd in caps}
        sizes = dict.fromkeys(caps, 0)
        pidfd = os.pidfd_open(proc.pid)
        timed_out = limited = exited = False
        with selectors.DefaultSelector() as sel:
            for fd in caps:
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_READ)
            sel.register(pidfd, selectors.EVENT_READ)
            try:
                while sel.get_map():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        timed_out = not exited
                        break
                    for key, _ in sel.select(min(remaining, 0.5)):
                        fd = key.fd
                        if fd == pidfd:
                            exited = True
                            sel.unregister(pidfd)
                            deadline = min(deadline, time.monotonic() + 0.5)  # drain what is left
                            continue
                        data = _read_some(fd)
                        if data is None:
                            continue
                        if not data:
                            sel.unregister(fd)
                            continue
                        room = caps[fd] - sizes[fd]
                        chunks[fd].append(data[: max(room, 0)])
                        sizes[fd] += len(data)
                        if sizes[fd] > caps[fd] and fd == proc.stdout.fileno():
                            limited = True
                    if limited:
                        break
            finally:
                os.close(pidfd)
        out, err = (b"".join(chunks[fd]) for fd in caps)
        proc.stdout.close()
        proc.stderr.close()
        return out, err, timed_out, limited

    def _cleanup(self, workdir: str, uid: int | None) -> None:
        shutil.rmtree(workdir, ignore_errors=True)
        if uid is not None:
            for top in WORLD_WRITABLE:
                _remove_owned(top, uid, depth=3)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End a run: ask the launcher to kill and reap it (SIGTERM), then SIGKILL the whole process group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _failed(error: str, wall_s: float) -> SandboxResult:
    return SandboxResult(None, None, b"", b"", False, False, False, error, wall_s, 0.0, {})


def _read_some(fd: int) -> bytes | None:
    """Up to 64 KiB from a non-blocking pipe; b"" at end of file, None when nothing is ready yet."""
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _read_status(fd: int) -> dict[str, Any]:
    """Merge the JSON lines the launcher wrote to the status pipe."""
    data = b""
    os.set_blocking(fd, False)
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            data += chunk
    os.close(fd)
    merged: dict[str, Any] = {}
    for line in data.splitlines():
        with contextlib.suppress(ValueError):
            merged.update(json.loads(line))
    return merged


def _sweep_uid(uid: int, passes: int = 200) -> list[int]:
    """SIGKILL every process of `uid` until none is left; returns the pids still alive after `passes`."""
    for _ in range(passes):
        pids = uid_pids(uid)
        if not pids:
            return []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.002)
    return uid_pids(uid)


def _remove_owned(top: str, uid: int, depth: int) -> None:
    """Delete entries owned by `uid` under world-writable `top`, recursing into world-writable dirs."""
    try:
        entries = list(os.scandir(top))
    except OSError:
        return
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid == uid:
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
        elif depth > 1 and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IWOTH:
            _remove_owned(entry.path, uid, depth - 1)

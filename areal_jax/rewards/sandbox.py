"""Run untrusted Python source in a contained process and report how it ended.

Imported, this module offers `Sandbox.run`, which supervises a run from the outside: a private temporary
directory, a minimal environment, a wall-clock deadline and output caps, and afterwards a kill of the
process group plus a sweep of every process of the run's uid. Executed as a script
(`python -I -S -B sandbox.py SPEC`) it is the launcher inside the run: the subreaper of everything the
solution starts, it enters new network, mount, PID and IPC namespaces where the kernel allows, gives the
run a private /tmp and a read-only root, sets rlimits, drops to a per-run unprivileged uid, executes the
solution, and kills and reaps whatever is left. Stdlib only, so the launcher starts without site-packages.
Linux only (>= 5.3 for pidfd). docs/rewards.md lists each measure and its fallback.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import dataclasses
import json
import os
import random
import resource
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from typing import Any

MEMORY_EXIT = 120  # the harness exits with this code after a MemoryError
SETUP_EXIT = 121  # the launcher could not build the sandbox
RESULT_MARK = b"\x1e@@areal-sandbox-result@@"  # call mode: the line carrying the JSON return value

_CLONE_NEWNS = 0x00020000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_CHILD_SUBREAPER = 36
_CAP_VERSION_3 = 0x20080522
_WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_PRELOAD = (  # stdlib modules solutions commonly use, imported before privileges drop (see docs/rewards.md)
    "array",
    "bisect",
    "cmath",
    "collections",
    "collections.abc",
    "copy",
    "dataclasses",
    "datetime",
    "decimal",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "io",
    "itertools",
    "json",
    "math",
    "numbers",
    "operator",
    "queue",
    "random",
    "re",
    "statistics",
    "string",
    "struct",
    "textwrap",
    "typing",
    "encodings.idna",  # str hosts in socket calls need it; without it a network attempt fails before the kernel
)


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one run."""

    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 1024
    file_mb: int = 16
    open_files: int = 64
    processes: int = 32
    stdout_bytes: int = 1 << 20
    stderr_bytes: int = 1 << 16
    tmpfs_mb: int = 64


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

    # ------------------------------------------------------------------------------------------ outside

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
            "limits": dataclasses.asdict(lim),
            "namespaces": self.namespaces,
        }
        status_r, status_w = os.pipe()
        spec["status_fd"] = status_w
        flags = ["-I", "-B"] + ([] if self.site_packages else ["-S"])
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": "/tmp"}
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                [self.python, *flags, os.path.abspath(__file__), json.dumps(spec)],
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
            stdout, stderr, timed_out, limited = self._supervise(proc, started + lim.wall_s)
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
        caps = {proc.stdout.fileno(): self.limits.stdout_bytes, proc.stderr.fileno(): self.limits.stderr_bytes}
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
            for top in _WORLD_WRITABLE:
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


def _uid_pids(uid: int) -> list[int]:
    """Live (non-zombie) processes whose /proc entry belongs to `uid`."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if state != b"Z":
            pids.append(int(name))
    return pids


def _sweep_uid(uid: int, passes: int = 200) -> list[int]:
    """SIGKILL every process of `uid` until none is left; returns the pids still alive after `passes`."""
    for _ in range(passes):
        pids = _uid_pids(uid)
        if not pids:
            return []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.002)
    return _uid_pids(uid)


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


# ---------------------------------------------------------------------------------------------- inside

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def _unshare(flags: int) -> bool:
    return _libc.unshare(ctypes.c_int(flags)) == 0


def _write_status(fd: int, payload: dict[str, Any]) -> None:
    os.write(fd, json.dumps(payload).encode() + b"\n")


def _enter_namespaces(spec: dict[str, Any]) -> dict[str, Any]:
    """Unshare what the kernel allows and set up private mounts; returns what was achieved."""
    report: dict[str, Any] = {"net": False, "pid": False, "mount": False, "ipc": False, "user_ns": False}
    if not spec["namespaces"]:
        return report
    wanted = {"net": _CLONE_NEWNET, "mount": _CLONE_NEWNS, "pid": _CLONE_NEWPID, "ipc": _CLONE_NEWIPC}
    if spec["uid"] is None and _unshare(_CLONE_NEWUSER):  # not root: a user namespace may grant the rest
        report["user_ns"] = True
        uid, gid = os.getuid(), os.getgid()
        for path, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{path}", "w") as f:
                f.write(text)
    if _unshare(sum(wanted.values())):
        report.update(dict.fromkeys(wanted, True))
    else:
        for name, flag in wanted.items():
            report[name] = _unshare(flag)
    report["private_tmp"] = report["readonly_root"] = False
    if report["mount"]:
        _private_mounts(spec, report)
    return report


def _private_mounts(spec: dict[str, Any], report: dict[str, Any]) -> None:
    workdir = spec["workdir"]
    try:
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
        _mount(workdir, workdir, None, _MS_BIND)
        os.chdir(workdir)  # now inside the bind mount, which stays writable
    except OSError as err:
        report["mount_error"] = str(err)
        return
    try:
        _mount(None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY)
        report["readonly_root"] = True
    except OSError as err:
        report["readonly_root_error"] = str(err)
    covered = []
    for top in _WORLD_WRITABLE:
        if os.path.isdir(top) and not os.path.islink(top):
            opts = f"size={spec['limits']['tmpfs_mb']}m,mode=1777"
            try:
                _mount("tmpfs", top, "tmpfs", _MS_NOSUID | _MS_NODEV, opts)
                covered.append(top)
            except OSError as err:
                report["tmpfs_error"] = str(err)
    report["private_tmp"] = covered


def _uid_tasks(uid: int) -> int:
    """Threads of all processes of `uid`: what RLIMIT_NPROC counts."""
    total = 0
    for pid in _uid_pids(uid):
        with contextlib.suppress(OSError):
            total += len(os.listdir(f"/proc/{pid}/task"))
    return total


def _set_limits(limits: dict[str, Any], nproc: int) -> None:
    mb = 1024 * 1024
    pairs = [
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1)),
        (resource.RLIMIT_AS, limits["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, limits["file_mb"] * mb),
        (resource.RLIMIT_NOFILE, limits["open_files"]),
        (resource.RLIMIT_NPROC, nproc),
    ]
    for which, value in pairs:
        soft, hard = value if isinstance(value, tuple) else (value, value)
        resource.setrlimit(which, (soft, hard))


def _drop_privileges(uid: int | None) -> None:
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(_libc.capset(header, data), "capset")


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    sys.stderr.write(f"{exc.code}\n")
    return 1


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((_jsonable(v) for v in value), key=repr)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def _run_solution(spec: dict[str, Any], status_fd: int) -> int:
    """Set up the process, then run the solution; returns the exit code."""
    try:
        for name in _PRELOAD:
            __import__(name)
        with open("solution.py", encoding="utf-8") as f:
            source = f.read()
        args = None
        if spec["mode"] == "call":
            with open("args.json", encoding="utf-8") as f:
                args = json.load(f)
            stdin_fd = os.open(os.devnull, os.O_RDONLY)
        else:
            stdin_fd = os.open("input.txt", os.O_RDONLY)
        os.dup2(stdin_fd, 0)
        os.close(stdin_fd)
        _set_limits(spec["limits"], spec["nproc"])
        _drop_privileges(spec["uid"])
    except Exception as err:
        _write_status(status_fd, {"error": f"sandbox setup failed: {err!r}"})
        return SETUP_EXIT
    os.close(status_fd)
    name = "__main__" if args is None else "solution"
    scope: dict[str, Any] = {"__name__": name, "__builtins__": builtins, "__file__": "solution.py"}
    try:
        exec(compile(source, "solution.py", "exec"), scope)
        if args is not None:
            fn = scope.get(spec["fn_name"])
            if not callable(fn) and isinstance(scope.get("Solution"), type):
                fn = getattr(scope["Solution"](), spec["fn_name"], None)
            if not callable(fn):
                raise NameError(f"solution defines no function or Solution method {spec['fn_name']!r}")
            out = json.dumps(_jsonable(fn(*args)))
            sys.stdout.flush()
            os.write(1, b"\n" + RESULT_MARK + out.encode() + b"\n")
        code = 0
    except MemoryError:
        os.write(2, b"MemoryError\n")
        return MEMORY_EXIT
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
    except BaseException:
        code = code or 1
    return code


def _supervisor(spec: dict[str, Any], status_fd: int, report: dict[str, Any]) -> None:
    """PID 1 of the run (when a PID namespace exists): start the solution, wait, report, exit."""
    if report["pid"] and report["mount"]:
        try:
            _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
            _write_status(status_fd, {"proc_private": True})
        except OSError:
            _write_status(status_fd, {"proc_private": False})
    pid = os.fork()
    if pid == 0:
        code = _run_solution(spec, status_fd)
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    _, status, usage = os.wait4(pid, 0)
    end: dict[str, Any] = {"cpu_s": usage.ru_utime + usage.ru_stime, "maxrss_kb": usage.ru_maxrss}
    if os.WIFSIGNALED(status):
        end["signal"] = os.WTERMSIG(status)
    else:
        end["exit"] = os.WEXITSTATUS(status)
    _write_status(status_fd, {"end": end})
    os._exit(0)


def _children_of(pid: int) -> list[int]:
    kids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if int(fields[1]) == pid:
                kids.append(int(name))
    return kids


def _reap_all() -> None:
    """Kill and reap every child of the launcher (it is the subreaper of the run) until none is left."""
    me = os.getpid()
    while True:
        for kid in _children_of(me):
            with contextlib.suppress(ProcessLookupError):
                os.kill(kid, signal.SIGKILL)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _launcher_main(spec_json: str) -> None:
    """Enter namespaces, fork the supervisor, reap everything the run leaves; SIGTERM ends the run early."""
    spec = json.loads(spec_json)
    status_fd = spec["status_fd"]
    processes = spec["limits"]["processes"]
    # RLIMIT_NPROC counts every thread of the uid: a per-run uid starts from zero, a shared one from its load
    spec["nproc"] = processes if spec["uid"] is not None else _uid_tasks(os.getuid()) + processes
    try:
        _check(_libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(CHILD_SUBREAPER)")
        report = _enter_namespaces(spec)
    except Exception as err:
        _write_status(status_fd, {"error": f"sandbox namespace setup failed: {err!r}"})
        os._exit(SETUP_EXIT)
    _write_status(status_fd, {"containment": report})
    supervisor = os.fork()
    if supervisor == 0:
        try:
            _supervisor(spec, status_fd, report)
        finally:
            os._exit(SETUP_EXIT)
    os.close(status_fd)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(supervisor, signal.SIGKILL))
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, 0)[0] != supervisor:
            continue
    _reap_all()
    os._exit(0)


if __name__ == "__main__":
    _launcher_main(sys.argv[1])

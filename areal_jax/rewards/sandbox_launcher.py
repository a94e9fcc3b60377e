"""The sandbox's launcher: the process inside a run, started by `Sandbox.run` as
`python -I -S -B sandbox_launcher.py SPEC`.

It is the subreaper of everything the solution starts: it enters new network, mount, PID and IPC namespaces
where the kernel allows, gives the run a private /tmp and a read-only root, sets rlimits, drops to a
per-run unprivileged uid, executes the solution, and kills and reaps whatever is left; it reports what it
achieved as JSON lines on a status pipe. Stdlib only, so it starts without site-packages (and imports
nothing of areal_jax). Linux only. docs/rewards.md lists each measure and its fallback.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
import traceback
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
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
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
    "selectors",
    "shutil",
    "socket",
    "stat",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tempfile",
    "textwrap",
    "time",
    "typing",
    "encodings.idna",  # str hosts in socket calls need it; without it a network attempt fails before the kernel
)


def uid_pids(uid: int) -> list[int]:
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
    for top in WORLD_WRITABLE:
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
    for pid in uid_pids(uid):
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

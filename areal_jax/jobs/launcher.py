"""`areal-jax launch local`: the trainer (M processes) and N rollout server processes of one run on this machine.

Each role gets its own CPU cores (`os.sched_setaffinity` before it starts, so XLA's thread pool sizes itself
to them), its output is streamed here with a `[role]` prefix, and every child dies with the launcher
(`PR_SET_PDEATHSIG`). The servers start once the trainer has restored its state and published its
version (`control/trainer.json` with the trainer's pid). A rollout server that dies while the trainer
runs is started again (at most `cluster.restarts` times; it re-issues the groups it had in flight). The
run ends with the trainer: the servers leave on the trainer's stop marker (or are terminated after a
grace period). Ctrl-C or SIGTERM is passed to every child: the trainer checkpoints and the launcher
exits 75 (rerun with `--resume`).

A trainer over M > 1 processes (`--trainer-processes M`) joins through `jax.distributed` on localhost (a free
port; `distributed.*` set on each command line), each process on its own share of the trainer's cores.
Process 0 writes the ready marker. When one of them fails, the others cannot go on (every step is
collective): they are sent SIGTERM, then killed after the grace period; continue with `--resume`.

A rollout server over P > 1 processes (`--rollout-processes P`: one `jax.distributed` job per server, its
engine's mesh over all of them, `docs/distributed.md`) is restarted whole: when one of its processes fails,
the others are ended too and all P start again as a new job (a fresh coordinator port).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from areal_jax.config import ExperimentConfig
from areal_jax.exit_codes import EXIT_RESUMABLE
from areal_jax.system.cluster import ControlFiles

logger = logging.getLogger(__name__)

_GRACE_S = 30.0
_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class RoleSpec:
    name: str
    argv: tuple[str, ...]
    cores: frozenset[int]


def split_cores(cores: Sequence[int], trainer_cores: int) -> tuple[frozenset[int], frozenset[int]]:
    """(trainer's cores, the rollout servers' cores): the first `trainer_cores` for the trainer, the rest for
    the servers; on a single core both share it."""
    cores = sorted(cores)
    if len(cores) == 1:
        return frozenset(cores), frozenset(cores)
    if not 1 <= trainer_cores < len(cores):
        raise ValueError(f"--trainer-cores {trainer_cores} must leave 1..{len(cores) - 1} cores for the trainer")
    return frozenset(cores[:trainer_cores]), frozenset(cores[trainer_cores:])


def share_cores(cores: frozenset[int], processes: int) -> list[frozenset[int]]:
    """`cores` split into `processes` near-equal contiguous parts; with fewer cores than processes, the
    processes take them in turn."""
    ordered = sorted(cores)
    if len(ordered) < processes:
        return [frozenset({ordered[i % len(ordered)]}) for i in range(processes)]
    bounds = [len(ordered) * i // processes for i in range(processes + 1)]
    return [frozenset(ordered[bounds[i] : bounds[i + 1]]) for i in range(processes)]


def trainer_specs(
    config_args: Sequence[str],
    rollout_servers: int,
    cores: frozenset[int],
    *,
    resume: bool = False,
    overwrite: bool = False,
    processes: int = 1,
    port: int | None = None,
) -> list[RoleSpec]:
    """The trainer, `python -m areal_jax.cli trainer CONFIG overrides`: one process `trainer`, or `processes`
    > 1 processes `trainer0..` (process 0 first) of one `jax.distributed` job on localhost:`port`."""
    flags = (*(("--resume",) if resume else ()), *(("--overwrite",) if overwrite else ()))
    argv = (sys.executable, "-m", "areal_jax.cli", "trainer", *flags, *config_args)
    return _job("trainer", "", (*argv, f"cluster.rollout_servers={rollout_servers}"), cores, processes, port)


def server_specs(
    config_args: Sequence[str],
    rollout_servers: int,
    server: int,
    cores: frozenset[int],
    processes: int = 1,
    port: int | None = None,
) -> list[RoleSpec]:
    """Rollout server `server`: one process `rollout<i>`, or `processes` > 1 processes `rollout<i>.<p>` of
    one `jax.distributed` job on localhost:`port`."""
    argv = (sys.executable, "-m", "areal_jax.cli", "rollout", "--server", str(server), *config_args)
    argv = (*argv, f"cluster.rollout_servers={rollout_servers}")
    return _job(f"rollout{server}", ".", argv, cores, processes, port)


def _job(
    name: str, separator: str, argv: tuple[str, ...], cores: frozenset[int], processes: int, port: int | None
) -> list[RoleSpec]:
    """One process `name` on `cores`, or `processes` > 1 processes `name<separator><p>` sharing `cores`, each
    with the `distributed.*` settings of one job coordinated on localhost:`port`."""
    if processes == 1:
        return [RoleSpec(name, argv, cores)]
    if port is None:
        raise ValueError(f"{name} over several processes needs a coordinator port")
    distributed = (
        "distributed.enabled=true",
        f"distributed.coordinator_address=127.0.0.1:{port}",
        f"distributed.num_processes={processes}",
    )
    shares = share_cores(cores, processes)
    return [
        RoleSpec(f"{name}{separator}{p}", (*argv, *distributed, f"distributed.process_id={p}"), shares[p])
        for p in range(processes)
    ]


def _child_setup(cores: frozenset[int]) -> None:
    """In the child before exec: its cores, and death with the launcher."""
    os.sched_setaffinity(0, cores)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class _Child:
    """One running role: its process and the thread copying its output here."""

    def __init__(self, spec: RoleSpec, env: dict[str, str]):
        self.spec = spec
        self.process = subprocess.Popen(
            spec.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=lambda: _child_setup(spec.cores),
            text=True,
            bufsize=1,
        )
        self.pump = threading.Thread(target=self._stream, name=f"log-{spec.name}", daemon=True)
        self.pump.start()

    def _stream(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            sys.stdout.write(f"[{self.spec.name}] {line}")
            sys.stdout.flush()

    def poll(self) -> int | None:
        return self.process.poll()

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self.pump.join(timeout=5)
        return code


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_local(
    cfg: ExperimentConfig,
    config_args: Sequence[str],
    *,
    rollout_servers: int,
    trainer_cores: int | None = None,
    trainer_processes: int = 1,
    rollout_processes: int = 1,
    resume: bool = False,
    overwrite: bool = False,
) -> int:
    """Run the roles until the trainer ends; the trainer's exit status (see the module docstring)."""
    available = sorted(os.sched_getaffinity(0))
    trainer_set, rollout_set = split_cores(available, trainer_cores or max(1, len(available) // 2))
    trainers_port = _free_port() if trainer_processes > 1 else None
    trainer_roles = trainer_specs(
        config_args,
        rollout_servers,
        trainer_set,
        resume=resume,
        overwrite=overwrite,
        processes=trainer_processes,
        port=trainers_port,
    )

    def server(i: int) -> list[RoleSpec]:  # a fresh coordinator port at every (re)start of a multi-process one
        port = _free_port() if rollout_processes > 1 else None
        return server_specs(config_args, rollout_servers, i, rollout_set, rollout_processes, port)

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logger.info(
        "launching %s and %d rollout server(s) of %d process(es) on cores %s",
        ", ".join(f"{s.name} on cores {sorted(s.cores)}" for s in trainer_roles),
        rollout_servers,
        rollout_processes,
        sorted(rollout_set),
    )
    interrupted = threading.Event()
    control = ControlFiles(cfg.run_location, rollout_servers)
    trainers = [_Child(spec, env) for spec in trainer_roles]
    servers: dict[int, list[_Child]] = {}

    def forward(signum: int, _frame: object) -> None:
        interrupted.set()
        for child in [*trainers, *(c for group in servers.values() for c in group)]:
            child.signal(signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    restarts = dict.fromkeys(range(rollout_servers), 0)
    failure: tuple[int, float] | None = None  # a failed trainer process's exit status, when the others were told
    try:
        while any(trainer.poll() is None for trainer in trainers):
            time.sleep(0.2)
            if not interrupted.is_set():  # (then every trainer process saves and exits on its own)
                failure = _end_with_a_failed_trainer_process(trainers, failure)
            if interrupted.is_set() or failure is not None:
                continue
            if not servers:  # the servers start once the trainer has restored and published
                ready = control.ready_trainer()
                if ready is not None and ready.get("pid") == trainers[0].process.pid:
                    servers = {i: [_Child(spec, env) for spec in server(i)] for i in range(rollout_servers)}
                continue
            for i, group in servers.items():
                if not _server_failed(group):
                    continue
                if restarts[i] >= cfg.cluster.restarts:
                    if restarts[i] == cfg.cluster.restarts:
                        logger.error(
                            "%s exited %s; cluster.restarts=%d used up",
                            _names(group),
                            _codes(group),
                            cfg.cluster.restarts,
                        )
                        restarts[i] += 1
                    continue
                restarts[i] += 1
                logger.warning(
                    "%s exited %s; restarting it (%d of %d)",
                    _names(group),
                    _codes(group),
                    restarts[i],
                    cfg.cluster.restarts,
                )
                _stop(group)  # a server over several processes restarts whole: a new job, all its processes
                servers[i] = [_Child(spec, env) for spec in server(i)]
        codes = [trainer.wait() for trainer in trainers]
        code = failure[0] if failure is not None else next((c for c in codes if c != 0), 0)
        children = [child for group in servers.values() for child in group]
        if code != 0:  # no stop marker may have been written: stop the servers now
            for child in children:
                child.signal(signal.SIGTERM)
        for child in children:
            if child.wait(_GRACE_S) is None:
                logger.warning("%s did not stop within %.0f s; terminating it", child.spec.name, _GRACE_S)
                child.signal(signal.SIGTERM)
                if child.wait(_GRACE_S) is None:
                    child.signal(signal.SIGKILL)
                    child.wait()
        logger.info("trainer exited %s; restarts: %s", code, restarts)
        return int(code if code is not None else 1)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for child in [*trainers, *(c for group in servers.values() for c in group)]:
            if child.poll() is None:
                child.signal(signal.SIGKILL)


def _server_failed(group: list[_Child]) -> bool:
    """Whether a process of the server exited with an error (running, or left cleanly: not failed)."""
    return any(code not in (None, 0) for code in (child.poll() for child in group))


def _stop(group: list[_Child]) -> None:
    """End every process of a failed server (the others of a multi-process one exit by themselves once they
    lose it; SIGTERM, then SIGKILL after the grace period)."""
    for child in group:
        child.signal(signal.SIGTERM)
    for child in group:
        if child.wait(_GRACE_S) is None:
            child.signal(signal.SIGKILL)
            child.wait()


def _names(group: list[_Child]) -> str:
    return group[0].spec.name if len(group) == 1 else "/".join(child.spec.name for child in group)


def _codes(group: list[_Child]) -> str:
    return ", ".join(str(child.poll()) for child in group)


def _end_with_a_failed_trainer_process(
    trainers: list[_Child], failure: tuple[int, float] | None
) -> tuple[int, float] | None:
    """Once a trainer process has failed (exited, neither done nor stopped after its checkpoint), SIGTERM the
    others (they cannot go on without it), and SIGKILL those still running after the grace period.
    Returns (its exit status, when the others were told), or None while none has failed."""
    if failure is None:
        ended = ((t.spec.name, t.poll()) for t in trainers)
        failed = [(name, code) for name, code in ended if code is not None and code not in (0, EXIT_RESUMABLE)]
        if not failed or len(trainers) == 1:
            return None
        logger.error("trainer process %s exited %d; ending the others (continue with --resume)", *failed[0])
        for trainer in trainers:
            trainer.signal(signal.SIGTERM)
        return failed[0][1], time.monotonic()
    if time.monotonic() - failure[1] > _GRACE_S:
        for trainer in trainers:
            trainer.signal(signal.SIGKILL)
    return failure

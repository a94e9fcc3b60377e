"""The command channel of a rollout server over several processes: process 0 sends, the others follow.

One TCP connection from each other process to process 0, carrying length-prefixed frames. Process 0
sends each command to every follower (`CommandSender.send`, from whichever thread holds the caller's
lock); each follower reads them in order (`CommandReceiver.receive`) and, from a thread of its own, sends
a heartbeat every `HEARTBEAT_S` with the number of commands it has carried out. Why a socket and not the
`jax.distributed` key-value store or a broadcast over the mesh: a decode step's command is a few hundred
bytes that must reach the followers before process 0 enters the step's program, every step; a socket
write costs microseconds and no device program, a key-value round trip through the coordination service
costs a gRPC call per command and follower, and a broadcast would be one more collective program per step
(entered in the same order everywhere, and hanging, not failing, when a process is gone).

Failure: a follower that exits closes its connection, one that hangs or whose host vanishes stops its
heartbeats. Process 0 watches both (one thread per follower) and calls `on_lost` with what it saw: at once
on a closed connection, after `timeout_s` of silence otherwise. A follower whose process 0 is gone sees
its connection closed (`PeerLost` from `receive`).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Callable

import msgpack

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # how often a follower shows it is alive (timeout_s must be well above it)
_LENGTH = struct.Struct(">I")


class PeerLost(RuntimeError):
    """The other end of the command channel is gone (exited, or silent for too long)."""


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def _receive_exactly(sock: socket.socket, size: int) -> bytes | None:
    """`size` bytes, or None if the connection closed first."""
    chunks, missing = [], size
    while missing:
        chunk = sock.recv(missing)
        if not chunk:
            return None
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def _receive_frame(sock: socket.socket) -> bytes | None:
    header = _receive_exactly(sock, _LENGTH.size)
    return None if header is None else _receive_exactly(sock, _LENGTH.unpack(header)[0])


class CommandSender:
    """Process 0's end: listens on all interfaces, `address` is what the followers connect to."""

    def __init__(self, host: str, followers: int, timeout_s: float, on_lost: Callable[[str], None]):
        if timeout_s <= 2 * HEARTBEAT_S:
            raise ValueError(f"timeout_s must exceed {2 * HEARTBEAT_S} s (twice the heartbeat), got {timeout_s}")
        self._listener = socket.create_server(("", 0))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self.followers, self.timeout_s, self._on_lost = followers, timeout_s, on_lost
        self._peers: dict[int, socket.socket] = {}
        self._progress: dict[int, int] = {}  # commands each follower reported done (diagnostics)
        self._sent = 0
        self._closing = threading.Event()
        self._lost_once = threading.Lock()
        self.lost: str | None = None

    def accept(self, timeout_s: float) -> None:
        """Wait for every follower to connect (each first says its process index)."""
        self._listener.settimeout(timeout_s)
        try:
            while len(self._peers) < self.followers:
                sock, _ = self._listener.accept()
                sock.settimeout(timeout_s)
                hello = _receive_frame(sock)
                if hello is None:
                    sock.close()
                    continue
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._peers[int(msgpack.unpackb(hello))] = sock
        except TimeoutError as err:
            raise PeerLost(
                f"{len(self._peers)} of {self.followers} other processes connected to {self.address} "
                f"within {timeout_s} s (connected: {sorted(self._peers)})"
            ) from err
        finally:
            self._listener.close()
        for index, sock in self._peers.items():
            sock.settimeout(self.timeout_s)
            threading.Thread(target=self._watch, args=(index, sock), name=f"areal-peer-{index}", daemon=True).start()

    def send(self, payload: bytes) -> None:
        """Deliver one command to every follower (callers serialise their calls)."""
        if self.lost is not None:
            raise PeerLost(self.lost)
        self._sent += 1
        for index, sock in self._peers.items():
            try:
                _send_frame(sock, payload)
            except OSError as err:
                self._lose(f"process {index} of the rollout server is gone (sending: {err})")
                raise PeerLost(self.lost) from err

    def close(self, last: bytes | None = None) -> None:
        """Send `last` (the final command), then close; the followers' closing is no failure then."""
        self._closing.set()
        for sock in self._peers.values():
            try:
                if last is not None:
                    _send_frame(sock, last)
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _watch(self, index: int, sock: socket.socket) -> None:
        while True:
            try:
                frame = _receive_frame(sock)
            except TimeoutError:
                self._lose(
                    f"process {index} of the rollout server showed no sign of life for {self.timeout_s} s "
                    f"(distributed.peer_timeout_s); it had carried out {self._progress.get(index, 0)} of "
                    f"{self._sent} commands"
                )
                return
            except OSError as err:
                frame, error = None, err
            else:
                error = None
            if frame is None:
                if not self._closing.is_set():
                    reason = f"its connection failed: {error}" if error else "it closed its connection (exited)"
                    self._lose(
                        f"process {index} of the rollout server is gone: {reason}; it had carried out "
                        f"{self._progress.get(index, 0)} of {self._sent} commands"
                    )
                sock.close()
                return
            self._progress[index] = int(msgpack.unpackb(frame))

    def _lose(self, message: str) -> None:
        with self._lost_once:
            if self.lost is not None or self._closing.is_set():
                return
            self.lost = message
        self._on_lost(message)


class CommandReceiver:
    """A follower's end: connected to process 0 at `address` as process `index`."""

    def __init__(self, address: str, index: int, timeout_s: float):
        host, port = address.rsplit(":", 1)
        self._sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(None)
        _send_frame(self._sock, msgpack.packb(index))
        self.done = 0  # commands carried out, reported by the heartbeats
        self._closed = threading.Event()
        threading.Thread(target=self._beat, name="areal-heartbeat", daemon=True).start()

    def receive(self, timeout_s: float | None = None) -> bytes | None:
        """The next command; None after `timeout_s` without one. Raises PeerLost once process 0 is gone."""
        self._sock.settimeout(timeout_s)
        try:
            header = self._sock.recv(_LENGTH.size, socket.MSG_PEEK)
        except TimeoutError:
            return None
        except OSError as err:
            raise PeerLost(f"the connection to process 0 failed: {err}") from err
        self._sock.settimeout(None)
        frame = _receive_frame(self._sock) if header else None
        if frame is None:
            raise PeerLost("process 0 closed the command channel (it exited)")
        return frame

    def _beat(self) -> None:
        while not self._closed.wait(HEARTBEAT_S):
            try:
                _send_frame(self._sock, msgpack.packb(self.done))
            except OSError:
                return  # `receive` reports the closed connection

    def close(self) -> None:
        self._closed.set()
        self._sock.close()

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

Security: process 0 listens on the host it advertises alone, and admits a connection only once the other
end has proved it holds the channel's secret (`secrets.token_bytes`, made by `CommandSender` and shared
with the address, in memory, by the same broadcast); process 0 proves it back, so a follower never takes
commands from anyone else. Each side sends a random challenge and answers the other's with an HMAC-SHA256
of it under the secret, as `multiprocessing.connection`'s authkey handshake does; the labels in the
answers keep one side's answer from serving as the other's. Every connection is checked in a thread of
its own, so a stranger (a wrong answer, garbage, silence past `HANDSHAKE_S`) is refused with a warning
and does not hold up the followers. The frames are not encrypted: the network must stay private.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import queue
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

import msgpack

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # how often a follower shows it is alive (timeout_s must be well above it)
HANDSHAKE_S = 5.0  # how long a new connection may take to authenticate
_LENGTH = struct.Struct(">I")
_CHALLENGE = 32  # random bytes
_PROOF = 32  # an HMAC-SHA256
_ANSWER = struct.Struct(f">I{_PROOF}s{_CHALLENGE}s")  # a follower's index, its proof, its own challenge
_FOLLOWER, _LEADER = b"areal-command-follower", b"areal-command-leader"


class PeerLost(RuntimeError):
    """The other end of the command channel is gone (exited, or silent for too long)."""


class AuthenticationFailed(ConnectionError):
    """The other end did not prove it holds the run's secret, or did not follow the handshake."""


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


def _receive_handshake(sock: socket.socket, size: int, what: str) -> bytes:
    """A handshake frame of exactly `size` bytes; a frame of any other length is refused unread."""
    header = _receive_exactly(sock, _LENGTH.size)
    length = None if header is None else _LENGTH.unpack(header)[0]
    if length is not None and length != size:
        raise AuthenticationFailed(f"a frame of {length} bytes where {what} ({size} bytes) belongs")
    body = None if header is None else _receive_exactly(sock, size)
    if body is None:
        raise AuthenticationFailed(f"the connection closed before {what}")
    return body


def _proof(secret: bytes, label: bytes, challenge: bytes, index: int) -> bytes:
    return hmac.digest(secret, label + challenge + index.to_bytes(4, "big"), "sha256")


def _name(peer: tuple) -> str:
    return f"{peer[0]}:{peer[1]}"


def _refuse_late_peer(peer: str) -> None:
    logger.warning("command channel: refused the connection from %s: the admission ended before it authenticated", peer)


class CommandSender:
    """Process 0's end: listens on `host`; the followers connect to `address` and prove they hold `secret`."""

    def __init__(self, host: str, followers: int, timeout_s: float, on_lost: Callable[[str], None]):
        if timeout_s <= 2 * HEARTBEAT_S:
            raise ValueError(f"timeout_s must exceed {2 * HEARTBEAT_S} s (twice the heartbeat), got {timeout_s}")
        try:
            family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
            self._listener = socket.create_server((host, 0), family=family)
        except OSError as err:
            raise OSError(f"cannot listen on {host!r}, the host the other processes are to connect to: {err}") from err
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self.secret = secrets.token_bytes(32)
        self.followers, self.timeout_s, self._on_lost = followers, timeout_s, on_lost
        self._peers: dict[int, socket.socket] = {}
        self._progress: dict[int, int] = {}  # commands each follower reported done (diagnostics)
        self._sent = 0
        self._closing = threading.Event()
        self._lost_once = threading.Lock()
        self.lost: str | None = None
        # Connections still authenticating (socket -> peer), and those that passed, for `accept`.
        self._pending: dict[socket.socket, str] = {}
        self._pending_lock = threading.Lock()
        self._admitted: queue.Queue[tuple[int, socket.socket, str]] = queue.Queue()

    def accept(self, timeout_s: float) -> None:
        """Wait for every follower to connect and authenticate (each proves the secret and says its process
        index); strangers are refused on the way. The listener is closed after."""
        deadline = time.monotonic() + timeout_s
        wake, waker = socket.socketpair()  # an admitted connection wakes the wait below
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self._listener, selectors.EVENT_READ)
                selector.register(wake, selectors.EVENT_READ)
                while len(self._peers) < self.followers:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise PeerLost(
                            f"{len(self._peers)} of {self.followers} other processes connected to {self.address} "
                            f"within {timeout_s} s (connected: {sorted(self._peers)})"
                        )
                    for key, _ in selector.select(remaining):
                        if key.fileobj is self._listener:
                            self._start_handshake(*self._listener.accept(), waker)
                        else:
                            wake.recv(4096)
                    self._take_admitted()
        finally:
            self._listener.close()
            self._refuse_late()
            wake.close()
            waker.close()
        for index, sock in self._peers.items():
            sock.settimeout(self.timeout_s)
            threading.Thread(target=self._watch, args=(index, sock), name=f"areal-peer-{index}", daemon=True).start()

    def _start_handshake(self, sock: socket.socket, peer: tuple, waker: socket.socket) -> None:
        with self._pending_lock:
            self._pending[sock] = _name(peer)
        threading.Thread(target=self._handshake, args=(sock, waker), name="areal-handshake", daemon=True).start()

    def _handshake(self, sock: socket.socket, waker: socket.socket) -> None:
        """Authenticate one connection; pass it to `accept`, or refuse it with a warning."""
        sock.settimeout(HANDSHAKE_S)
        reason: str | None
        try:
            index = self._authenticate(sock)
        except TimeoutError:
            reason = f"it did not complete the handshake within {HANDSHAKE_S} s"
        except OSError as err:  # AuthenticationFailed among them
            reason = str(err)
        else:
            reason = None
        with self._pending_lock:
            peer = self._pending.pop(sock, None)
            if peer is not None and reason is None:
                self._admitted.put((index, sock, peer))
        if peer is None or reason is not None:  # refused here, or already by `accept`'s end
            if peer is not None:
                logger.warning("command channel: refused the connection from %s: %s", peer, reason)
            sock.close()
            return
        with contextlib.suppress(OSError):  # closed: `accept` has ended and refused this connection
            waker.send(b"\0")

    def _authenticate(self, sock: socket.socket) -> int:
        """The index of the process at the other end, once it has proved it holds the secret; process 0's
        proof back."""
        challenge = secrets.token_bytes(_CHALLENGE)
        _send_frame(sock, challenge)
        answer = _receive_handshake(sock, _ANSWER.size, "the answer to the challenge")
        index, proof, theirs = _ANSWER.unpack(answer)
        if not hmac.compare_digest(proof, _proof(self.secret, _FOLLOWER, challenge, index)):
            raise AuthenticationFailed("its answer does not prove it holds the run's secret")
        _send_frame(sock, _proof(self.secret, _LEADER, theirs, index))
        return index

    def _take_admitted(self) -> None:
        while not self._admitted.empty():
            index, sock, peer = self._admitted.get()
            if not 1 <= index <= self.followers or index in self._peers:
                logger.warning(
                    "command channel: refused the connection from %s: it holds the secret but says it is "
                    "process %d (expected one of 1..%d, once each; connected: %s)",
                    peer,
                    index,
                    self.followers,
                    sorted(self._peers),
                )
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._peers[index] = sock

    def _refuse_late(self) -> None:
        """Refuse every connection not admitted when `accept` ends. One still authenticating is only shut
        down here: that wakes its thread, which closes it and stays quiet."""
        with self._pending_lock:
            late, self._pending = self._pending, {}
        for sock, peer in late.items():
            _refuse_late_peer(peer)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        while not self._admitted.empty():
            _, sock, peer = self._admitted.get()
            _refuse_late_peer(peer)
            sock.close()

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
            error: OSError | None
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
    """A follower's end: connected to process 0 at `address` as process `index`, both sides having proved
    they hold `secret` (`CommandSender.secret`). Raises `AuthenticationFailed` when either proof fails."""

    def __init__(self, address: str, secret: bytes, index: int, timeout_s: float):
        host, port = address.rsplit(":", 1)
        self._sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        try:
            challenge = _receive_handshake(self._sock, _CHALLENGE, "process 0's challenge")
            own = secrets.token_bytes(_CHALLENGE)
            _send_frame(self._sock, _ANSWER.pack(index, _proof(secret, _FOLLOWER, challenge, index), own))
            proof = _receive_handshake(self._sock, _PROOF, "process 0's proof (did it refuse this secret?)")
            if not hmac.compare_digest(proof, _proof(secret, _LEADER, own, index)):
                raise AuthenticationFailed(f"{address} does not prove it holds the run's secret")
        except OSError:
            self._sock.close()
            raise
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(None)
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

"""The command channel against strangers: a real sender on 127.0.0.1 and a real follower (threads), with
connections that hold a wrong secret, stay silent or send garbage. Each is refused with a warning naming
its address and why, never counts as a follower nor gets a command; the follower gets every command in
order. The listener is bound to the advertised host alone, and a follower refuses a false process 0."""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections.abc import Iterator

import msgpack
import pytest

from areal_jax.system import command_channel
from areal_jax.system.command_channel import AuthenticationFailed, CommandReceiver, CommandSender

COMMANDS = [msgpack.packb({"step": i, "tokens": list(range(i))}) for i in range(40)]
CHALLENGE_FRAME = 4 + 32  # length prefix and challenge: all a stranger ever receives


class Channel:
    """A sender for one follower, accepting in a thread of its own, and the warnings it logs."""

    def __init__(self, caplog: pytest.LogCaptureFixture, accept_s: float = 10.0):
        self.lost: list[str] = []
        self.sender = CommandSender("127.0.0.1", 1, timeout_s=10, on_lost=self.lost.append)
        self.host, self.port = self.sender.address.rsplit(":", 1)
        self.failure: list[BaseException] = []
        self._caplog = caplog
        self._thread = threading.Thread(target=self._accept, args=(accept_s,), daemon=True)
        self._thread.start()

    def _accept(self, accept_s: float) -> None:
        try:
            self.sender.accept(accept_s)
        except BaseException as err:
            self.failure.append(err)

    def join(self) -> None:
        self._thread.join(timeout=15)
        assert not self._thread.is_alive() and not self.failure, self.failure

    def stranger(self) -> socket.socket:
        return socket.create_connection((self.host, int(self.port)), timeout=10)

    def follower(self, secret: bytes | None = None) -> CommandReceiver:
        return CommandReceiver(self.sender.address, self.sender.secret if secret is None else secret, 1, 10)

    def refusals(self) -> list[str]:
        return [r.getMessage() for r in self._caplog.records if r.levelno == logging.WARNING and "refused" in r.message]

    def deliver(self, receiver: CommandReceiver) -> None:
        """Every command reaches the follower, in order, and nothing is lost on the way."""
        for command in COMMANDS:
            self.sender.send(command)
        assert [receiver.receive(timeout_s=10) for _ in COMMANDS] == COMMANDS
        self.sender.close()
        receiver.close()
        assert self.lost == [] and self.sender.lost is None


@pytest.fixture
def channel(caplog: pytest.LogCaptureFixture) -> Iterator[Channel]:
    caplog.set_level(logging.WARNING, logger=command_channel.__name__)
    yield Channel(caplog)


def _read_to_end(sock: socket.socket) -> bytes:
    """All the stranger gets before the sender closes (or resets) its connection."""
    chunks = []
    try:
        while chunk := sock.recv(4096):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def test_a_stranger_with_a_wrong_secret_is_refused_and_the_follower_gets_every_command(channel: Channel) -> None:
    with pytest.raises(AuthenticationFailed, match="process 0's proof"):
        channel.follower(secret=secrets.token_bytes(32))  # says it is process 1, the real follower's place
    refusals = channel.refusals()
    assert len(refusals) == 1
    assert "127.0.0.1:" in refusals[0] and "does not prove it holds the run's secret" in refusals[0]

    receiver = channel.follower()
    channel.join()
    channel.deliver(receiver)


def test_a_silent_stranger_does_not_hold_up_the_follower(channel: Channel) -> None:
    stranger = channel.stranger()
    started = time.monotonic()
    receiver = channel.follower()
    channel.join()
    assert time.monotonic() - started < command_channel.HANDSHAKE_S  # not waiting for the stranger's word
    channel.deliver(receiver)

    assert len(_read_to_end(stranger)) == CHALLENGE_FRAME  # shut out when the admission ended, no command
    (refusal,) = channel.refusals()
    assert f"127.0.0.1:{stranger.getsockname()[1]}" in refusal and "admission ended" in refusal
    stranger.close()


def test_a_stranger_silent_past_the_handshake_time_is_refused_and_admission_goes_on(
    channel: Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(command_channel, "HANDSHAKE_S", 0.3)
    stranger = channel.stranger()
    assert len(_read_to_end(stranger)) == CHALLENGE_FRAME  # the sender hangs up on it
    (refusal,) = channel.refusals()
    assert f"127.0.0.1:{stranger.getsockname()[1]}" in refusal and "within 0.3 s" in refusal
    stranger.close()

    receiver = channel.follower()
    channel.join()
    channel.deliver(receiver)


def test_a_stranger_sending_garbage_is_refused(channel: Channel) -> None:
    stranger = channel.stranger()
    assert len(stranger.recv(CHALLENGE_FRAME, socket.MSG_WAITALL)) == CHALLENGE_FRAME
    stranger.sendall(b"GET / HTTP/1.1\r\nHost: rollout\r\n\r\n")
    assert _read_to_end(stranger) == b""  # hung up on (the unread rest may reset the connection)
    (refusal,) = channel.refusals()
    assert f"127.0.0.1:{stranger.getsockname()[1]}" in refusal
    assert f"a frame of {int.from_bytes(b'GET ', 'big')} bytes" in refusal  # refused unread
    stranger.close()

    receiver = channel.follower()
    channel.join()
    channel.deliver(receiver)


def test_the_listener_is_bound_to_the_advertised_host_alone(channel: Channel) -> None:
    assert channel.sender._listener.getsockname()[0] == "127.0.0.1"
    receiver = channel.follower()
    channel.join()
    channel.deliver(receiver)


def test_a_follower_refuses_a_process_0_without_the_secret() -> None:
    with socket.create_server(("127.0.0.1", 0)) as impostor:

        def pose() -> None:
            sock, _ = impostor.accept()
            with sock:
                sock.sendall((32).to_bytes(4, "big") + secrets.token_bytes(32))
                sock.recv(4096)  # the follower's answer
                sock.sendall((32).to_bytes(4, "big") + secrets.token_bytes(32))  # a made-up proof
                sock.recv(4096)

        thread = threading.Thread(target=pose, daemon=True)
        thread.start()
        address = f"127.0.0.1:{impostor.getsockname()[1]}"
        with pytest.raises(AuthenticationFailed, match="does not prove it holds the run's secret"):
            CommandReceiver(address, secrets.token_bytes(32), 1, timeout_s=10)
        thread.join(timeout=10)

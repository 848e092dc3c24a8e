"""Listening sockets handed to the client as file descriptors (``ListenerFd``).

A supervisor binds and listens, the client adopts the descriptors in attach mode, and a
real ``trio-enginecore serve`` connects to the addresses the supervisor bound. What the
tests pin down:

* the client serves an engine through a TCP and a Unix-domain listener it did not bind,
  in the same process and across ``exec`` (descriptors inherited with ``pass_fds``),
  with the Trio and the blocking client;
* the address is read from the descriptor, which inspecting leaves as it was;
* once the client's sockets are bound the descriptors are the client's: closing the
  client closes the listeners, even after a failed startup;
* a descriptor that is not a listening stream socket (closed, a file, UDP, not
  listening, another family, given twice) fails the startup with ``AddressError``
  naming it, before anything is bound: every descriptor passed is left open and
  untouched, and no descriptor of the client's is left behind.

Every test has an absolute timeout; engines are always stopped and reaped.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import zmq

from trio_enginecore import (
    AddressError,
    EngineConfig,
    EngineCoreRequest,
    EngineStartupError,
    ListenerFd,
    SyncMPClient,
    TrioMPClient,
    open_engine_client,
)
from trio_enginecore._listeners import bind_all
from trio_enginecore._zmq import make_socket

from .enginepeer import serve_command
from .support import expected, open_fds

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------- the supervisor


def tcp_listener() -> tuple[int, str]:
    """A listening TCP socket on the loopback interface: its descriptor and address."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    return sock.detach(), f"tcp://127.0.0.1:{port}"


def unix_listener(path: Path) -> tuple[int, str]:
    """A listening Unix-domain socket at ``path``: its descriptor and address."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen()
    return sock.detach(), f"ipc://{path}"


def refuses_connections(address: str) -> bool:
    """Whether nothing listens at ``address`` any more (``tcp://`` or ``ipc://``)."""
    target: str | tuple[str, int]
    if address.startswith("tcp://"):
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        family, target = socket.AF_INET, (host, int(port))
    else:
        family, target = socket.AF_UNIX, address.removeprefix("ipc://")
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(target)
        except ConnectionRefusedError:
            return True
    return False


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError as exc:
        if exc.errno == errno.EBADF:
            return False
        raise
    return True


@asynccontextmanager
async def engine_at(input_address: str, output_address: str) -> AsyncIterator[None]:
    """A ``trio-enginecore serve`` connecting to the given addresses (attach mode)."""
    command = serve_command("--input-address", input_address, "--output-address", output_address)
    async with trio.open_nursery() as nursery:
        process = await nursery.start(partial(trio.run_process, command, check=False))
        try:
            yield
        finally:
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(5):
                await process.wait()
            if process.returncode is None:
                process.kill()


async def stream_tokens(client: TrioMPClient, prompt: list[int], n: int) -> list[int]:
    tokens: list[int] = []
    async with client.stream(EngineCoreRequest.for_tokens(prompt, max_tokens=n)) as outputs:
        async for output in outputs:
            tokens += output.new_token_ids
    return tokens


# ------------------------------------------------------------- serving an engine


async def test_a_client_serves_an_engine_through_a_tcp_and_a_unix_listener_a_supervisor_bound(
    tmp_path: Path,
) -> None:
    fds_before = open_fds()
    input_fd, input_address = tcp_listener()
    output_fd, output_address = unix_listener(tmp_path / "output.sock")
    results: dict[int, list[int]] = {}
    with trio.fail_after(30):
        async with engine_at(input_address, output_address):
            async with open_engine_client(
                EngineConfig(),
                input_address=ListenerFd(input_fd),
                output_address=ListenerFd(output_fd),
            ) as client:
                async with trio.open_nursery() as nursery:
                    for i in range(8):

                        async def run(i: int = i) -> None:
                            results[i] = await stream_tokens(client, [100 * i + 1, i], 12)

                        nursery.start_soon(run)
                assert client.statistics().requests_in_flight == 0
            # Leaving the block closed the listeners: nobody accepts at either address,
            # and the socket file stays for the supervisor to remove.
            assert refuses_connections(input_address)
            assert refuses_connections(output_address)
            assert (tmp_path / "output.sock").exists()
    assert results == {i: expected([100 * i + 1, i], 12) for i in range(8)}
    assert open_fds() - fds_before == set()


SUPERVISOR = """
import json, os, signal, socket, subprocess, sys

tmp, client_program = sys.argv[1], sys.argv[2]
serve = [sys.executable, "-m", "trio_enginecore", "serve", "--log-level", "WARNING"]

# Bind and listen as a launcher does, before anything else runs.
inp = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
inp.bind(os.path.join(tmp, "input.sock"))
inp.listen()
out = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
out.bind(("127.0.0.1", 0))
out.listen()
addresses = ["ipc://" + inp.getsockname(), "tcp://127.0.0.1:%d" % out.getsockname()[1]]

engine = subprocess.Popen(
    serve + ["--input-address", addresses[0], "--output-address", addresses[1]]
)
try:
    fds = [inp.fileno(), out.fileno()]
    client = subprocess.Popen(
        [sys.executable, client_program, *map(str, fds), *addresses], pass_fds=fds
    )
    # Handed over: the client holds the only copies now.
    inp.close()
    out.close()
    code = client.wait(timeout=45)
finally:
    engine.send_signal(signal.SIGTERM)
    try:
        engine.wait(timeout=5)
    except subprocess.TimeoutExpired:
        engine.kill()
        engine.wait()
sys.exit(code)
"""

CLIENT_PROGRAM = """
import json, sys
from trio_enginecore import EngineConfig, EngineCoreRequest, ListenerFd, SyncMPClient

input_fd, output_fd, input_address, output_address = sys.argv[1:]
listeners = ListenerFd(int(input_fd)), ListenerFd(int(output_fd))
addresses = [listener.address() for listener in listeners]
tokens, finished = {}, set()
with SyncMPClient(
    EngineConfig(), input_address=listeners[0], output_address=listeners[1],
    ready_timeout_s=30,
) as client:
    for i in range(4):
        request = EngineCoreRequest.for_tokens([7 * i + 3], request_id=f"r{i}", max_tokens=10)
        client.add_request(request)
    while len(finished) < 4:
        for output in client.get_output().outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                finished.add(output.request_id)
print(json.dumps({"addresses": addresses, "tokens": tokens}))
"""


def test_a_client_started_by_a_supervisor_adopts_the_listeners_it_inherited(
    tmp_path: Path,
) -> None:
    supervisor = tmp_path / "supervisor.py"
    supervisor.write_text(SUPERVISOR)
    client_program = tmp_path / "client.py"
    client_program.write_text(CLIENT_PROGRAM)
    done = subprocess.run(
        [sys.executable, str(supervisor), str(tmp_path), str(client_program)],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["addresses"][0] == f"ipc://{tmp_path}/input.sock"
    assert report["addresses"][1].startswith("tcp://127.0.0.1:")
    assert report["tokens"] == {f"r{i}": expected([7 * i + 3], 10) for i in range(4)}


# -------------------------------------------------------------------- ownership


def test_the_address_is_read_from_the_descriptor_which_is_left_as_it_was(
    tmp_path: Path,
) -> None:
    tcp_fd, tcp_address = tcp_listener()
    unix_fd, unix_address = unix_listener(tmp_path / "s")
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind(f"\0trio-enginecore-test-{os.getpid()}")
    abstract.listen()
    try:
        assert ListenerFd(tcp_fd).address() == tcp_address
        assert ListenerFd(unix_fd).address() == unix_address
        assert ListenerFd(abstract.fileno()).address() == (
            f"ipc://@trio-enginecore-test-{os.getpid()}"
        )
        for fd in (tcp_fd, unix_fd, abstract.fileno()):
            assert is_open(fd)
            assert os.get_blocking(fd)
    finally:
        os.close(tcp_fd)
        os.close(unix_fd)
        abstract.close()


def test_an_ipv6_listener_is_adopted_with_its_bracketed_address() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    listener = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        listener.bind(("::1", 0))
    except OSError:
        listener.close()
        pytest.skip("no IPv6 loopback interface")
    listener.listen()
    port = listener.getsockname()[1]
    fd = listener.detach()
    assert ListenerFd(fd).address() == f"tcp://[::1]:{port}"
    ctx: zmq.Context[Any] = zmq.Context()
    pull = make_socket(ctx, zmq.PULL)
    push: zmq.Socket[bytes] = ctx.socket(zmq.PUSH)
    try:
        assert bind_all([(pull, ListenerFd(fd), "test")]) == [f"tcp://[::1]:{port}"]
        push.set(zmq.IPV6, 1)
        push.set(zmq.LINGER, 0)
        push.connect(f"tcp://[::1]:{port}")
        push.send(b"over IPv6")
        assert pull.raw.poll(5000)
        assert pull.raw.recv() == b"over IPv6"
    finally:
        push.close()
        pull.close()
        ctx.term()
    assert refuses_connections_v6(port)


def refuses_connections_v6(port: int) -> bool:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
        return probe.connect_ex(("::1", port)) == errno.ECONNREFUSED


async def test_a_startup_that_fails_after_binding_closes_the_listeners_with_the_client(
    tmp_path: Path,
) -> None:
    fds_before = open_fds()
    input_fd, input_address = tcp_listener()
    output_fd, output_address = unix_listener(tmp_path / "out.sock")
    with trio.fail_after(10), pytest.raises(EngineStartupError, match="ready message"):
        async with open_engine_client(
            EngineConfig(),
            input_address=ListenerFd(input_fd),
            output_address=ListenerFd(output_fd),
            ready_timeout_s=0.3,
        ):
            pytest.fail("no engine was started")  # pragma: no cover
    assert refuses_connections(input_address)
    assert refuses_connections(output_address)
    assert open_fds() - fds_before == set()


# ---------------------------------------------------------------- bad descriptors


@contextmanager
def closed_descriptor(tmp_path: Path) -> Iterator[int]:
    # Far above every descriptor in use, so that no socket the client opens meanwhile
    # takes the number (descriptors are allocated lowest first).
    fd = max(int(name) for name in open_fds()) + 100
    assert not is_open(fd)
    yield fd


@contextmanager
def regular_file(tmp_path: Path) -> Iterator[int]:
    fd = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT)
    try:
        yield fd
    finally:
        os.close(fd)


@contextmanager
def a_socket(
    family: int, kind: int, *, bind: str | tuple[Any, ...] | None = None, listen: bool = False
) -> Iterator[int]:
    with socket.socket(family, kind) as sock:
        if bind is not None:
            sock.bind(bind)
        if listen:
            sock.listen()
        yield sock.fileno()


def vsock_listener(tmp_path: Path) -> AbstractContextManager[int]:
    family: int | None = getattr(socket, "AF_VSOCK", None)
    if family is None:
        pytest.skip("no AF_VSOCK in this Python")
    try:
        socket.socket(family, socket.SOCK_STREAM).close()
    except OSError:
        pytest.skip("no AF_VSOCK on this host")
    return a_socket(
        family,
        socket.SOCK_STREAM,
        bind=(socket.VMADDR_CID_ANY, socket.VMADDR_PORT_ANY),
        listen=True,
    )


BAD_DESCRIPTORS: dict[str, tuple[Callable[[Path], AbstractContextManager[int]], str]] = {
    "closed": (closed_descriptor, "is not open"),
    "regular file": (regular_file, "is not a socket"),
    "UDP socket": (
        lambda _: a_socket(socket.AF_INET, socket.SOCK_DGRAM, bind=("127.0.0.1", 0)),
        "is a SOCK_DGRAM socket (IPv4), not a stream socket",
    ),
    "TCP socket not listening": (
        lambda _: a_socket(socket.AF_INET, socket.SOCK_STREAM, bind=("127.0.0.1", 0)),
        "is not listening",
    ),
    "Unix-domain datagram socket": (
        lambda p: a_socket(socket.AF_UNIX, socket.SOCK_DGRAM, bind=str(p / "dgram")),
        "is a SOCK_DGRAM socket (Unix-domain), not a stream socket",
    ),
    "unsupported family": (vsock_listener, "is a socket of an unsupported family (AF_VSOCK)"),
}


@pytest.mark.parametrize("kind", list(BAD_DESCRIPTORS))
@pytest.mark.parametrize("role", ["input", "output"])
async def test_a_descriptor_that_is_no_listening_stream_socket_fails_the_startup_naming_it(
    tmp_path: Path, kind: str, role: str
) -> None:
    make_bad, reason = BAD_DESCRIPTORS[kind]
    good_fd, good_address = tcp_listener()
    try:
        with make_bad(tmp_path) as bad_fd:
            fds_before = open_fds()
            listeners = {"input": ListenerFd(good_fd), "output": ListenerFd(good_fd)}
            listeners[role] = ListenerFd(bad_fd)
            with trio.fail_after(10), pytest.raises(AddressError) as info:
                async with open_engine_client(
                    EngineConfig(),
                    input_address=listeners["input"],
                    output_address=listeners["output"],
                ):
                    pytest.fail("the startup succeeded")  # pragma: no cover
            # (The good listener given twice would be refused too, but only after the
            # bad one: the checks run in order, input first.)
            assert open_fds() == fds_before  # nothing left behind, nothing closed
        message = str(info.value)
        assert f"ListenerFd(fd={bad_fd})" in message
        assert f"file descriptor {bad_fd} {reason}" in message
        assert info.value.role == f"client {role}, {'ROUTER' if role == 'input' else 'PULL'}"
        # The good listener was not taken over either: still open, blocking, listening.
        assert is_open(good_fd)
        assert os.get_blocking(good_fd)
        assert not refuses_connections(good_address)
    finally:
        os.close(good_fd)


async def test_the_same_listener_given_twice_is_refused_and_left_open() -> None:
    fd, address = tcp_listener()
    try:
        fds_before = open_fds()
        with trio.fail_after(10), pytest.raises(AddressError, match="already given as") as info:
            async with open_engine_client(
                EngineConfig(), input_address=ListenerFd(fd), output_address=ListenerFd(fd)
            ):
                pytest.fail("the startup succeeded")  # pragma: no cover
        assert info.value.role == "client output, PULL"
        assert open_fds() == fds_before
        assert not refuses_connections(address)
    finally:
        os.close(fd)


async def test_a_refused_address_beside_a_listener_leaves_the_listener_to_its_owner() -> None:
    fd, address = tcp_listener()
    try:
        fds_before = open_fds()
        with trio.fail_after(10), pytest.raises(AddressError, match="bogus://x"):
            async with open_engine_client(
                EngineConfig(), input_address=ListenerFd(fd), output_address="bogus://x"
            ):
                pytest.fail("the startup succeeded")  # pragma: no cover
        assert open_fds() == fds_before
        assert is_open(fd)
        assert os.get_blocking(fd)
        assert not refuses_connections(address)
    finally:
        os.close(fd)


def test_the_blocking_client_refuses_a_bad_descriptor_from_its_constructor(
    tmp_path: Path,
) -> None:
    with regular_file(tmp_path) as fd:
        with pytest.raises(AddressError, match=f"file descriptor {fd} is not a socket"):
            SyncMPClient(
                EngineConfig(),
                input_address=ListenerFd(fd),
                output_address=f"ipc://{tmp_path}/out",
            )
        assert is_open(fd)


@pytest.mark.parametrize("fd", [-1, "3", 2.0])
def test_a_listener_fd_is_a_descriptor_number(fd: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        ListenerFd(fd)  # type: ignore[arg-type]

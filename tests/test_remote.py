"""Engines on other hosts: headless engines joining over TCP, authenticated with CURVE.

The engines here are real `trio-enginecore serve --headless` processes started by the
test (as an operator would on another host), joining a client over 127.0.0.1, and in
the last test from their own network namespace across a veth link.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncGenerator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import zmq

from trio_enginecore import (
    CoordinatorAddresses,
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    EngineStartupError,
    RemoteEngines,
    TrioMPClient,
    open_coordinator,
    open_engine_client,
)
from trio_enginecore._addresses import connectable
from trio_enginecore._curve import (
    CurveKeyPair,
    CurveRefusal,
    CurveServer,
    _answer,  # pyright: ignore[reportPrivateUsage]
    load_public_key,
    local_engine_keys,
    write_key_pair,
)
from trio_enginecore._zmq import TrioSocket
from trio_enginecore.client import DPLBTrioMPClient, DPTrioMPClient
from trio_enginecore.client._multiprocess._launch import serve_arguments
from trio_enginecore.protocol import EngineHandshakeMetadata, HandshakeHello, HandshakeReady
from trio_enginecore.serial import MsgpackDecoder, MsgpackEncoder

from .support import children_of_this_process, expected, free_port


class Keys:
    """A client key pair and one per engine, written as `trio-enginecore keygen` does."""

    def __init__(self, directory: Path, engines: int) -> None:
        self.client_public, self.client_secret = write_key_pair(directory, "client")
        self.engines = [write_key_pair(directory, f"engine-{rank}") for rank in range(engines)]
        self.stranger = write_key_pair(directory, "stranger")

    def server(self) -> CurveServer:
        return CurveServer.from_files(self.client_secret, [public for public, _ in self.engines])


def headless_command(
    config: EngineConfig,
    handshake_address: str,
    *,
    secret_key: Path | None = None,
    server_key: Path | None = None,
    prefix: Sequence[str] = (),
) -> list[str]:
    command = [
        *prefix,
        sys.executable,
        "-m",
        "trio_enginecore",
        "serve",
        "--headless",
        "--handshake-address",
        handshake_address,
        "--handshake-timeout-s",
        "30",
        *serve_arguments(config),
    ]
    if secret_key is not None and server_key is not None:
        command += ["--curve-secret-key", str(secret_key), "--curve-server-key", str(server_key)]
    return command


@asynccontextmanager
async def running(commands: list[list[str]]) -> AsyncGenerator[list[trio.Process], None]:
    """Engines started by hand; stopped with SIGTERM (they drain) when the block ends."""
    processes = [
        await trio.lowlevel.open_process(command, stdin=subprocess.DEVNULL) for command in commands
    ]
    try:
        yield processes
    finally:
        with trio.CancelScope(shield=True):
            for process in processes:
                if process.returncode is None:
                    process.send_signal(signal.SIGTERM)
            with trio.move_on_after(10):
                for process in processes:
                    await process.wait()
            for process in processes:
                if process.returncode is None:
                    process.kill()
                    await process.wait()


async def generate_all(client: TrioMPClient, count: int) -> None:
    async def one(i: int) -> None:
        tokens: list[int] = []
        async with client.stream(
            EngineCoreRequest.for_tokens([i + 1], request_id=f"r{i}", max_tokens=8)
        ) as outputs:
            async for output in outputs:
                tokens += output.new_token_ids
        assert tokens == expected([i + 1], 8)

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)


# ------------------------------------------------------------ pure parts


def test_remote_engines_bind_an_explicit_address_unless_told_otherwise() -> None:
    with pytest.raises(ValueError, match="every network interface"):
        RemoteEngines("tcp://0.0.0.0:5555")
    with pytest.raises(ValueError, match="every network interface"):
        RemoteEngines("tcp://*:5555")
    assert RemoteEngines("tcp://*:5555", all_interfaces=True).any_port == "tcp://*:*"
    with pytest.raises(ValueError, match="over TCP"):
        RemoteEngines("ipc:///tmp/x")
    with pytest.raises(ValueError, match="port number"):
        RemoteEngines("tcp://127.0.0.1")
    remote = RemoteEngines("tcp://10.1.2.3:7000")
    assert (remote.host, remote.any_port) == ("10.1.2.3", "tcp://10.1.2.3:*")


def test_engines_launched_here_reach_a_wildcard_bind_through_loopback() -> None:
    assert connectable("tcp://0.0.0.0:7000") == "tcp://127.0.0.1:7000"
    assert connectable("tcp://*:7000") == "tcp://127.0.0.1:7000"
    assert connectable("tcp://[::]:7000") == "tcp://[::1]:7000"
    assert connectable("tcp://10.1.2.3:7000") == "tcp://10.1.2.3:7000"
    assert connectable("ipc:///tmp/x/handshake") == "ipc:///tmp/x/handshake"


def test_key_files_round_trip_and_the_secret_stays_out_of_repr(tmp_path: Path) -> None:
    public, secret = write_key_pair(tmp_path, "engine")
    assert oct(secret.stat().st_mode & 0o777) == "0o600"
    pair = CurveKeyPair.load(secret)
    assert load_public_key(public) == pair.public
    assert load_public_key(pair.public.decode()) == pair.public
    assert pair.secret.decode() not in repr(pair)
    with pytest.raises(ValueError, match="no secret key"):
        CurveKeyPair.load(public)
    with pytest.raises(ValueError, match="40-character"):
        load_public_key(b"short")


def test_the_zap_handler_admits_only_allowed_curve_keys() -> None:
    allowed = CurveKeyPair.generate()
    other = CurveKeyPair.generate()
    refusals: list[CurveRefusal] = []

    def ask(mechanism: bytes, key: CurveKeyPair | None) -> list[bytes]:
        from zmq.utils import z85

        credentials = [z85.decode(key.public)] if key is not None else []
        frames = [b"1.0", b"id", b"", b"10.0.0.2", b"", mechanism, *credentials]
        return _answer(frames, frozenset({allowed.public}), refusals.append)

    assert ask(b"CURVE", allowed)[2] == b"200"
    assert ask(b"CURVE", other)[2] == b"400"
    assert ask(b"NULL", None)[2] == b"400"
    assert _answer([b"2.0", b"id"], frozenset(), refusals.append)[2] == b"500"
    assert [r.public_key for r in refusals] == [other.public.decode(), None]
    assert all(r.address == "10.0.0.2" for r in refusals)


# -------------------------------------------------------- over 127.0.0.1


async def test_headless_engines_join_over_tcp_with_curve_and_requests_flow(
    tmp_path: Path,
) -> None:
    keys = Keys(tmp_path, engines=2)
    address = f"tcp://127.0.0.1:{free_port()}"
    config = EngineConfig(data_parallel_size=2)
    commands = [
        headless_command(
            config.evolve(data_parallel_rank=rank),
            address,
            secret_key=keys.engines[rank][1],
            server_key=keys.client_public,
        )
        for rank in range(2)
    ]
    with trio.fail_after(60):
        async with running(commands):
            remote = RemoteEngines(address, curve=keys.server())
            async with open_engine_client(config, remote=remote) as client:
                assert isinstance(client, DPLBTrioMPClient)
                assert client.engine_pids == (None, None)  # nothing launched here
                await generate_all(client, 60)
                per_engine = await client.get_request_counts_per_engine()
                assert per_engine == [(0, 0), (0, 0)]
                # The coordinator ran waves over TCP too, and ended them.
                while client.engines_running or client.current_wave < 1:
                    await client.wait_wave_change()


async def test_an_engine_with_a_key_not_allowed_is_refused_and_named(tmp_path: Path) -> None:
    keys = Keys(tmp_path, engines=2)
    address = f"tcp://127.0.0.1:{free_port()}"
    config = EngineConfig(data_parallel_size=2)
    commands = [
        headless_command(
            config.evolve(data_parallel_rank=0),
            address,
            secret_key=keys.engines[0][1],
            server_key=keys.client_public,
        ),
        headless_command(
            config.evolve(data_parallel_rank=1),
            address,
            secret_key=keys.stranger[1],  # not in the client's allow-list
            server_key=keys.client_public,
        ),
    ]
    with trio.fail_after(60):
        async with running(commands):
            remote = RemoteEngines(address, curve=keys.server())
            with pytest.raises(EngineStartupError) as caught:
                async with open_engine_client(config, remote=remote, ready_timeout_s=5):
                    pytest.fail("the client must not start with an unauthenticated rank")
    message = str(caught.value)
    assert "engine rank 1 (remote) never said HELLO" in message
    assert "engine rank 0 said HELLO but never READY" in message
    stranger = load_public_key(keys.stranger[0]).decode()
    assert f"public key {stranger}: public key not in the allow-list" in message


async def test_missing_remote_ranks_are_named_after_the_timeout() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    config = EngineConfig(data_parallel_size=3)
    commands = [headless_command(config.evolve(data_parallel_rank=1), address)]
    with trio.fail_after(60):
        async with running(commands):
            with pytest.raises(EngineStartupError) as caught:
                async with open_engine_client(
                    config, remote=RemoteEngines(address), ready_timeout_s=5
                ):
                    pytest.fail("two ranks are missing")
    message = str(caught.value)
    assert f"engine rank 0 (remote) never said HELLO at {address}" in message
    assert f"engine rank 2 (remote) never said HELLO at {address}" in message
    # The one that came waits for the coordinator's READY, which needs all three.
    assert "engine rank 1 said HELLO but never READY" in message
    assert "subscribe to the coordinator" in message


class HandshakePeer:
    """An engine played by hand on raw sockets, stopping at a chosen startup stage."""

    def __init__(self, ctx: zmq.Context[Any], rank: int, address: str) -> None:
        self.encoder = MsgpackEncoder()
        self.sock = TrioSocket(ctx.socket(zmq.DEALER))
        self.sock.raw.setsockopt(zmq.IDENTITY, rank.to_bytes(2, "little"))
        self.sock.raw.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    async def hello(self) -> EngineHandshakeMetadata:
        await self.sock.send_multipart(
            self.encoder.encode(HandshakeHello(local=False, headless=True))
        )
        frames = await self.sock.recv_multipart()
        return MsgpackDecoder(EngineHandshakeMetadata).decode(frames)

    async def ready(self) -> None:
        await self.sock.send_multipart(
            self.encoder.encode(HandshakeReady(local=False, headless=True))
        )


@asynccontextmanager
async def handshake_peer(rank: int, address: str) -> AsyncGenerator[HandshakePeer, None]:
    ctx: zmq.Context[Any] = zmq.Context()
    peer = HandshakePeer(ctx, rank, address)
    try:
        yield peer
    finally:
        peer.sock.close()
        ctx.destroy(linger=0)


@pytest.mark.parametrize("stage", ["hello", "ready"])
async def test_the_startup_error_says_how_far_an_engine_got(stage: str) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    remote = RemoteEngines(address)

    async def engine(*, task_status: trio.TaskStatus[None]) -> None:
        async with handshake_peer(0, address) as peer:
            task_status.started()
            await peer.hello()
            if stage == "ready":
                await peer.ready()  # ... and never connects to the input address
            await trio.sleep_forever()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine)
            with pytest.raises(EngineStartupError) as caught:
                async with open_engine_client(EngineConfig(), remote=remote, ready_timeout_s=2):
                    pytest.fail("the engine never finished starting")
            nursery.cancel_scope.cancel()
    message = str(caught.value)
    if stage == "hello":
        assert "engine rank 0 said HELLO but never READY: still loading its model" in message
    else:
        assert "engine rank 0 said READY in the handshake but its ready message never " in (message)
        assert "at the input address tcp://127.0.0.1:" in message


async def test_ranks_of_one_group_are_sent_where_to_meet_as_vllms_front_end_does() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    remote = RemoteEngines(address, data_parallel_master_ip="127.0.0.1")
    configs: list[dict[str, Any]] = []

    async def engine(rank: int, *, task_status: trio.TaskStatus[None]) -> None:
        async with handshake_peer(rank, address) as peer:
            task_status.started()
            configs.append((await peer.hello()).parallel_config)
            await trio.sleep_forever()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for rank in range(2):
                await nursery.start(engine, rank)
            with pytest.raises(EngineStartupError):
                async with open_engine_client(
                    EngineConfig(data_parallel_size=2), remote=remote, ready_timeout_s=2
                ):
                    pytest.fail("the peers never finish starting")
            nursery.cancel_scope.cancel()
    # Both ranks are told the same master address and ports: vLLM's five keys.
    assert len(configs) == 2
    assert configs[0] == configs[1]
    group = configs[0]
    assert set(group) == {
        "data_parallel_master_ip",
        "data_parallel_master_port",
        "_data_parallel_master_port_list",
        "_coord_store_port",
        "data_parallel_size",
    }
    assert group["data_parallel_master_ip"] == "127.0.0.1"
    assert group["data_parallel_size"] == 2
    assert group["_coord_store_port"] == 0
    ports = [group["data_parallel_master_port"], *group["_data_parallel_master_port_list"]]
    assert len(set(ports)) == 5


async def test_ranks_that_form_no_group_are_sent_no_parallel_config() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    configs: list[dict[str, Any]] = []

    async def engine(*, task_status: trio.TaskStatus[None]) -> None:
        async with handshake_peer(0, address) as peer:
            task_status.started()
            configs.append((await peer.hello()).parallel_config)
            await trio.sleep_forever()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine)
            with pytest.raises(EngineStartupError, match="said HELLO but never READY"):
                async with open_engine_client(
                    EngineConfig(),
                    remote=RemoteEngines(address),
                    ready_timeout_s=1,
                ):
                    pytest.fail("the peer never finishes starting")
            nursery.cancel_scope.cancel()
    # Dense vLLM ranks would take a data_parallel_size for theirs: nothing is sent.
    assert configs == [{}]


# ------------------------------------------------- across a network namespace


def _netns_unavailable() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "creating a network namespace needs root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"tec-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


@pytest.fixture
def veth_namespace() -> Iterator[tuple[str, str, str]]:
    """A network namespace joined to this one by a veth pair: (netns, host ip, ns ip)."""
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    tag = os.getpid() % 100_000
    netns, outer, inner = f"tec-{tag}", f"tecA{tag}", f"tecB{tag}"
    subnet = 16 + tag % 200
    host_ip, ns_ip = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
    steps = [
        ["ip", "netns", "add", netns],
        ["ip", "link", "add", outer, "type", "veth", "peer", "name", inner],
        ["ip", "link", "set", inner, "netns", netns],
        ["ip", "addr", "add", f"{host_ip}/30", "dev", outer],
        ["ip", "link", "set", outer, "up"],
        ["ip", "netns", "exec", netns, "ip", "addr", "add", f"{ns_ip}/30", "dev", inner],
        ["ip", "netns", "exec", netns, "ip", "link", "set", inner, "up"],
        ["ip", "netns", "exec", netns, "ip", "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True)
        yield netns, host_ip, ns_ip  # type: ignore[misc]
    finally:
        subprocess.run(["ip", "link", "del", outer], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], check=False, capture_output=True)


async def test_an_engine_in_another_network_namespace_joins_across_a_veth_link(
    tmp_path: Path, veth_namespace: tuple[str, str, str]
) -> None:
    netns, host_ip, _ = veth_namespace
    keys = Keys(tmp_path, engines=1)
    address = f"tcp://{host_ip}:{free_port(host_ip)}"
    config = EngineConfig()
    in_netns = ["ip", "netns", "exec", netns]
    remote = RemoteEngines(address, curve=keys.server())
    with trio.fail_after(90):
        # A stranger's key is refused across the link too...
        stranger = headless_command(
            config,
            address,
            secret_key=keys.stranger[1],
            server_key=keys.client_public,
            prefix=in_netns,
        )
        async with running([stranger]):
            with pytest.raises(EngineStartupError, match="not in the allow-list"):
                async with open_engine_client(config, remote=remote, ready_timeout_s=6):
                    pytest.fail("a stranger must not be admitted")
        # ...and the engine with an allowed key serves.
        allowed = headless_command(
            config,
            address,
            secret_key=keys.engines[0][1],
            server_key=keys.client_public,
            prefix=in_netns,
        )
        async with running([allowed]), open_engine_client(config, remote=remote) as client:
            await generate_all(client, 40)


async def test_a_refused_engine_stops_at_once_and_says_why(tmp_path: Path) -> None:
    keys = Keys(tmp_path, engines=1)
    address = f"tcp://127.0.0.1:{free_port()}"
    command = headless_command(
        EngineConfig(), address, secret_key=keys.stranger[1], server_key=keys.client_public
    )
    remote = RemoteEngines(address, curve=keys.server())
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:

            async def client_waiting_for_its_engine() -> None:
                with pytest.raises(EngineStartupError):
                    async with open_engine_client(
                        EngineConfig(), remote=remote, ready_timeout_s=30
                    ):
                        pytest.fail("a stranger must not be admitted")

            nursery.start_soon(client_waiting_for_its_engine)
            # Well before its 30 s handshake timeout (and the client's), the engine
            # learns it was refused and exits with the startup-failure code.
            with trio.fail_after(20):
                result = await trio.run_process(command, capture_stderr=True, check=False)
            nursery.cancel_scope.cancel()
    assert result.returncode == 3
    assert b"refused this engine's CURVE key" in result.stderr


async def reconnect_as_strangers(
    address: str, server_key: bytes, keys: list[tuple[bytes, bytes]], refused: list[int]
) -> None:
    """Connect to ``address`` again and again, cycling through ``keys`` (none allowed),
    as a stranger engine restarted each time it is refused would: one new connection
    at a time, each refused by the client's ZAP handler (``refused`` counts them)."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        while True:
            public, secret = keys[refused[0] % len(keys)]
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
                server_key, public, secret
            )  # fmt: skip
            monitor = TrioSocket(sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH))
            try:
                sock.connect(address)
                await monitor.recv_multipart()
                refused[0] += 1
            finally:
                sock.disable_monitor()
                monitor.close()
                sock.close()
    finally:
        ctx.destroy(linger=0)


async def test_a_refused_peer_that_keeps_reconnecting_is_counted_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal record stays bounded: a total, the most recent refusals and the
    first distinct keys; the startup error names those keys and the count of others."""
    import trio_enginecore.client._factory as factory
    import trio_enginecore.client._mp as mp

    clients: list[TrioMPClient] = []
    new_client = mp.new_mp_client

    def keep_client(*args: Any, **kwargs: Any) -> TrioMPClient:
        clients.append(new_client(*args, **kwargs))
        return clients[-1]

    # Both openers build their client with it.
    monkeypatch.setattr(mp, "new_mp_client", keep_client)
    monkeypatch.setattr(factory, "new_mp_client", keep_client)
    keys = Keys(tmp_path, engines=1)
    server = keys.server()
    strangers = [zmq.curve_keypair() for _ in range(12)]
    address = f"tcp://127.0.0.1:{free_port()}"
    refused = [0]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                reconnect_as_strangers, address, server.keys.public, strangers, refused
            )
            with pytest.raises(EngineStartupError) as caught:
                async with open_engine_client(
                    EngineConfig(), remote=RemoteEngines(address, curve=server), ready_timeout_s=3
                ):
                    pytest.fail("no engine with an allowed key joined")
            nursery.cancel_scope.cancel()
    (client,) = clients
    record = client.transport.refusals
    assert record.total >= refused[0] - 1 > 100
    assert len(record.recent) == record.keep == 16
    kept = [public.decode() for public, _ in strangers[: record.keep_keys]]
    assert list(record.keys) == kept
    assert record.other_keys == record.total - sum(record.keys.values()) > 0
    message = str(caught.value)
    # The error tells the refusals up to when it was made; the strangers went on
    # knocking until the client closed, so the record may have grown since.
    total = re.search(r"CURVE authentication refused (\d+) connection\(s\)", message)
    assert total is not None
    assert 100 < int(total[1]) <= record.total
    for key in kept:
        assert f"with public key {key}" in message
    others = re.search(r"(\d+) with other public keys", message)
    assert others is not None
    assert 0 < int(others[1]) <= record.other_keys
    assert strangers[-1][0].decode() not in message.split("most recently")[0]


async def test_a_remote_engine_killed_with_sigkill_is_noticed_by_its_lost_connection() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    config = EngineConfig(data_parallel_size=2, step_time_s=0.01)
    commands = [headless_command(config.evolve(data_parallel_rank=r), address) for r in range(2)]
    remote = RemoteEngines(address)
    failures: dict[str, BaseException] = {}
    with trio.fail_after(60):
        async with running(commands) as processes:
            with pytest.raises(EngineDeadError):
                async with open_engine_client(config, remote=remote) as client:

                    async def stream(rid: str, rank: int) -> None:
                        long = EngineCoreRequest.for_tokens([1], request_id=rid, max_tokens=100_000)
                        long.data_parallel_rank = rank
                        try:
                            async with client.stream(long) as outputs:
                                async for _ in outputs:
                                    pass
                        except EngineDeadError as exc:
                            failures[rid] = exc

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(stream, "on-0", 0)
                        nursery.start_soon(stream, "on-1", 1)
                        while client.statistics().requests_in_flight < 2:
                            await trio.sleep(0.01)
                        processes[1].kill()
                        killed_at = trio.current_time()
                        while "on-1" not in failures:
                            await trio.sleep(0.01)
                        # Its connection closes at once; the grace to reconnect is
                        # 0.5 s; the bound has slack for a loaded machine.
                        assert trio.current_time() - killed_at < 3
                        nursery.cancel_scope.cancel()
    assert "connection was lost" in str(failures["on-1"])
    assert "engine rank 1" in str(failures["on-1"])
    assert "on-0" not in failures


async def test_external_lb_clients_with_remote_engines_share_a_curve_coordinator(
    tmp_path: Path,
) -> None:
    """The whole multi-host picture on one machine: two frontends (one rank each), each
    with a headless engine, and the group's coordinator, every TCP link under CURVE."""
    keys = Keys(tmp_path, engines=2)
    frontend = keys.server()
    addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    configs = [
        EngineConfig(
            data_parallel_size=2,
            data_parallel_rank=rank,
            data_parallel_external_lb=True,
            step_time_s=0.01,
        )
        for rank in range(2)
    ]
    commands = [
        headless_command(
            configs[rank],
            addresses[rank],
            secret_key=keys.engines[rank][1],
            server_key=keys.client_public,
        )
        for rank in range(2)
    ]
    seen: list[list[tuple[int, bool]]] = [[], []]
    with trio.fail_after(60):
        async with (
            open_coordinator(
                2, addresses=CoordinatorAddresses.on_host("127.0.0.1"), curve=frontend
            ) as coordinator,
            running(commands),
        ):
            assert coordinator.publish.startswith("tcp://127.0.0.1:")
            clients: dict[int, DPTrioMPClient] = {}
            ready = trio.Event()
            done = trio.Event()

            async def frontend_for(rank: int) -> None:
                remote = RemoteEngines(addresses[rank], curve=frontend)
                async with open_engine_client(
                    configs[rank], remote=remote, coordinator=coordinator
                ) as client:
                    assert isinstance(client, DPTrioMPClient)
                    clients[rank] = client
                    if len(clients) == 2:
                        ready.set()
                    while (state := await client.wait_wave_change()) != (1, False):
                        seen[rank].append(state)
                    seen[rank].append(state)
                    await done.wait()

            async with trio.open_nursery() as nursery:
                for rank in range(2):
                    nursery.start_soon(frontend_for, rank)
                await ready.wait()
                await generate_all(clients[0], 10)
                while not all(log and log[-1] == (1, False) for log in seen):
                    await trio.sleep(0.01)
                done.set()
    assert seen == [[(0, True), (1, False)]] * 2


async def test_a_client_launches_its_local_ranks_beside_the_remote_ones(tmp_path: Path) -> None:
    keys = Keys(tmp_path, engines=2)
    address = f"tcp://127.0.0.1:{free_port()}"
    config = EngineConfig(data_parallel_size=2)
    remote_rank = headless_command(
        config.evolve(data_parallel_rank=1),
        address,
        secret_key=keys.engines[1][1],
        server_key=keys.client_public,
    )
    # Rank 0's key is not in the allow-list: the client gives its own engine a key
    # pair of its own (and admits it).
    curve = CurveServer.from_files(keys.client_secret, [keys.engines[1][0]])
    remote = RemoteEngines(address, ranks={1}, curve=curve)
    with trio.fail_after(60):
        async with running([remote_rank]), open_engine_client(config, remote=remote) as client:
            local_pid, remote_pid = client.engine_pids
            assert local_pid is not None
            assert remote_pid is None
            await generate_all(client, 30)
            assert await client.get_request_counts_per_engine() == [(0, 0), (0, 0)]
    assert children_of_this_process() == []


def test_remote_ranks_must_be_ranks_of_the_client() -> None:
    remote = RemoteEngines("tcp://127.0.0.1:5555", ranks=[1, 4])
    assert remote.ranks == frozenset({1, 4})
    with pytest.raises(ValueError, match=r"rank\(s\) \[4\]"):
        remote.joining(range(2))
    assert RemoteEngines("tcp://127.0.0.1:5555").joining(range(3)) == {0, 1, 2}


def test_a_z85_key_starting_with_a_dash_reaches_the_engine_command_line(tmp_path: Path) -> None:
    """Z85 has "-" in its alphabet: "--curve-server-key -abc..." would be read as an
    option (a failure seen in CI, for one key in 85)."""
    from trio_enginecore._cli import _parser  # pyright: ignore[reportPrivateUsage]

    keys = CurveKeyPair.generate()
    while not keys.public.startswith(b"-"):
        keys = CurveKeyPair.generate()
    _, arguments = local_engine_keys(str(tmp_path), CurveServer(keys, []))
    args = _parser().parse_args(["serve", "--handshake-address", "ipc:///x", *arguments])
    assert load_public_key(args.curve_server_key) == keys.public

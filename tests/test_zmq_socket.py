"""Specification of ``trio_enginecore._zmq.TrioSocket`` against real pyzmq sockets.

Every test uses real sockets over ``ipc://`` in a short temporary directory, so the
clock is the real one (an autojump clock would fire timeouts while data is in flight),
and every test has an absolute deadline.
"""

from __future__ import annotations

import itertools
import random
import select
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import trio
import trio.testing
import zmq

from trio_enginecore._zmq import Frames, TrioSocket, make_socket

if TYPE_CHECKING:
    from collections.abc import Iterator


class Net:
    """A zmq context plus unique short ``ipc://`` endpoints, torn down by the fixture."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self._dir = tempfile.mkdtemp(dir="/tmp", prefix="tec-")
        self._names = itertools.count()
        self._sockets: list[TrioSocket] = []

    def endpoint(self) -> str:
        return f"ipc://{self._dir}/{next(self._names)}"

    def socket(self, socket_type: int, **kwargs: Any) -> TrioSocket:
        sock = make_socket(self.ctx, socket_type, **kwargs)
        self._sockets.append(sock)  # keeps it alive until close(): pyzmq warns on GC
        return sock

    def pair(self, bound_type: int, connected_type: int) -> tuple[TrioSocket, TrioSocket]:
        """Return ``(bound, connected)`` sockets of the given types, connected."""
        bound = self.socket(bound_type)
        connected = self.socket(connected_type)
        connected.connect(bound.bind(self.endpoint()))
        return bound, connected

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)


@pytest.fixture
def net() -> Iterator[Net]:
    n = Net()
    try:
        yield n
    finally:
        n.close()


def seq(i: int) -> bytes:
    return i.to_bytes(4, "big")


def unseq(frame: bytes | memoryview) -> int:
    return int.from_bytes(frame, "big")


async def wait_until_queued(sock: TrioSocket) -> None:
    """Wait until at least one message can be received from ``sock`` without blocking."""
    for _ in range(5000):
        if sock.raw.poll(0, zmq.POLLIN):
            return
        await trio.sleep(0.001)
    pytest.fail("no message was queued")


async def wait_until_empty(sock: TrioSocket, *, quiet: float) -> None:
    """Assert that nothing arrives on ``sock`` for ``quiet`` seconds."""
    with trio.move_on_after(quiet):
        unexpected = await sock.drain()
        pytest.fail(f"unexpected messages arrived: {unexpected!r}")


def block_until_fd_fires(sock: TrioSocket, *, settle: float = 0.002) -> None:
    """Block the whole Trio thread until the socket's ZMQ_FD is readable, then ``settle``.

    Blocking on purpose: Trio cannot poll in the meantime, so whatever the caller does
    next on the socket runs *before* any task sleeping on the fd is woken, i.e. it can
    consume the edge that task is waiting for. The settle time lets libzmq's send-side
    command throttle (about a millisecond) expire, so that a send processes the pending
    commands too.
    """
    readable, _, _ = select.select([sock.raw.fileno()], [], [], 5.0)
    assert readable, "the socket's fd never became readable"
    time.sleep(settle)


# --------------------------------------------------------------------------- basics


def test_make_socket_sets_vllm_options_and_bind_reports_the_endpoint(net: Net) -> None:
    sock = net.socket(zmq.DEALER, identity=b"engine-7", max_message_size=1 << 20)
    raw = sock.raw
    assert raw.get(zmq.SNDHWM) == 0
    assert raw.get(zmq.RCVHWM) == 0
    assert raw.get(zmq.LINGER) == 0
    assert raw.get(zmq.IDENTITY) == b"engine-7"
    assert raw.get(zmq.MAXMSGSIZE) == 1 << 20
    endpoint = sock.bind("tcp://127.0.0.1:*")
    assert endpoint.startswith("tcp://127.0.0.1:")
    assert int(endpoint.rsplit(":", 1)[1]) > 0
    plain = net.socket(zmq.PULL, linger_ms=250)
    assert plain.raw.get(zmq.LINGER) == 250
    assert plain.raw.get(zmq.MAXMSGSIZE) == -1
    # Outside a Trio run there is nobody to wake: closing must still work.
    sock.close()
    assert sock.closed


async def test_recv_multipart_copies_leading_frames_and_returns_the_rest_zero_copy(
    net: Net,
) -> None:
    with trio.fail_after(5):
        pull, push = net.pair(zmq.PULL, zmq.PUSH)
        message = [b"a", b"bb", b"ccc"]
        for _ in range(4):
            await push.send_multipart(message)

        default = await pull.recv_multipart()
        assert [type(p) for p in default] == [bytes, memoryview, memoryview]
        assert [bytes(p) for p in default] == message

        none_copied = await pull.recv_multipart(copy_leading=0)
        assert all(isinstance(p, memoryview) for p in none_copied)
        assert [bytes(p) for p in none_copied] == message

        all_copied = await pull.recv_multipart(copy_leading=10)
        assert all_copied == message

        (batch,) = await pull.drain(copy_leading=2)
        assert [type(p) for p in batch] == [bytes, bytes, memoryview]

        with pytest.raises(ValueError, match="copy_leading"):
            await pull.recv_multipart(copy_leading=-1)
        with pytest.raises(ValueError, match="max_messages"):
            await pull.drain(0)
        with pytest.raises(ValueError, match="at least one frame"):
            await push.send_multipart([])


async def test_every_async_method_is_a_checkpoint_even_when_it_does_not_wait(
    net: Net,
) -> None:
    with trio.fail_after(5):
        pull, push = net.pair(zmq.PULL, zmq.PUSH)
        for i in range(3):
            with trio.testing.assert_checkpoints():
                await push.send_multipart([seq(i)])
        await wait_until_queued(pull)
        with trio.testing.assert_checkpoints():
            first = await pull.recv_multipart()
        assert first == [seq(0)]
        await wait_until_queued(pull)
        with trio.testing.assert_checkpoints():
            rest = await pull.drain()
        assert rest[0] == [seq(1)]


async def test_a_call_in_a_cancelled_scope_raises_cancelled_and_consumes_nothing(
    net: Net,
) -> None:
    with trio.fail_after(5):
        pull, push = net.pair(zmq.PULL, zmq.PUSH)
        await push.send_multipart([b"first"])
        await wait_until_queued(pull)

        with trio.CancelScope() as cs:
            cs.cancel()
            await pull.recv_multipart()
        assert cs.cancelled_caught
        with trio.CancelScope() as cs:
            cs.cancel()
            await pull.drain()
        assert cs.cancelled_caught
        with trio.CancelScope() as cs:
            cs.cancel()
            await push.send_multipart([b"never sent"])
        assert cs.cancelled_caught

        assert await pull.recv_multipart() == [b"first"]
        await push.send_multipart([b"second"])
        assert await pull.recv_multipart() == [b"second"]
        await wait_until_empty(pull, quiet=0.1)


# ----------------------------------------------------------------- drain batching


async def test_drain_returns_everything_queued_in_one_batch_up_to_max_messages(
    net: Net,
) -> None:
    with trio.fail_after(10):
        pull, push = net.pair(zmq.PULL, zmq.PUSH)
        n = 300
        for i in range(n):
            await push.send_multipart([seq(i), b"x" * 10])
        await wait_until_queued(pull)
        await trio.sleep(0.2)  # the I/O thread hands the rest over in the meantime

        first = await pull.drain(max_messages=256)
        assert [unseq(m[0]) for m in first] == list(range(256))
        second = await pull.drain(max_messages=256)
        assert [unseq(m[0]) for m in second] == list(range(256, n))
        assert all(bytes(m[1]) == b"x" * 10 for m in first + second)


async def test_drain_waits_when_nothing_is_queued_and_returns_the_first_arrival(
    net: Net,
) -> None:
    with trio.fail_after(5):
        pull, push = net.pair(zmq.PULL, zmq.PUSH)
        result: list[list[Frames]] = []

        async def drainer() -> None:
            result.append(await pull.drain())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drainer)
            await trio.sleep(0.05)
            await trio.testing.wait_all_tasks_blocked()
            assert result == []
            assert pull.statistics().tasks_waiting_receive == 1
            await push.send_multipart([b"hello"])
        assert result == [[[b"hello"]]]
        assert pull.statistics().tasks_waiting_receive == 0


# ------------------------------------------------------------ random cancellation


async def _receive_under_random_cancellation(net: Net, *, batched: bool) -> None:
    n = 5000
    rng = random.Random(20240611 + batched)
    pull, push = net.pair(zmq.PULL, zmq.PUSH)
    received: list[int] = []
    cancelled_immediately = 0
    cancelled_while_waiting = 0

    async def producer() -> None:
        i = 0
        while i < n:
            for _ in range(rng.randint(1, 40)):
                if i == n:
                    break
                await push.send_multipart([seq(i), b"payload"])
                i += 1
            await trio.sleep(rng.uniform(0, 0.002))

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer)
            while len(received) < n:
                timeout = 0.0 if rng.random() < 0.1 else rng.uniform(0.00005, 0.0008)
                got: list[Frames] = []
                with trio.move_on_after(timeout) as cs:
                    if batched:
                        got = await pull.drain(max_messages=rng.randint(1, 64))
                    else:
                        got = [await pull.recv_multipart()]
                if cs.cancelled_caught:
                    assert got == []
                    if timeout == 0.0:
                        cancelled_immediately += 1
                    else:
                        cancelled_while_waiting += 1
                for message in got:
                    assert message[1] == b"payload"
                    received.append(unseq(message[0]))
        await wait_until_empty(pull, quiet=0.05)

    assert received == list(range(n)), "messages lost, duplicated or reordered"
    # Enough cancellations of both kinds that the test cannot pass by luck (measured
    # on a 2-core machine: about 300-600 and 300 per run).
    assert cancelled_immediately > 100
    assert cancelled_while_waiting > 100


async def test_recv_multipart_under_random_cancellation_loses_and_duplicates_nothing(
    net: Net,
) -> None:
    await _receive_under_random_cancellation(net, batched=False)


async def test_drain_under_random_cancellation_loses_and_duplicates_nothing(net: Net) -> None:
    await _receive_under_random_cancellation(net, batched=True)


async def test_send_under_random_cancellation_delivers_exactly_the_sends_that_returned(
    net: Net,
) -> None:
    """A send that returned was delivered once; a send that raised Cancelled never was.

    The queues are made tiny (HWM 1, small kernel buffers) and the reader slow, so that
    sends really wait in the EAGAIN path and get cancelled there.
    """
    n = 2000
    rng = random.Random(77)
    push = net.socket(zmq.PUSH)
    pull = net.socket(zmq.PULL)
    for sock, opts in ((push, (zmq.SNDHWM, zmq.SNDBUF)), (pull, (zmq.RCVHWM, zmq.RCVBUF))):
        sock.raw.set(opts[0], 1)
        sock.raw.set(opts[1], 4096)
    pull.connect(push.bind(net.endpoint()))
    payload = b"p" * 2048

    returned: list[int] = []
    cancelled: list[int] = []
    received: list[int] = []
    sender_done = trio.Event()

    async def sender() -> None:
        for i in range(n):
            with trio.move_on_after(rng.uniform(0.00005, 0.001)) as cs:
                await push.send_multipart([seq(i), payload])
                returned.append(i)
            if cs.cancelled_caught:
                cancelled.append(i)
        sender_done.set()

    async def slow_reader() -> None:
        while not sender_done.is_set() or len(received) < len(returned):
            with trio.move_on_after(0.05):
                batch = await pull.drain(max_messages=rng.randint(1, 8))
                received.extend(unseq(message[0]) for message in batch)
            await trio.sleep(rng.uniform(0, 0.0015))

    with trio.fail_after(25):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            nursery.start_soon(slow_reader)
        await wait_until_empty(pull, quiet=0.2)

    assert received == returned, "a send that returned was lost, or a cancelled one delivered"
    assert set(cancelled).isdisjoint(received)
    assert len(returned) + len(cancelled) == n
    assert len(cancelled) > 100, "the sends hardly ever waited: the test proves nothing"
    assert len(returned) > 100


# --------------------------------------------------------- shared-socket wakeups


async def test_a_send_that_swallows_the_edge_does_not_strand_a_waiting_receiver(
    net: Net,
) -> None:
    """Task A waits in recv_multipart on a DEALER; a message arrives, and before Trio
    gets to poll, task B sends on the same DEALER (processing the pending commands, so
    the fd is no longer readable). A must still get its message.
    """
    dealer = net.socket(zmq.DEALER, identity=b"dealer")
    router = net.socket(zmq.ROUTER)
    router.raw.set(zmq.ROUTER_MANDATORY, 1)
    router.connect(dealer.bind(net.endpoint()))

    with trio.fail_after(5):
        await dealer.send_multipart([b"hello"])
        assert await router.recv_multipart() == [b"dealer", b"hello"]

    for i in range(200):
        got: list[Frames] = []

        async def receiver() -> None:
            got.append(await dealer.recv_multipart())  # noqa: B023 (awaited in this round)

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(receiver)
                await trio.testing.wait_all_tasks_blocked()
                assert dealer.statistics().tasks_waiting_receive == 1
                router.raw.send_multipart([b"dealer", b"to A", seq(i)])
                block_until_fd_fires(dealer)
                await dealer.send_multipart([b"from B", seq(i)])
            assert got == [[b"to A", seq(i)]]
            assert await router.recv_multipart() == [b"dealer", b"from B", seq(i)]


async def test_a_receive_that_swallows_the_edge_does_not_strand_a_waiting_sender(
    net: Net,
) -> None:
    """A sender waits on a DEALER that has no peer yet (EAGAIN). The peer connects, and
    before Trio gets to poll, another task starts receiving on the same DEALER (which
    processes the pending commands). The sender must still go through.
    """
    for i in range(40):
        dealer = net.socket(zmq.DEALER, identity=b"dealer")
        endpoint = dealer.bind(net.endpoint())
        router = net.socket(zmq.ROUTER)
        sent = trio.Event()

        async def sender() -> None:
            await dealer.send_multipart([b"ping", seq(i)])  # noqa: B023 (awaited in this round)
            sent.set()  # noqa: B023

        async def echo() -> None:
            identity, ping, n = await router.recv_multipart()  # noqa: B023
            assert ping == b"ping"
            await router.send_multipart([identity, b"pong", n])  # noqa: B023

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender)
                await trio.testing.wait_all_tasks_blocked()
                assert dealer.statistics().tasks_waiting_send == 1
                router.connect(endpoint)
                block_until_fd_fires(dealer)
                nursery.start_soon(echo)
                # Runs synchronously up to its first wait, before Trio polls the fd.
                reply = await dealer.recv_multipart()
            assert sent.is_set()
            assert reply == [b"pong", seq(i)]
        dealer.close()
        router.close()


async def test_many_blocked_senders_all_go_through_when_a_peer_appears(net: Net) -> None:
    with trio.fail_after(10):
        push = net.socket(zmq.PUSH)
        endpoint = push.bind(net.endpoint())
        n_tasks = 8

        async def sender(k: int) -> None:
            for j in range(10):
                await push.send_multipart([seq(k), seq(j)])

        async with trio.open_nursery() as nursery:
            for k in range(n_tasks):
                nursery.start_soon(sender, k)
            await trio.testing.wait_all_tasks_blocked()
            assert push.statistics().tasks_waiting_send == n_tasks
            pull = net.socket(zmq.PULL)
            pull.connect(endpoint)
            received: list[tuple[int, int]] = []
            while len(received) < n_tasks * 10:
                received += [(unseq(k), unseq(j)) for k, j in await pull.drain()]
        for k in range(n_tasks):
            assert [j for kk, j in received if kk == k] == list(range(10))
        await wait_until_empty(pull, quiet=0.05)


async def test_duplex_sockets_with_concurrent_senders_deliver_everything(net: Net) -> None:
    """Both ends of a ROUTER/DEALER pair receive in one task while four tasks send."""
    router = net.socket(zmq.ROUTER)
    dealer = net.socket(zmq.DEALER, identity=b"d")
    dealer.connect(router.bind(net.endpoint()))
    per_task = 500
    n_tasks = 4
    total = per_task * n_tasks
    with trio.fail_after(20):
        await dealer.send_multipart([b"hello"])
        assert await router.recv_multipart() == [b"d", b"hello"]
        at_router: list[tuple[int, int]] = []
        at_dealer: list[tuple[int, int]] = []

        async def send_from_dealer(k: int) -> None:
            for j in range(per_task):
                await dealer.send_multipart([seq(k), seq(j)])

        async def send_from_router(k: int) -> None:
            for j in range(per_task):
                await router.send_multipart([b"d", seq(k), seq(j)])

        async def receive_at_router() -> None:
            while len(at_router) < total:
                for _, k, j in await router.drain():
                    at_router.append((unseq(k), unseq(j)))

        async def receive_at_dealer() -> None:
            while len(at_dealer) < total:
                k, j = await dealer.recv_multipart()
                at_dealer.append((unseq(k), unseq(j)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive_at_router)
            nursery.start_soon(receive_at_dealer)
            for k in range(n_tasks):
                nursery.start_soon(send_from_dealer, k)
                nursery.start_soon(send_from_router, k)
    for received in (at_router, at_dealer):
        for k in range(n_tasks):
            assert [j for kk, j in received if kk == k] == list(range(per_task))


async def test_a_send_refused_although_events_shows_pollout_waits_without_spinning(
    net: Net,
) -> None:
    """A ROUTER with ROUTER_MANDATORY reports POLLOUT as long as *some* peer can take a
    message, yet a send to a peer whose queue is full raises EAGAIN. Such a send must
    sleep rather than retry in a loop (which would never yield to Trio), must not hold
    up sends to other peers, and must complete once the slow peer catches up.
    """
    router = net.socket(zmq.ROUTER)
    for option, value in ((zmq.ROUTER_MANDATORY, 1), (zmq.SNDHWM, 1), (zmq.SNDBUF, 4096)):
        router.raw.set(option, value)
    endpoint = router.bind(net.endpoint())
    slow = net.socket(zmq.DEALER, identity=b"slow")
    slow.raw.set(zmq.RCVHWM, 1)
    slow.raw.set(zmq.RCVBUF, 4096)
    fast = net.socket(zmq.DEALER, identity=b"fast")
    payload = b"x" * 16384

    with trio.fail_after(15):
        for peer in (slow, fast):
            peer.connect(endpoint)
            await peer.send_multipart([b"hello"])
            assert (await router.recv_multipart())[1:] == [b"hello"]

        queued = 0
        while True:
            with trio.move_on_after(0.2) as cs:
                await router.send_multipart([b"slow", seq(queued), payload])
            if cs.cancelled_caught:
                break
            queued += 1
        assert router.raw.poll(0, zmq.POLLOUT), "EVENTS should still show POLLOUT"

        done = trio.Event()

        async def blocked_send() -> None:
            await router.send_multipart([b"slow", seq(queued), payload])
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(blocked_send)
            cpu_before = time.thread_time()
            await trio.sleep(0.3)
            cpu_spent = time.thread_time() - cpu_before
            assert not done.is_set()
            assert cpu_spent < 0.1, f"the waiting send burnt {cpu_spent:.3f}s of CPU in 0.3s"
            await router.send_multipart([b"fast", b"not held up"])
            assert await fast.recv_multipart() == [b"not held up"]
            received: list[int] = []
            while len(received) < queued + 1:
                received += [unseq(m[0]) for m in await slow.drain()]
        assert done.is_set()
        assert received == list(range(queued + 1))


async def test_a_second_concurrent_receiver_gets_busy_resource_error(net: Net) -> None:
    with trio.fail_after(5):
        pull, push = net.pair(zmq.PULL, zmq.PUSH)
        got: list[Frames] = []

        async def first_receiver() -> None:
            got.append(await pull.recv_multipart())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first_receiver)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.BusyResourceError):
                await pull.recv_multipart()
            with pytest.raises(trio.BusyResourceError):
                await pull.drain()
            await push.send_multipart([b"for the first"])
        assert got == [[b"for the first"]]
        await push.send_multipart([b"later"])
        assert await pull.recv_multipart() == [b"later"]


# ------------------------------------------------------------------------ closing


async def test_close_wakes_a_waiting_receiver_with_closed_resource_error(net: Net) -> None:
    rng = random.Random(5)
    for attempt in range(20):
        pull = net.socket(zmq.PULL)
        pull.bind(net.endpoint())
        outcome: list[BaseException] = []

        async def receiver() -> None:
            try:
                await pull.recv_multipart()  # noqa: B023 (awaited in this round)
            except trio.ClosedResourceError as exc:
                outcome.append(exc)  # noqa: B023

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(receiver)
                # Half the time close as soon as the receiver is parked, half the time
                # at a random moment (possibly during the spurious post-bind wakeup).
                if attempt % 2:
                    await trio.testing.wait_all_tasks_blocked()
                else:
                    await trio.sleep(rng.uniform(0, 0.002))
                pull.close()
        assert len(outcome) == 1, f"attempt {attempt}: receiver was not woken by close"


async def test_close_wakes_the_watcher_and_the_parked_waiters(net: Net) -> None:
    """With no peer, a DEALER blocks both ways: whichever task came first watches the
    fd, the others are parked. Closing wakes every one of them.
    """
    for receiver_first in (True, False):
        dealer = net.socket(zmq.DEALER)
        dealer.bind(net.endpoint())
        closed_errors: list[str] = []

        async def receive() -> None:
            with pytest.raises(trio.ClosedResourceError):
                await dealer.recv_multipart()  # noqa: B023 (awaited in this round)
            closed_errors.append("recv")  # noqa: B023

        async def send(k: int) -> None:
            with pytest.raises(trio.ClosedResourceError):
                await dealer.send_multipart([seq(k)])  # noqa: B023
            closed_errors.append("send")  # noqa: B023

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                if receiver_first:
                    nursery.start_soon(receive)
                    await trio.testing.wait_all_tasks_blocked()
                for k in range(2):
                    nursery.start_soon(send, k)
                await trio.testing.wait_all_tasks_blocked()
                if not receiver_first:
                    nursery.start_soon(receive)
                    await trio.testing.wait_all_tasks_blocked()
                stats = dealer.statistics()
                assert (stats.tasks_waiting_receive, stats.tasks_waiting_send) == (1, 2)
                dealer.close()
        assert sorted(closed_errors) == ["recv", "send", "send"]
        stats = dealer.statistics()
        assert stats.closed
        assert (stats.tasks_waiting_receive, stats.tasks_waiting_send) == (0, 0)


async def test_calls_after_close_raise_closed_resource_error_and_close_is_idempotent(
    net: Net,
) -> None:
    with trio.fail_after(5):
        pull, push = net.pair(zmq.PULL, zmq.PUSH)
        await push.send_multipart([b"left behind"])
        await wait_until_queued(pull)
        assert not pull.statistics().closed
        pull.close()
        pull.close()
        assert pull.closed
        assert pull.raw.closed
        with pytest.raises(trio.ClosedResourceError):
            await pull.recv_multipart()
        with pytest.raises(trio.ClosedResourceError):
            await pull.drain()
        with pytest.raises(trio.ClosedResourceError):
            await pull.send_multipart([b"x"])
        with pytest.raises(trio.ClosedResourceError):
            pull.bind(net.endpoint())
        with pytest.raises(trio.ClosedResourceError):
            pull.connect(net.endpoint())

        with net.socket(zmq.PUSH) as scoped:
            assert not scoped.statistics().closed
        assert scoped.closed
        assert scoped.raw.closed


# --------------------------------------------------------------- large payloads


async def test_a_64_mib_numpy_frame_is_received_without_copying(net: Net) -> None:
    pull, push = net.pair(zmq.PULL, zmq.PUSH)
    source = np.arange(16 * 1024 * 1024, dtype=np.uint32)  # 64 MiB
    assert source.nbytes == 64 * 1024 * 1024
    with trio.fail_after(20):
        await push.send_multipart([b"header", source], copy=False)
        header, payload = await pull.recv_multipart(copy_leading=1)
    assert header == b"header"
    assert isinstance(payload, memoryview), "the large frame was copied into bytes"
    assert payload.nbytes == source.nbytes
    received = np.frombuffer(payload, dtype=np.uint32)
    assert np.shares_memory(received, payload), "np.frombuffer copied the frame"
    assert not received.flags.owndata
    assert np.array_equal(received, source)

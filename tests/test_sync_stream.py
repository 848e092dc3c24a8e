"""SyncMPClient.stream(): per-request blocking streams, from many threads at once.

Real engine processes, plain threads, every wait bounded (thread joins, events with
timeouts, ``pytest.mark.timeout``). The counter model makes every request's tokens
known in advance, so "exactly its tokens, in order" is an equality.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial

import pytest

from trio_enginecore import (
    EngineConfig,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDeadError,
    FinishReason,
    RequestFailedError,
    SyncMPClient,
)

from .support import expected
from .test_sync_client import client_threads, join_all, start_thread, wait_until_gone

pytestmark = pytest.mark.timeout(60)

CLOSED = "the engine client was closed"


def streamed(client: SyncMPClient, request: EngineCoreRequest) -> list[EngineCoreOutput]:
    """Every output of ``request``, streamed to its end."""
    with client.stream(request) as outputs:
        return list(outputs)


def tokens_of(outputs: list[EngineCoreOutput]) -> list[int]:
    return [token for output in outputs for token in output.new_token_ids]


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def outcome_within(call: Callable[[], object], timeout_s: float) -> list[object]:
    """Run ``call`` in a thread: ``[result or exception]``, or ``[]`` if it is still
    blocked after ``timeout_s`` (the thread is left to end with the client)."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            outcome.append(exc)

    thread = start_thread(run, "outcome-within")
    thread.join(timeout_s)
    return outcome


# ------------------------------------------------------------------ many threads

THREADS = 8
PER_THREAD = 6
MAX_TOKENS = 20
BATCH = 10


def test_threads_each_streaming_their_own_requests_get_exactly_their_tokens() -> None:
    # Eight threads stream six requests each, one after another, while a ninth sends
    # requests with add_request and reads get_output(): every stream gets exactly its
    # tokens, in order, ending with its finished output; get_output() sees only the
    # batch requests, and every one of their tokens once.
    lock = threading.Lock()
    streams: dict[str, list[EngineCoreOutput]] = {}
    batch_tokens: dict[str, list[int]] = {f"batch-{n}": [] for n in range(BATCH)}
    foreign: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS + 1, timeout=20)

    def prompt(rid: str) -> list[int]:
        return [len(rid), 10 * sum(map(ord, rid)) + 3]

    with SyncMPClient(EngineConfig(step_time_s=0.002)) as client:
        engine_pid = client.engine_pids[0]
        assert engine_pid is not None

        def streamer(index: int) -> None:
            try:
                start.wait()
                for r in range(PER_THREAD):
                    rid = f"t{index}-r{r}"
                    request = EngineCoreRequest.for_tokens(
                        prompt(rid), request_id=rid, max_tokens=MAX_TOKENS
                    )
                    outputs = streamed(client, request)
                    with lock:
                        streams[rid] = outputs
            except BaseException as exc:
                with lock:
                    errors.append(exc)

        def batch_reader() -> None:
            try:
                start.wait()
                for rid in batch_tokens:
                    client.add_request(
                        EngineCoreRequest.for_tokens(prompt(rid), request_id=rid, max_tokens=7)
                    )
                unfinished = set(batch_tokens)
                while unfinished:
                    for output in client.get_output().outputs:
                        if output.request_id not in batch_tokens:
                            foreign.append(output.request_id)
                            continue
                        batch_tokens[output.request_id] += output.new_token_ids
                        if output.finished:
                            unfinished.discard(output.request_id)
            except BaseException as exc:
                with lock:
                    errors.append(exc)

        threads = [start_thread(partial(streamer, i), f"streamer-{i}") for i in range(THREADS)]
        threads.append(start_thread(batch_reader, "batch-reader"))
        join_all(threads, 40)
        assert errors == []
        assert client.statistics().requests_in_flight == 0
        assert client.get_request_counts() == (0, 0)

    assert foreign == []
    assert len(streams) == THREADS * PER_THREAD
    for rid, outputs in streams.items():
        assert {output.request_id for output in outputs} == {rid}
        assert tokens_of(outputs) == expected(prompt(rid), MAX_TOKENS), rid
        assert [output.finish_reason for output in outputs][-1] is FinishReason.LENGTH
        assert all(output.finish_reason is None for output in outputs[:-1]), rid
    for rid, tokens in batch_tokens.items():
        assert tokens == expected(prompt(rid), 7), rid
    assert wait_until_gone(engine_pid)
    assert client_threads() == []


# ------------------------------------------------------------- leaving early


def test_leaving_a_stream_early_aborts_its_request_on_the_engine() -> None:
    with SyncMPClient(EngineConfig(step_time_s=0.002)) as client:

        def long_request(rid: str) -> EngineCoreRequest:
            return EngineCoreRequest.for_tokens([7], request_id=rid, max_tokens=100_000)

        # break
        with client.stream(long_request("r")) as outputs:
            for output in outputs:
                assert output.new_token_ids
                break
        # The ABORT went out before the block exited; the utility call follows it on
        # the same socket, so the engine has dropped the request by then.
        assert client.get_request_counts() == (0, 0)
        assert client.statistics().requests_in_flight == 0

        # an exception: it propagates as itself, and the request is aborted
        class Stop(Exception):
            pass

        with pytest.raises(Stop), client.stream(long_request("r")) as outputs:
            next(outputs)
            raise Stop
        assert client.get_request_counts() == (0, 0)

        # return from a function in another thread
        def first_output() -> EngineCoreOutput:
            with client.stream(long_request("other")) as outputs:
                for output in outputs:
                    return output
            raise AssertionError("no output")

        (first,) = outcome_within(first_output, 10)
        assert isinstance(first, EngineCoreOutput)
        assert client.get_request_counts() == (0, 0)

        # leaving, from another thread, a stream a thread is blocked reading: the
        # reader gets a RuntimeError, not a Trio exception
        client.pause_scheduler("keep")  # no outputs: the reader blocks
        block = client.stream(long_request("blocked"))
        outputs = block.__enter__()
        assert client.get_request_counts() == (1, 0)
        seen: list[object] = []
        reader = start_thread(lambda: seen.extend(outcome_within(lambda: next(outputs), 10)), "r")
        time.sleep(0.2)
        block.__exit__(None, None, None)
        join_all([reader], 10)
        assert len(seen) == 1
        assert type(seen[0]) is RuntimeError
        assert "block was left" in str(seen[0])
        client.resume_scheduler()
        assert client.get_request_counts() == (0, 0)

        # and the id can be used again at once: exactly its tokens
        again = EngineCoreRequest.for_tokens([7], request_id="r", max_tokens=5)
        assert tokens_of(streamed(client, again)) == expected([7], 5)
        assert client.statistics().requests_in_flight == 0

        # misuse is a RuntimeError, never a Trio exception
        with pytest.raises(RuntimeError, match="block was left"):
            next(outputs)
        with pytest.raises(RuntimeError, match="entered only once"):
            block.__enter__()
        unentered = client.stream(EngineCoreRequest.for_tokens([1], max_tokens=2))
        with pytest.raises(RuntimeError, match="inside its block"):
            next(unentered)


def test_a_stream_left_from_another_thread_while_it_is_entered_is_aborted_once_sent() -> None:
    # Leaving may race with entering (an asyncio task cancelled while its entry runs
    # on a thread): whichever comes first, the request does not outlive the stream.
    with SyncMPClient(EngineConfig(step_time_s=0.002)) as client:
        for trial in range(40):
            block = client.stream(
                EngineCoreRequest.for_tokens([3], request_id=f"e{trial}", max_tokens=100_000)
            )
            entering = start_thread(partial(outcome_within, block.__enter__, 10), f"e{trial}")
            if trial % 2:
                time.sleep(0.0005 * (trial % 7))
            block.__exit__(None, None, None)
            join_all([entering], 10)
        assert client.get_request_counts() == (0, 0)
        assert client.statistics().requests_in_flight == 0
        # Left before it was entered: entering then refuses, and sends nothing.
        block = client.stream(EngineCoreRequest.for_tokens([3], max_tokens=3))
        block.__exit__(None, None, None)
        with pytest.raises(RuntimeError, match="block was left"):
            block.__enter__()
        assert client.get_request_counts() == (0, 0)


# ----------------------------------------------------------- one reader at a time


def test_a_second_concurrent_get_output_reader_is_refused_with_a_clear_error() -> None:
    with SyncMPClient(EngineConfig()) as client:
        first: list[object] = []
        reader = start_thread(lambda: first.extend(outcome_within(client.get_output, 20)), "r1")
        time.sleep(0.3)  # the first reader waits: nothing was sent
        second = outcome_within(client.get_output, 2)
        assert second != [], "a second get_output() waited beside the first"
        assert type(second[0]) is RuntimeError
        assert "another thread is already waiting in get_output()" in str(second[0])
        assert "client.stream(request)" in str(second[0])

        # The first reader was not disturbed: it gets the message.
        client.add_request(EngineCoreRequest.for_tokens([1], request_id="a", max_tokens=1))
        join_all([reader], 10)
        (message,) = first
        assert isinstance(message, EngineCoreOutputs)
        assert [o.request_id for o in message.outputs] == ["a"]
        # Once it returned, another thread may read.
        client.add_request(EngineCoreRequest.for_tokens([1], request_id="b", max_tokens=1))
        assert [o.request_id for o in client.get_output().outputs] == ["b"]


def test_a_second_concurrent_reader_of_one_stream_is_refused() -> None:
    with SyncMPClient(EngineConfig()) as client:
        client.pause_scheduler("keep")
        request = EngineCoreRequest.for_tokens([50], request_id="s", max_tokens=3)
        with client.stream(request) as outputs:
            tokens: list[int] = []

            def read_all() -> None:
                for output in outputs:
                    tokens.extend(output.new_token_ids)

            reader = start_thread(read_all, "stream-reader")
            time.sleep(0.3)  # it waits: the scheduler is paused
            with pytest.raises(RuntimeError, match="another thread is reading this stream"):
                next(outputs)
            client.resume_scheduler()
            join_all([reader], 10)
        assert tokens == expected([50], 3)


# ------------------------------------------------------------------- failures


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([], "at least one token"), ([1, 10**6], "prompt token ids must be in")],
    ids=["empty prompt", "token out of the vocabulary"],
)
def test_a_rejected_request_raises_request_failed_error_from_its_stream(
    prompt: list[int], message: str
) -> None:
    with SyncMPClient(EngineConfig()) as client:
        received: list[EngineCoreOutput] = []

        def consume() -> None:
            with client.stream(
                EngineCoreRequest.for_tokens(prompt, request_id="bad", max_tokens=4)
            ) as outputs:
                try:
                    received.extend(outputs)
                finally:
                    # It keeps raising, as the Trio stream does.
                    with pytest.raises(RequestFailedError):
                        next(outputs)

        (error,) = outcome_within(consume, 10)
        assert isinstance(error, RequestFailedError)
        assert (error.request_id, error.code) == ("bad", "invalid_request")
        assert message in error.engine_message
        assert received == []
        assert client.statistics().requests_in_flight == 0
        good = EngineCoreRequest.for_tokens([21], max_tokens=4)
        assert tokens_of(streamed(client, good)) == expected([21], 4)


def test_an_engine_killed_mid_stream_fails_every_threads_stream() -> None:
    client = SyncMPClient(EngineConfig(step_time_s=0.002))
    try:
        engine_pid = client.engine_pids[0]
        assert engine_pid is not None
        lock = threading.Lock()
        tokens: dict[int, list[int]] = {i: [] for i in range(THREADS)}
        outcomes: dict[int, BaseException | None] = {}
        streaming = threading.Barrier(THREADS + 1, timeout=20)

        def streamer(index: int) -> None:
            try:
                request = EngineCoreRequest.for_tokens(
                    [index + 1], request_id=f"s{index}", max_tokens=100_000
                )
                with client.stream(request) as outputs:
                    for n, output in enumerate(outputs):
                        tokens[index] += output.new_token_ids
                        if n == 0:
                            streaming.wait()
                raise AssertionError("the stream ended without an error")
            except BaseException as exc:
                with lock:
                    outcomes[index] = exc

        threads = [start_thread(partial(streamer, i), f"streamer-{i}") for i in range(THREADS)]
        streaming.wait()
        os.kill(engine_pid, signal.SIGKILL)
        join_all(threads, 10)
        assert sorted(outcomes) == list(range(THREADS))
        for index, error in outcomes.items():
            assert type(error) is EngineDeadError, error
            assert "killed by signal 9" in str(error)
            # Every token before the death, exactly once and in order.
            assert tokens[index] == expected([index + 1], len(tokens[index]))
        with pytest.raises(EngineDeadError, match="killed by signal 9"):
            client.stream(EngineCoreRequest.for_tokens([1])).__enter__()
        with pytest.raises(EngineDeadError, match="killed by signal 9"):
            client.get_output()
    finally:
        client.close()
    assert client_threads() == []
    # After the close too, the death is what calls raise (as the Trio client's).
    with pytest.raises(EngineDeadError, match="killed by signal 9"):
        client.stream(EngineCoreRequest.for_tokens([1])).__enter__()


def test_close_from_another_thread_ends_blocked_streams_with_engine_dead_error() -> None:
    client = SyncMPClient(EngineConfig())
    engine_pid = client.engine_pids[0]
    assert engine_pid is not None
    client.pause_scheduler("keep")  # the requests wait: their readers block
    lock = threading.Lock()
    outcomes: list[BaseException] = []
    entered = threading.Barrier(4 + 1, timeout=20)

    def streamer(index: int) -> None:
        try:
            request = EngineCoreRequest.for_tokens([index + 1], max_tokens=100)
            with client.stream(request) as outputs:
                entered.wait()
                for _ in outputs:
                    pass
            raise AssertionError("the stream ended without an error")
        except BaseException as exc:
            with lock:
                outcomes.append(exc)

    threads = [start_thread(partial(streamer, i), f"streamer-{i}") for i in range(4)]
    entered.wait()
    time.sleep(0.2)  # every reader waits in the loop
    closer = start_thread(client.close, "closer")
    join_all([*threads, closer], 15)
    assert len(outcomes) == 4
    for error in outcomes:
        assert type(error) is EngineDeadError, repr(error)
        assert str(error) == CLOSED
    assert wait_until_gone(engine_pid)
    assert client_threads() == []
    with pytest.raises(EngineDeadError, match=CLOSED):
        client.stream(EngineCoreRequest.for_tokens([1])).__enter__()


# --------------------------------------------------------------------- Ctrl-C

INTERRUPTED_READS_SCRIPT = """
import os, signal, threading
from trio_enginecore import EngineConfig, EngineCoreRequest, SyncMPClient
from trio_enginecore.engine import CounterModel

def interrupt_me(times, every_s):
    for _ in range(times):
        threading.Event().wait(every_s)
        os.kill(os.getpid(), signal.SIGINT)

with SyncMPClient(EngineConfig(step_time_s=0.02)) as client:
    # A stream read interrupted by Ctrl-C, then read on: every token, once, in order.
    request = EngineCoreRequest.for_tokens([5], request_id="s", max_tokens=60)
    tokens, interrupts = [], 0
    threading.Thread(target=interrupt_me, args=(4, 0.17), daemon=True).start()
    with client.stream(request) as outputs:
        while True:
            try:
                output = next(outputs)
            except StopIteration:
                break
            except KeyboardInterrupt:
                interrupts += 1
                continue
            tokens += output.new_token_ids
    print("stream", interrupts, tokens == CounterModel.expected_tokens([5], 60), flush=True)

    # A get_output() interrupted by Ctrl-C: the next call is not refused, and loses
    # nothing.
    client.add_request(EngineCoreRequest.for_tokens([9], request_id="b", max_tokens=60))
    tokens, interrupts, finished = [], 0, False
    threading.Thread(target=interrupt_me, args=(4, 0.17), daemon=True).start()
    while not finished:
        try:
            message = client.get_output()
        except KeyboardInterrupt:
            interrupts += 1
            continue
        for output in message.outputs:
            tokens += output.new_token_ids
            finished = output.finished
    print("batch", interrupts, tokens == CounterModel.expected_tokens([9], 60), flush=True)
    print("counts", client.get_request_counts(), flush=True)
"""


def test_reads_interrupted_by_ctrl_c_lose_nothing_and_can_go_on() -> None:
    result = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_READS_SCRIPT],
        capture_output=True,
        text=True,
        timeout=40,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    stream, batch = lines[0].split(), lines[1].split()
    assert stream[0] == "stream"
    assert int(stream[1]) >= 1, result.stdout
    assert stream[2] == "True", result.stdout
    assert batch[0] == "batch"
    assert int(batch[1]) >= 1, result.stdout
    assert batch[2] == "True", result.stdout
    assert lines[2] == "counts (0, 0)"


SIGINT_IN_A_STREAM_SCRIPT = """
from trio_enginecore import EngineConfig, EngineCoreRequest, SyncMPClient

with SyncMPClient(EngineConfig(step_time_s=0.01)) as client:
    print("ready", client.engine_pids[0], flush=True)
    with client.stream(EngineCoreRequest.for_tokens([1], max_tokens=100_000)) as outputs:
        for output in outputs:
            pass
"""


def test_sigint_in_a_stream_leaves_it_and_stops_the_engine() -> None:
    from .test_sync_client import interrupt

    elapsed, stdout, stderr, returncode = interrupt(SIGINT_IN_A_STREAM_SCRIPT, b"ready ", 0.3)
    engine_pid = int(stdout.split()[1])
    text = stderr.decode()
    assert returncode == -signal.SIGINT, text
    assert text.rstrip().endswith("KeyboardInterrupt"), text
    assert "__next__" in text
    assert elapsed < 5
    assert wait_until_gone(engine_pid)

"""The blocking clients: SyncMPClient against real engine processes, and InprocClient.

(SyncMPClient's per-request streams are in test_sync_stream.py.)

The tests are plain functions using threads and subprocesses, as blocking callers do.
Every wait is bounded (thread joins, subprocess timeouts, ``pytest.mark.timeout``), and
the engine processes are checked to be gone through /proc.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDeadError,
    EngineStartupError,
    InprocClient,
    LoRARequest,
    ProtocolError,
    SyncMPClient,
    UtilityCallError,
)

from .support import expected

pytestmark = pytest.mark.timeout(60)

THREAD_NAME = "trio-enginecore-client"


def is_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The command name (field 2) may contain spaces and parentheses.
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until_gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while is_running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def client_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


def start_thread(target: Callable[[], object], name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def join_all(threads: list[threading.Thread], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert [t.name for t in threads if t.is_alive()] == []


def drain(client: SyncMPClient | InprocClient, request_ids: set[str]) -> dict[str, list[int]]:
    """Collect tokens with get_output() until every request in ``request_ids`` finished."""
    tokens: dict[str, list[int]] = {rid: [] for rid in request_ids}
    open_ids = set(request_ids)
    deadline = time.monotonic() + 20
    while open_ids:
        assert time.monotonic() < deadline, f"requests never finished: {sorted(open_ids)}"
        for output in client.get_output().outputs:
            tokens[output.request_id] += output.new_token_ids
            if output.finish_reason is not None:
                open_ids.discard(output.request_id)
    return tokens


# ------------------------------------------------------------------ many threads

THREADS = 8
PER_THREAD = 25
MAX_TOKENS = 20


def test_sync_mp_client_takes_requests_from_8_threads_and_one_reader_gets_every_token() -> None:
    # The batch API from many threads: they all send, one thread reads (a second
    # reader would be refused: see test_sync_stream.py, which also has threads each
    # streaming their own requests).
    prompts = {
        f"t{t}-r{r}": [t + 1, 1000 * t + 10 * r + 5]
        for t in range(THREADS)
        for r in range(PER_THREAD)
    }
    errors: list[BaseException] = []
    all_added = threading.Barrier(THREADS + 1, timeout=20)

    client = SyncMPClient(EngineConfig())
    try:
        engine_pid = client.engine_pids[0]
        assert engine_pid is not None

        def worker(index: int) -> None:
            try:
                for r in range(PER_THREAD):
                    rid = f"t{index}-r{r}"
                    client.add_request(
                        EngineCoreRequest.for_tokens(
                            prompts[rid], request_id=rid, max_tokens=MAX_TOKENS
                        )
                    )
            except BaseException as exc:
                errors.append(exc)
            all_added.wait()

        threads = [start_thread(partial(worker, i), f"worker-{i}") for i in range(THREADS)]
        all_added.wait()
        join_all(threads, 10)
        assert errors == []
        tokens = drain(client, set(prompts))
        assert client.statistics().requests_in_flight == 0
    finally:
        client.close()
    for rid, prompt in prompts.items():
        assert tokens[rid] == expected(prompt, MAX_TOKENS), rid
    assert wait_until_gone(engine_pid)
    assert client_threads() == []


# ---------------------------------------------------------------------- Ctrl-C

INTERRUPT_SCRIPT = """
from trio_enginecore import SyncMPClient

with SyncMPClient() as client:
    print("ready", client.engine_pids[0], flush=True)
    client.get_output()
"""


def interrupt(script: str, first_line: bytes, delay_s: float) -> tuple[float, bytes, bytes, int]:
    """Run ``script``; SIGINT it ``delay_s`` after it printed ``first_line``.

    Returns the seconds it took to exit after the signal, its remaining stdout, its
    stderr and its return code.
    """
    with subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline()  # bounded by the test timeout
            assert line.startswith(first_line), line
            time.sleep(delay_s)
            assert process.poll() is None
            interrupted_at = time.monotonic()
            process.send_signal(signal.SIGINT)
            stdout, stderr = process.communicate(timeout=10)
            return time.monotonic() - interrupted_at, line + stdout, stderr, process.returncode
        finally:
            if process.poll() is None:  # pragma: no cover - only when the test failed
                process.kill()
                process.wait(5)


def test_sigint_interrupts_a_blocked_get_output_promptly_and_stops_the_engine() -> None:
    # 0.2 s: long enough for the main thread to block in get_output().
    elapsed, stdout, stderr, returncode = interrupt(INTERRUPT_SCRIPT, b"ready ", 0.2)
    engine_pid = int(stdout.split()[1])
    text = stderr.decode()
    # The uncaught KeyboardInterrupt ends Python with the default SIGINT action.
    assert returncode == -signal.SIGINT, text
    assert text.rstrip().endswith("KeyboardInterrupt"), text
    assert "in get_output" in text
    assert elapsed < 5
    assert wait_until_gone(engine_pid)


SLOW_START_SCRIPT = """
import logging
import sys
import trio_enginecore.client._multiprocess._launch as mp
from trio_enginecore import SyncMPClient

original = mp.engine_command

def slow_engine_command(config, address, **kwargs):
    # The same engine, started after a delay (exec keeps the pid).
    command = original(config, address, **kwargs)
    wrapper = (
        "import os, sys, time; print('engine', os.getpid(), file=sys.stderr, flush=True);"
        " time.sleep(1.5); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    return [sys.executable, "-c", wrapper, *command[1:]]

mp.engine_command = slow_engine_command
# The engine's stderr reaches us through logging, which the library leaves to us.
logging.basicConfig(format="%(message)s")
print("constructing", flush=True)
with SyncMPClient() as client:
    print("ready", flush=True)
    client.get_output()
"""


def test_sigint_while_the_constructor_waits_for_the_engine_does_not_hang() -> None:
    # The engine becomes ready about 2 s after "constructing"; the signal arrives while
    # the constructor waits for it. The client then stops the engine once its startup
    # ends (it used to wait for a stop that nobody could request: a hang).
    elapsed, stdout, stderr, returncode = interrupt(SLOW_START_SCRIPT, b"constructing\n", 0.5)
    text = stderr.decode()
    assert stdout == b"constructing\n"  # never got ready
    assert returncode == -signal.SIGINT, text
    assert text.rstrip().endswith("KeyboardInterrupt"), text
    assert "in __init__" in text
    assert elapsed < 8, text
    engine_pid = int(text.split("engine ", 1)[1].split()[0])
    assert wait_until_gone(engine_pid)


# ---------------------------------------------------------------- close & errors


def test_calls_after_close_raise_engine_dead_error_and_close_is_idempotent() -> None:
    with SyncMPClient(EngineConfig()) as client:
        assert client_threads() != []
        engine_pid = client.engine_pids[0]
        assert engine_pid is not None
        client.add_request(EngineCoreRequest.for_tokens([41], request_id="r", max_tokens=4))
        assert drain(client, {"r"}) == {"r": [42, 43, 44, 45]}
    # Leaving the block closed the client.
    assert wait_until_gone(engine_pid, 0)
    assert client_threads() == []
    calls: list[Callable[[], object]] = [
        client.get_output,
        lambda: client.add_request(EngineCoreRequest.for_tokens([1], request_id="late")),
        lambda: client.abort_requests(["r"]),
        lambda: client.call_utility("is_sleeping"),
        client.is_sleeping,
        client.list_loras,
        lambda: client.stream(EngineCoreRequest.for_tokens([1])).__enter__(),
    ]
    for call in calls:
        # The library's error, as the Trio client's streams and calls get it when
        # it closes; not trio.ClosedResourceError.
        with pytest.raises(EngineDeadError, match=r"^the engine client was closed$") as info:
            call()
        assert type(info.value) is EngineDeadError
    assert client.is_dead is False
    client.close()
    client.shutdown()
    with client:
        pass
    with pytest.raises(EngineDeadError, match="the engine client was closed"):
        client.get_output()


def test_a_get_output_blocked_while_another_thread_closes_raises_engine_dead_error() -> None:
    client = SyncMPClient(EngineConfig())
    outcome: list[object] = []

    def reader() -> None:
        try:
            outcome.append(client.get_output())
        except BaseException as exc:
            outcome.append(exc)

    thread = start_thread(reader, "reader")
    time.sleep(0.3)  # it waits: nothing was sent
    closer = start_thread(client.close, "closer")
    join_all([thread, closer], 10)
    (error,) = outcome
    assert type(error) is EngineDeadError, repr(error)
    assert str(error) == "the engine client was closed"


def test_a_call_running_in_the_loop_when_it_ends_raises_engine_dead_error() -> None:
    # A call still running in the event loop when the loop ends is cancelled there:
    # its thread gets the library's error, not trio.Cancelled.
    client = SyncMPClient(EngineConfig())
    started = threading.Event()

    async def never_answered(method: str, *args: object) -> None:
        started.set()
        await trio.sleep_forever()

    trio_client = client._trio_client  # pyright: ignore[reportPrivateUsage]
    trio_client.call_utility = never_answered  # type: ignore[method-assign]
    outcome: list[object] = []

    def caller() -> None:
        try:
            outcome.append(client.call_utility("anything"))
        except BaseException as exc:
            outcome.append(exc)

    thread = start_thread(caller, "caller")
    assert started.wait(10)
    client.close()
    join_all([thread], 10)
    (error,) = outcome
    assert type(error) is EngineDeadError, repr(error)
    assert str(error) == "the engine client was closed"


def test_utility_failures_raise_in_the_calling_thread_and_wrappers_are_typed() -> None:
    with SyncMPClient(EngineConfig(max_loras=2)) as client:
        with pytest.raises(UtilityCallError) as info:
            client.call_utility("no_such_method")
        assert info.value.method == "no_such_method"
        assert "no_such_method" in info.value.engine_message
        with pytest.raises(UtilityCallError, match="profiler is not running"):
            client.profile(False)

        # From another thread too: the error is raised there, not in the loop thread.
        seen: list[BaseException] = []

        def failing_call() -> None:
            try:
                client.call_utility("no_such_method")
            except UtilityCallError as exc:
                seen.append(exc)

        join_all([start_thread(failing_call, "utility-caller")], 10)
        assert len(seen) == 1
        assert isinstance(seen[0], UtilityCallError)

        tasks = client.get_supported_tasks()
        assert type(tasks) is tuple
        assert tasks == ("generate",)
        assert client.is_sleeping() is False
        assert client.add_lora(LoRARequest("a", 1, "/a")) is True
        assert client.add_lora(LoRARequest("b", 2, "/b")) is True
        assert client.add_lora(LoRARequest("c", 3, "/c")) is False
        loras = client.list_loras()
        assert type(loras) is set
        assert loras == {1, 2}
        assert client.pin_lora(1) is True
        assert client.remove_lora(2) is True
        assert client.list_loras() == {1}
        counts = client.get_request_counts()
        assert type(counts) is tuple
        assert counts == (0, 0)
        assert client.reset_prefix_cache() is True
        client.sleep()
        assert client.is_sleeping() is True
        client.wake_up()
        assert client.is_sleeping() is False
        client.profile(True)
        client.profile(False)
        client.execute_dummy_batch()
        assert client.get_weight_version() is None
        client.set_weight_version("v3")
        assert client.get_weight_version() == "v3"
        client.pause_scheduler("keep")
        assert client.is_scheduler_paused() is True
        client.resume_scheduler()
        assert client.is_scheduler_paused() is False
        assert client.is_dead is False
        assert client.statistics().pending_utility_calls == 0

        # A result of the wrong type is a protocol error, not a wrong value. (The
        # engines' answers are replaced where the Trio client collects them, behind
        # call_utility_all; the wrappers with two engines are in test_contract.py.)
        async def answer_yes(engines: object, method: str, args: object) -> list[str]:
            return ["yes"]

        trio_client = client._trio_client  # pyright: ignore[reportPrivateUsage]
        trio_client._call_engines = answer_yes  # type: ignore[method-assign,assignment]  # pyright: ignore[reportPrivateUsage]
        with pytest.raises(ProtocolError, match="is_sleeping"):
            client.is_sleeping()


# --------------------------------------------------------------------- failure


def test_kill_9_fails_a_blocked_get_output_and_every_later_call() -> None:
    client = SyncMPClient(EngineConfig(step_time_s=0.002))
    try:
        engine_pid = client.engine_pids[0]
        assert engine_pid is not None
        outcome: list[BaseException | EngineCoreOutputs] = []
        failed_at: list[float] = []
        blocked = threading.Event()

        def reader() -> None:
            blocked.set()
            try:
                outcome.append(client.get_output())
            except BaseException as exc:
                failed_at.append(time.monotonic())
                outcome.append(exc)

        thread = start_thread(reader, "reader")
        assert blocked.wait(5)
        time.sleep(0.2)  # the reader is blocked: no requests, no outputs
        assert outcome == []
        killed_at = time.monotonic()
        os.kill(engine_pid, signal.SIGKILL)
        join_all([thread], 5)
        assert len(outcome) == 1
        assert isinstance(outcome[0], EngineDeadError), outcome
        assert "killed by signal 9" in str(outcome[0])
        assert failed_at[0] - killed_at < 2
        assert client.is_dead
        with pytest.raises(EngineDeadError):
            client.get_output()
        with pytest.raises(EngineDeadError):
            client.add_request(EngineCoreRequest.for_tokens([1], request_id="after"))
        with pytest.raises(EngineDeadError):
            client.is_sleeping()
    finally:
        client.close()  # does not raise, although the engine died
    assert not is_running(engine_pid)
    assert client_threads() == []
    # After the close too, the death is what calls raise (as the Trio client's).
    with pytest.raises(EngineDeadError, match="killed by signal 9"):
        client.get_output()


def test_with_cancel_on_failure_calls_after_a_death_raise_engine_dead_error() -> None:
    # cancel_on_failure=True ends the client's event loop when the engine dies: later
    # calls find no loop, and must still say the engine died.
    client = SyncMPClient(EngineConfig(), cancel_on_failure=True)
    try:
        engine_pid = client.engine_pids[0]
        assert engine_pid is not None
        os.kill(engine_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while client_threads():
            assert time.monotonic() < deadline, "the event loop did not end"
            time.sleep(0.02)
        calls: list[Callable[[], object]] = [
            client.get_output,
            lambda: client.add_request(EngineCoreRequest.for_tokens([1], request_id="x")),
            client.is_sleeping,
            lambda: client.stream(EngineCoreRequest.for_tokens([1])).__enter__(),
        ]
        for call in calls:
            with pytest.raises(EngineDeadError, match="killed by signal 9") as info:
                call()
            assert type(info.value) is EngineDeadError
    finally:
        client.close()


def test_a_startup_failure_raises_from_the_constructor_and_leaves_no_thread() -> None:
    tmp = tempfile.mkdtemp(prefix="tec-", dir="/tmp")
    start = time.monotonic()
    with pytest.raises(EngineStartupError, match="never sent its ready message"):
        SyncMPClient(
            EngineConfig(),
            input_address=f"ipc://{tmp}/in",
            output_address=f"ipc://{tmp}/out",
            ready_timeout_s=0.5,
        )
    assert 0.5 <= time.monotonic() - start < 5
    assert client_threads() == []


# -------------------------------------------------------------------- in-process


def test_inproc_client_returns_empty_outputs_when_idle_and_pause_wait_keeps_outputs() -> None:
    with InprocClient(EngineConfig()) as client:
        start = time.monotonic()
        idle = client.get_output()
        assert time.monotonic() - start < 1
        assert isinstance(idle, EngineCoreOutputs)
        assert idle.outputs == []

        client.add_request(EngineCoreRequest.for_tokens([100], request_id="r", max_tokens=30))
        first = client.get_output()  # one step: the request is running now
        tokens = [t for o in first.outputs for t in o.new_token_ids]
        assert 0 < len(tokens) < 30
        assert client.get_request_counts() == (0, 1)

        client.pause_scheduler("wait")  # returns once "r" finished
        assert client.statistics().requests_in_flight == 0
        assert client.is_scheduler_paused() is True
        kept = client.get_output()
        assert kept.outputs[-1].finish_reason is not None
        tokens += [t for o in kept.outputs for t in o.new_token_ids]
        assert tokens == expected([100], 30)
        assert client.get_output().outputs == []
        client.resume_scheduler()
        assert client.is_scheduler_paused() is False
        assert client.get_request_counts() == (0, 0)


def test_inproc_client_errors() -> None:
    with InprocClient(EngineConfig(enable_fault_injection=True)) as client:
        with pytest.raises(UtilityCallError) as info:
            client.call_utility("no_such_method")
        assert info.value.method == "no_such_method"
        client.add_request(EngineCoreRequest.for_tokens([1], request_id="a", max_tokens=50))
        with pytest.raises(ValueError, match="already in flight"):
            client.add_request(EngineCoreRequest.for_tokens([1], request_id="a", max_tokens=5))
        assert client.get_output().outputs[0].new_token_ids == [2]
        client.abort_requests(["a", "unknown"])
        assert client.statistics().requests_in_flight == 0
        assert client.get_output().outputs == []
        assert client.get_request_counts() == (0, 0)

        client.add_request(EngineCoreRequest.for_tokens([1], request_id="b", max_tokens=50))
        client.get_output()
        client.call_utility("inject_fault")  # the next step fails fatally
        with pytest.raises(EngineDeadError, match="fault injected"):
            client.get_output()
        with pytest.raises(EngineDeadError, match="fault injected"):
            client.add_request(EngineCoreRequest.for_tokens([1], request_id="c"))
        assert client.statistics().engines_alive == 0

"""The reference engine as a real process, driven over real ZeroMQ sockets.

Each test starts ``trio-enginecore serve`` as a subprocess (attach or handshake mode)
and talks to it through ``tests/enginepeer.py``: a ROUTER and a PULL bound on ipc://
in a private temp dir, and our codec. Every test has an absolute timeout.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import msgspec
import pytest
import trio

from trio_enginecore.dialects import NEWEST
from trio_enginecore.engine import CounterModel
from trio_enginecore.protocol import (
    EngineCoreRequestType,
    FinishReason,
    HandshakeHello,
    LoRARequest,
)

from .enginepeer import EngineDied, make_request, running_engine, serve_command, tokens_of


@pytest.mark.parametrize("handshake", [False, True], ids=["attach", "handshake"])
async def test_200_concurrent_requests_complete_with_exact_counter_sequences(
    handshake: bool,
) -> None:
    prompts = {f"req-{i}": [i * 100 + 1, i * 100 + 7] for i in range(200)}
    with trio.fail_after(60):
        async with running_engine("--max-num-seqs", "64", handshake=handshake) as peer:
            assert peer.ready is not None
            assert peer.ready.max_num_seqs == 64
            assert peer.ready.vllm_version == NEWEST.tested_version
            for rid, prompt in prompts.items():
                await peer.add(make_request(rid, prompt, max_tokens=16))
            results = await peer.collect(set(prompts))
    for rid, prompt in prompts.items():
        assert tokens_of(results[rid]) == CounterModel.expected_tokens(prompt, 16), rid
        assert results[rid][-1].finish_reason is FinishReason.LENGTH
        assert all(o.finish_reason is None for o in results[rid][:-1])


async def test_handshake_mode_says_hello_then_ready() -> None:
    with trio.fail_after(30):
        async with running_engine(handshake=True) as peer:
            hello, ready = peer.handshake_messages
            assert hello == HandshakeHello(local=True, headless=False)
            assert ready.local is True
            await peer.add(make_request("r", [5], max_tokens=3))
            results = await peer.collect({"r"})
    assert tokens_of(results["r"]) == [6, 7, 8]


async def test_aborted_requests_stop_producing_output_and_leave_the_engine() -> None:
    ids = [f"r{i}" for i in range(20)]
    with trio.fail_after(30):
        async with running_engine("--step-time-s", "0.005") as peer:
            for rid in ids:
                await peer.add(make_request(rid, [1], max_tokens=10_000))
            peer.stray.extend(await peer.receive())
            aborted, kept = ids[::2], ids[1::2]
            await peer.abort(aborted)
            # Input is handled in order: once this reply is here the abort was applied.
            counts = await peer.call("get_request_counts")
            assert counts.result is not None
            assert sum(counts.result.result) == len(kept)
            peer.stray.clear()
            for _ in range(5):
                for outputs in await peer.receive():
                    seen = {o.request_id for o in outputs.outputs}
                    assert not seen & set(aborted)
            await peer.abort(kept)
            counts = await peer.call("get_request_counts")
            assert counts.result is not None
            assert counts.result.result == [0, 0]


async def test_utilities_answer_and_failures_carry_the_engine_message() -> None:
    with trio.fail_after(30):
        async with running_engine("--max-loras", "1") as peer:
            tasks = await peer.call("get_supported_tasks")
            assert tasks.failure_message is None
            assert tasks.result is not None
            assert tasks.result.result == ["generate"]
            added = await peer.call("add_lora", LoRARequest("adapter", 7, "/tmp/a"))
            assert added.result is not None
            assert added.result.result is True
            loras = await peer.call("list_loras")
            assert loras.result is not None
            assert loras.result.result == [7]
            assert (await peer.call("is_sleeping")).result.result is False  # type: ignore[union-attr]
            missing = await peer.call("no_such_method")
            assert missing.result is None
            assert missing.failure_message is not None
            assert missing.failure_message.startswith("Call to no_such_method method failed:")
            private = await peer.call("add_request", "whatever")
            assert private.failure_message is not None
            bad_args = await peer.call("remove_lora", "not an int")
            assert bad_args.failure_message is not None
            assert bad_args.failure_message.startswith("Call to remove_lora method failed:")
            # The engine still serves requests after all that.
            await peer.add(make_request("after", [3], max_tokens=2))
            assert tokens_of((await peer.collect({"after"}))["after"]) == [4, 5]


async def test_garbage_and_bad_requests_get_errors_while_others_finish() -> None:
    good = {f"good-{i}": [i + 1] for i in range(10)}
    with trio.fail_after(30):
        async with running_engine("--max-model-len", "64") as peer:
            for rid, prompt in list(good.items())[:5]:
                await peer.add(make_request(rid, prompt, max_tokens=6))
            await peer.send_raw([b"\x09", b"unknown request type"])
            await peer.send_raw([b"\x00", b"\xc1 not msgpack"])
            await peer.send_raw([b"\x00"])  # no payload frame at all
            await peer.send_raw([b"\x01", b"\x92\x01\x02"])  # ABORT of ints
            await peer.send_raw([b"\x05", b"\x90"])  # engine-internal WAKEUP from the wire
            # A decodable ADD whose sampling params fail validation (max_tokens = 0).
            raw = msgspec.msgpack.encode(
                ["bad-params", [1, 2], None, {"max_tokens": 0}, None, 0.0, None, None, None]
            )
            await peer.send_raw([b"\x00", raw])
            await peer.add(make_request("empty-prompt", [], max_tokens=4))
            await peer.add(make_request("too-long", list(range(64)), max_tokens=4))
            await peer.add(make_request("out-of-vocab", [10**6], max_tokens=4))
            # A UTILITY whose args are not a list still gets a failure reply.
            call = msgspec.msgpack.encode([0, 4242, "list_loras", "oops"])
            await peer.send_raw([EngineCoreRequestType.UTILITY.value, call])
            for rid, prompt in list(good.items())[5:]:
                await peer.add(make_request(rid, prompt, max_tokens=6))
            bad = {"bad-params", "empty-prompt", "too-long", "out-of-vocab"}
            results = await peer.collect(set(good) | bad)
            replies = [o.utility_output for o in peer.stray if o.utility_output is not None]
    for rid in bad:
        (output,) = results[rid]
        assert output.finish_reason is FinishReason.ERROR
        assert output.new_token_ids == []
        assert output.error is not None
        assert output.error.message
    assert "max_tokens" in results["bad-params"][0].error.message  # type: ignore[union-attr]
    assert "max_model_len" in results["too-long"][0].error.message  # type: ignore[union-attr]
    for rid, prompt in good.items():
        assert tokens_of(results[rid]) == CounterModel.expected_tokens(prompt, 6)
    assert [r.call_id for r in replies] == [4242]
    assert replies[0].failure_message is not None


async def test_sigterm_drains_in_flight_requests_and_exits_0() -> None:
    ids = [f"r{i}" for i in range(8)]
    with trio.fail_after(30):
        async with running_engine("--step-time-s", "0.01") as peer:
            for rid in ids:
                await peer.add(make_request(rid, [1], max_tokens=30))
            peer.stray.extend(await peer.receive())
            assert peer.process is not None
            peer.process.send_signal(signal.SIGTERM)
            await trio.sleep(0.05)
            await peer.add(make_request("late", [1], max_tokens=3))
            results = await peer.collect({*ids, "late"})
            assert await peer.process.wait() == 0
    for rid in ids:
        assert len(tokens_of(results[rid])) == 30
        assert results[rid][-1].finish_reason is FinishReason.LENGTH
    (late,) = results["late"]
    assert late.finish_reason is FinishReason.ERROR
    assert late.error is not None
    assert "shutting down" in late.error.message


async def test_sigterm_drain_timeout_aborts_what_is_left_and_exits_0() -> None:
    with trio.fail_after(30):
        async with running_engine("--step-time-s", "0.01", "--drain-timeout-s", "0.2") as peer:
            await peer.add(make_request("long", [1], max_tokens=100_000))
            peer.stray.extend(await peer.receive())
            assert peer.process is not None
            peer.process.send_signal(signal.SIGINT)
            results = await peer.collect({"long"})
            assert await peer.process.wait() == 0
    assert results["long"][-1].finish_reason is FinishReason.ABORT


async def test_fatal_error_sends_engine_core_dead_and_exits_1() -> None:
    with trio.fail_after(30):
        async with running_engine("--enable-fault-injection") as peer:
            await peer.add(make_request("victim", [1], max_tokens=100_000))
            peer.stray.extend(await peer.receive())
            await peer.send(
                EngineCoreRequestType.UTILITY,
                [0, 1, "inject_fault", []],
            )
            with pytest.raises(EngineDied):
                while True:
                    peer.stray.extend(await peer.receive())
            assert peer.process is not None
            assert await peer.process.wait() == 1


async def test_fault_injection_is_refused_unless_enabled() -> None:
    with trio.fail_after(30):
        async with running_engine() as peer:
            reply = await peer.call("inject_fault")
            assert reply.failure_message is not None
            assert "disabled" in reply.failure_message
            await peer.add(make_request("ok", [1], max_tokens=2))
            assert tokens_of((await peer.collect({"ok"}))["ok"]) == [2, 3]


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
async def test_an_engine_serving_20000_distinct_prompts_keeps_its_memory_flat() -> None:
    async def serve(first: int, count: int) -> None:
        for start in range(first, first + count, 500):
            ids = {f"p{i}" for i in range(start, start + 500)}
            for i in range(start, start + 500):
                prompt = [i % 30_000 + 1, i // 30_000 + 1, *range(1_000, 1_030)]
                await peer.add(make_request(f"p{i}", prompt, max_tokens=1))
            await peer.collect(ids)

    with trio.fail_after(60):
        # 64 * 256 / 16 = 1024 KV blocks: the prefix cache fills up during the warm-up.
        async with running_engine("--max-num-seqs", "64", "--max-model-len", "256") as peer:
            assert peer.process is not None
            await serve(0, 2_000)
            warm = _rss_bytes(peer.process.pid)
            await serve(2_000, 20_000)
            after = _rss_bytes(peer.process.pid)
    # Keeping every prompt (32 tokens) cost about 1.4 KiB each: 27 MiB here.
    assert after - warm < 8 * 1024 * 1024


def test_serve_help_explains_every_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trio_enginecore", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for flag in [
        "--input-address",
        "--output-address",
        "--handshake-address",
        "--headless",
        "--exit-with-parent",
        "--lifeline-fd",
        "--handshake-timeout-s",
        "--model",
        "--rank",
        "--data-parallel-size",
        "--vocab-size",
        "--max-num-seqs",
        "--max-model-len",
        "--max-loras",
        "--step-time-s",
        "--seed",
        "--log-stats",
        "--drain-timeout-s",
        "--enable-fault-injection",
        "--log-level",
    ]:
        assert flag in result.stdout, flag
    assert "SIGTERM" in result.stdout
    assert "attach mode" in result.stdout
    assert "handshake mode" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--step-time-s", "-1"], "step_time_s"),
        (["--rank", "2"], "data_parallel_rank"),
        ([], "--input-address"),
    ],
)
def test_serve_rejects_bad_configuration_naming_the_field(args: list[str], message: str) -> None:
    where = (
        [] if not args else ["--input-address", "ipc:///tmp/x", "--output-address", "ipc:///tmp/y"]
    )
    result = subprocess.run(
        [*serve_command(*where, *args)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert message in result.stderr

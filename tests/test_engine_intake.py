"""What the engine does with one input message (engine/_intake.py), synchronously.

No socket: messages are built with msgspec and applied to a real EngineCore.
"""

from __future__ import annotations

from typing import Any

import msgspec

from trio_enginecore.config import EngineConfig
from trio_enginecore.engine import EngineCore
from trio_enginecore.engine._intake import RequestIntake
from trio_enginecore.engine._waves import EngineWaveState
from trio_enginecore.protocol import EngineCoreRequest, EngineCoreRequestType, FinishReason


def _intake() -> RequestIntake:
    return RequestIntake(EngineCore(EngineConfig()), EngineWaveState(0))


def _message(kind: EngineCoreRequestType, payload: Any) -> list[bytes | memoryview]:
    return [kind.value, msgspec.msgpack.encode(payload)]


def _valid_add(request_id: str, client_index: int) -> list[Any]:
    """A valid ADD payload as the plain list it is on the wire."""
    request = EngineCoreRequest.for_tokens([1, 2, 3], request_id=request_id, max_tokens=2)
    request = msgspec.structs.replace(request, client_index=client_index)
    fields: list[Any] = msgspec.msgpack.decode(msgspec.msgpack.encode(request))
    return fields


def test_an_invalid_add_is_rejected_to_the_client_that_sent_it() -> None:
    intake = _intake()
    fields = _valid_add("bad", 3)
    fields[EngineCoreRequest.__struct_fields__.index("arrival_time")] = "not a time"
    intake.apply(_message(EngineCoreRequestType.ADD, fields))
    outputs = intake.core.step()
    assert list(outputs) == [3]
    (output,) = outputs[3].outputs
    assert output.request_id == "bad"
    assert output.finish_reason is FinishReason.ERROR
    assert output.error is not None
    assert "invalid request" in output.error.message


def test_an_invalid_utility_call_gets_a_failure_reply_for_its_client() -> None:
    intake = _intake()
    intake.apply(_message(EngineCoreRequestType.UTILITY, [2, 77, 5, []]))  # method: 5
    ((client, reply),) = intake.core.take_utility_outputs()
    assert (client, reply.call_id) == (2, 77)
    assert reply.failure_message is not None
    assert "invalid call" in reply.failure_message


def test_a_draining_engine_refuses_new_requests() -> None:
    intake = _intake()
    intake.draining = True
    intake.apply(_message(EngineCoreRequestType.ADD, _valid_add("late", 1)))
    (output,) = intake.core.step()[1].outputs
    assert output.error is not None
    assert "shutting down" in output.error.message
    assert intake.core.num_requests == 0


def test_garbage_is_dropped_and_the_engine_keeps_going() -> None:
    intake = _intake()
    intake.apply([b"\x00"])
    intake.apply([b"\xff", b"x"])
    intake.apply(_message(EngineCoreRequestType.ABORT, {"not": "a list"}))
    intake.apply(_message(EngineCoreRequestType.ADD, _valid_add("ok", 0)))
    assert intake.core.num_requests == 1

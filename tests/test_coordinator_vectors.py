"""The coordinator speaks vLLM 0.33's coordinator messages byte for byte.

The frames in ``tests/data/vllm-0.33.0-coordinator/frames.json`` were sent by vLLM's own
``DPCoordinatorProc`` (see its README): our front-end and engines decode them with typed
decoders, and our coordinator, in the same state, writes the same bytes.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
import pytest

from trio_enginecore.coordinator import CoordinatorState, start_wave_frames
from trio_enginecore.errors import ProtocolError
from trio_enginecore.protocol import (
    COORDINATOR_READY,
    REPORTS_OWN_WAVES,
    SCALE_ELASTIC_EP,
    CoordinatorPublication,
    EngineCoreOutputs,
    ScaleElasticEP,
    SchedulerStats,
    StartDPWave,
)
from trio_enginecore.serial import MsgpackDecoder

FRAMES = Path(__file__).parent / "data" / "vllm-0.33.0-coordinator" / "frames.json"


@cache
def recording() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(FRAMES.read_text())
    return data


def frames(name: str) -> list[bytes]:
    case = next(case for case in recording()["cases"] if case["name"] == name)
    return [bytes.fromhex(frame) for frame in case["frames"]]


def test_the_recording_comes_from_vllm_0_33() -> None:
    assert recording()["vllm_version"] == "0.33.0"
    assert {case["name"] for case in recording()["cases"]} == {
        "engines_ready",
        "publication_counts",
        "start_dp_wave",
        "publication_wave_started",
        "publication_wave_complete",
        "frontend_scale_elastic_ep",
    }


def test_the_engines_ready_frame() -> None:
    assert frames("engines_ready") == [COORDINATOR_READY]


def test_a_counts_publication_decodes_and_is_what_our_coordinator_writes() -> None:
    (frame,) = frames("publication_counts")
    publication = MsgpackDecoder(CoordinatorPublication).decode([frame])
    assert publication == CoordinatorPublication([(0, 0, 0.0), (1, 2, 0.25)], 0, False)
    state = CoordinatorState(2)
    stats = SchedulerStats(num_waiting_reqs=1, num_running_reqs=2, kv_cache_usage=0.25)
    state.update(EngineCoreOutputs(engine_index=1, scheduler_stats=stats))
    assert state.publication() == frame


@pytest.mark.parametrize(
    ("name", "wave", "running"),
    [("publication_wave_started", 0, True), ("publication_wave_complete", 1, False)],
)
def test_a_wave_publication_has_no_counts(name: str, wave: int, running: bool) -> None:
    (frame,) = frames(name)
    publication = MsgpackDecoder(CoordinatorPublication).decode([frame])
    assert publication == CoordinatorPublication(None, wave, running)


def test_our_coordinator_writes_vllms_wave_frames_for_the_same_reports() -> None:
    state = CoordinatorState(2)
    start = state.update(EngineCoreOutputs(engine_index=1, start_wave=0))
    assert start is not None
    assert start_wave_frames(start) == frames("start_dp_wave")
    assert state.wave_publication() == frames("publication_wave_started")[0]
    state.update(EngineCoreOutputs(engine_index=0, wave_complete=0))
    assert state.wave_publication() == frames("publication_wave_complete")[0]


def test_engines_decode_the_start_dp_wave_broadcast() -> None:
    type_frame, payload = frames("start_dp_wave")
    assert type_frame == b"\x02"
    assert MsgpackDecoder(StartDPWave).decode([payload]) == StartDPWave(0, 1)


def test_the_only_front_end_message_is_scale_elastic_ep() -> None:
    (frame,) = frames("frontend_scale_elastic_ep")
    scale = MsgpackDecoder(ScaleElasticEP).decode([frame])
    assert scale == ScaleElasticEP(SCALE_ELASTIC_EP, 3)
    assert msgspec.msgpack.encode(scale) == frame


def test_the_old_front_end_wake_message_is_not_a_coordinator_message() -> None:
    # (engine_rank, wave), which the client used to send: vLLM's coordinator logs it as
    # unexpected, and ours refuses it with a typed error.
    with pytest.raises(ProtocolError):
        MsgpackDecoder(ScaleElasticEP).decode([msgspec.msgpack.encode((1, 0))])


@pytest.mark.parametrize(
    "message", [("SCALE_ELASTIC_EP", 0), ("SCALE_ELASTIC_EP", -2), ("SCALE_OUT", 3)]
)
def test_a_front_end_message_of_another_tag_or_an_empty_group_is_refused(
    message: tuple[str, int],
) -> None:
    with pytest.raises(ProtocolError, match="ScaleElasticEP"):
        MsgpackDecoder(ScaleElasticEP).decode([msgspec.msgpack.encode(message)])


def test_the_own_waves_announcement_is_a_wave_vllms_coordinator_ignores() -> None:
    # vLLM's coordinator ends a wave on wave_complete >= its current wave (>= 0).
    assert REPORTS_OWN_WAVES < 0

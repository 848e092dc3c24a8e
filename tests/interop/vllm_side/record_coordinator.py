"""Record the frames of vLLM's real ``DPCoordinator`` (the golden coordinator frames).

Runs vLLM's ``DPCoordinatorProc`` (the loop its coordinator process runs) on ipc://
sockets in a temporary directory, plays two engines and a front-end at it with vLLM's
own encoder and structs, and records every frame the coordinator sends, and the one
message a front-end may send it (``("SCALE_ELASTIC_EP", n)``, encoded as vLLM's client
encodes it; the coordinator's acceptance of it is checked through its effect).

Prints the recording as one ``@{json}`` line: ``{"vllm_version": ..., "cases": [{"name",
"direction", "socket", "description", "frames": [hex, ...]}]}``. The interop tests compare
it with ``tests/data/vllm-0.33.0-coordinator/frames.json``, which was written from it
with vLLM 0.33 (0.34's coordinator sends the same frames).
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from common import say


def main() -> int:
    import msgspec
    import vllm
    import zmq
    from vllm.config import LoggingConfig
    from vllm.logger import configure_logging
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.engine.coordinator import DPCoordinatorProc
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackEncoder

    configure_logging(LoggingConfig())  # vLLM's, as its coordinator process has it
    directory = tempfile.mkdtemp(prefix="tec-coord-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    front, back_out, back_pub = (f"ipc://{directory}/{name}" for name in ("front", "out", "pub"))
    coordinator = DPCoordinatorProc(engine_count=2, min_stats_update_interval_ms=50)
    threading.Thread(
        target=coordinator.process_input_socket,
        args=(front, back_out, back_pub),
        daemon=True,
    ).start()

    ctx = zmq.Context()
    engines = [ctx.socket(zmq.XSUB) for _ in range(2)]
    frontend = ctx.socket(zmq.XSUB)
    push = ctx.socket(zmq.PUSH)
    for sock in (*engines, frontend, push):
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.setsockopt(zmq.LINGER, 0)
    encoder = MsgpackEncoder()
    cases: list[dict[str, Any]] = []

    def record(name: str, direction: str, socket: str, description: str, frames: Any) -> None:
        cases.append(
            {
                "name": name,
                "direction": direction,
                "socket": socket,
                "description": description,
                "frames": [bytes(frame).hex() for frame in frames],
            }
        )

    def publication(predicate: Any) -> bytes:
        while True:
            frame = frontend.recv()
            if predicate(msgspec.msgpack.decode(frame)):
                return frame

    for engine in engines:
        engine.connect(back_pub)
        engine.send(b"\x01")
    ready = [engine.recv_multipart() for engine in engines]
    assert ready[0] == ready[1]
    record(
        "engines_ready",
        "coordinator->engine",
        "coordinator XPUB (engine publish) -> engine XSUB",
        "Sent to every engine once all engine_count engines have subscribed.",
        ready[0],
    )

    frontend.connect(front)
    frontend.send(b"\x01")
    push.connect(back_out)
    stats = SchedulerStats(
        num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25, step_counter=1
    )
    push.send_multipart(encoder.encode(EngineCoreOutputs(engine_index=1, scheduler_stats=stats)))
    frame = publication(lambda p: p[0] is not None and p[0][1] == [1, 2, 0.25])
    record(
        "publication_counts",
        "coordinator->frontend",
        "coordinator XPUB (publish) -> front-end XSUB",
        "(counts, current_wave, engines_running) after engine 1 reported 1 waiting, "
        "2 running, KV usage 0.25: counts is one [waiting, running, kv_usage] per engine.",
        [frame],
    )

    push.send_multipart(encoder.encode(EngineCoreOutputs(engine_index=1, start_wave=0)))
    starts = [engine.recv_multipart() for engine in engines]
    assert starts[0] == starts[1]
    record(
        "start_dp_wave",
        "coordinator->engine",
        "coordinator XPUB (engine publish) -> engine XSUB",
        "START_DP_WAVE(wave 0, exclude engine 1) after engine 1 sent start_wave=0.",
        starts[0],
    )
    frame = publication(lambda p: p[0] is None and p[1:] == [0, True])
    record(
        "publication_wave_started",
        "coordinator->frontend",
        "coordinator XPUB (publish) -> front-end XSUB",
        "Sent at once when the wave starts: counts None, wave 0, running.",
        [frame],
    )

    push.send_multipart(encoder.encode(EngineCoreOutputs(engine_index=0, wave_complete=0)))
    frame = publication(lambda p: p[0] is None and p[1:] == [1, False])
    record(
        "publication_wave_complete",
        "coordinator->frontend",
        "coordinator XPUB (publish) -> front-end XSUB",
        "Sent at once when rank 0 reports wave 0 complete: counts None, wave 1, paused.",
        [frame],
    )

    scale = msgspec.msgpack.encode(("SCALE_ELASTIC_EP", 3))
    frontend.send(scale)
    # Accepted: the next counts cover three engines.
    push.send_multipart(encoder.encode(EngineCoreOutputs(engine_index=2, scheduler_stats=stats)))
    publication(lambda p: p[0] is not None and len(p[0]) == 3)
    record(
        "frontend_scale_elastic_ep",
        "frontend->coordinator",
        "front-end XSUB -> coordinator XPUB (publish)",
        "The only message a front-end sends (vLLM's client: msgpack "
        '("SCALE_ELASTIC_EP", new_size)); the coordinator then counts 3 engines.',
        [scale],
    )
    say(event="recorded", vllm_version=vllm.__version__, cases=cases)
    return 0


if __name__ == "__main__":
    sys.exit(main())

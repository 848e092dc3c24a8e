"""A fake engine that floods a client with output messages (receive-path benchmark).

    python -m benchmarks.flood --input-address A --output-address B --batch 256 --messages M

It connects like an engine (DEALER with rank 0's identity, sends a ready message; PUSH
for outputs), waits until the client has added ``batch`` requests, then pushes
``messages`` pre-encoded EngineCoreOutputs of one non-final token per request as fast
as the socket takes them, and finally one message finishing every request. Encoding
happens once, up front: only the client's receive path is measured.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import zmq

from trio_enginecore.config import EngineConfig
from trio_enginecore.engine import EngineCore
from trio_enginecore.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
)
from trio_enginecore.serial import MsgpackDecoder, MsgpackEncoder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--input-address", required=True)
    parser.add_argument("--output-address", required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--messages", type=int, default=3000)
    args = parser.parse_args(argv)
    ctx: zmq.Context[Any] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, (0).to_bytes(2, "little"))
    dealer.setsockopt(zmq.RCVHWM, 0)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.setsockopt(zmq.LINGER, 10_000)
    dealer.connect(args.input_address)
    push.connect(args.output_address)
    encoder = MsgpackEncoder()
    dealer.send(encoder.encode(EngineCore(EngineConfig()).ready_response())[0])
    decoder = MsgpackDecoder(EngineCoreRequest)
    request_ids: list[str] = []
    while len(request_ids) < args.batch:
        frames = dealer.recv_multipart()
        if frames[0] == EngineCoreRequestType.ADD.value:
            request_ids.append(decoder.decode(frames[1:]).request_id)
    step = encoder.encode(
        EngineCoreOutputs(outputs=[EngineCoreOutput(r, [1]) for r in request_ids], timestamp=1.0)
    )
    final = encoder.encode(
        EngineCoreOutputs(
            outputs=[
                EngineCoreOutput(r, [2], finish_reason=FinishReason.LENGTH) for r in request_ids
            ],
            timestamp=1.0,
        )
    )
    payload = bytes(step[0])
    for _ in range(args.messages):
        push.send(payload, copy=True)
    push.send(bytes(final[0]))
    # Wait for the client to hang up (its last message) so linger can flush.
    dealer.recv_multipart()
    push.close()
    dealer.close(linger=0)
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())

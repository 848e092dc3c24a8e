"""How both sides of the random round trip compare two encodings of one message.

Importable from the vLLM environment (``random_frames.py``) and from the project's
(``test_random_round_trip.py``): plain msgspec, nothing of vLLM or of ours.
"""

from __future__ import annotations

from typing import Any

import msgspec


def canonical(frames: list[bytes]) -> tuple[Any, list[bytes]]:
    """A message as plain msgpack, with the one set a request carries
    (``SamplingParams._all_stop_token_ids``) in sorted order, and its aux frames.

    A set travels as an array in its iteration order, which depends on how the set was
    built: no decoder keeps it (vLLM's own decode and encode reorder it too), so two
    encodings of equal messages may list it differently and are otherwise the same.
    """
    payload = msgspec.msgpack.decode(frames[0], ext_hook=lambda code, data: (code, bytes(data)))
    if isinstance(payload, list) and len(payload) > 3 and isinstance(payload[3], dict):
        stops = payload[3].get("_all_stop_token_ids")
        if isinstance(stops, list):
            payload[3]["_all_stop_token_ids"] = sorted(stops)
    return payload, frames[1:]

"""CURVE authentication and encryption for engines joining over TCP.

A client that binds TCP addresses for engines on other hosts (``RemoteEngines``)
is the CURVE *server* of every connection, with a key pair of its own and an
allow-list of engine public keys; each engine is a CURVE *client* holding its own key
pair and the client's public key. Key pairs are ZeroMQ certificate files, written by
:func:`write_key_pair` or ``trio-enginecore keygen NAME``. The security guide walks
through a deployment.
"""

from __future__ import annotations

from ._curve import (
    CurveClient as CurveClient,
    CurveKeyPair as CurveKeyPair,
    CurveServer as CurveServer,
    load_public_key as load_public_key,
    write_key_pair as write_key_pair,
)

__all__ = ["CurveClient", "CurveKeyPair", "CurveServer", "load_public_key", "write_key_pair"]

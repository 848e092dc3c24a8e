"""Engines in other processes, reached over ZeroMQ: the multiprocess transport.

The engine group (:mod:`._group`) is the transport: the engines' lifecycle around a
message pipe (:mod:`._pipe`), the data path, which is ZeroMQ's sockets and their
receive task (:mod:`._zmq_pipe`, :mod:`._receive`) unless another is given.
The rooms of the lifecycle: where engines are and how many (:mod:`._topology`,
:mod:`._remote`), launching them and holding their processes (:mod:`._launch`), the
handshake and readiness (:mod:`._startup`), following a coordinator
(:mod:`._following`), noticing deaths and silences (:mod:`._liveness`) and restarting
(:mod:`._supervision`).
"""

"""The client's pure core: what a client knows and decides, with no I/O.

The request table and the engines' states (:mod:`._state`, :mod:`._engines`), utility
calls (:mod:`._calls`), routing and load balancing (:mod:`._router`, :mod:`._lb`), the
failure policy (:mod:`._policy`), the request stream pair (:mod:`._stream`), output
merging (:mod:`._collector`), the typed utilities' table (:mod:`._utilities`), the
liveness rules (:mod:`._liveness_rules`) and the statistics a client reports
(:mod:`._statistics`). Nothing here opens a socket, starts a process or reads a clock
of its own: ``tests/test_layout.py`` holds every module of this folder to that. Trio is
used for what a waiting reader needs (events, parking), never for I/O.
"""

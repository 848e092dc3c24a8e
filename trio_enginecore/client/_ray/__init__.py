"""Engines placed by Ray: the placement group and one actor per rank (:mod:`._session`,
:mod:`._actor`), and their settings (:mod:`._settings`). Ray only places and starts
the engines; the client reaches them as remote engines, through the multiprocess
transport. Nothing here imports Ray until a Ray client is opened.
"""

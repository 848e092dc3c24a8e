"""Side-by-side benchmarks: the Trio client against vLLM-style baselines.

Nothing in the ``trio_enginecore`` package imports this package: it is developer
tooling. :mod:`benchmarks.worker` runs one measurement per process; the baselines live
in :mod:`benchmarks.baselines`.
"""

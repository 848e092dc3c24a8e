"""Interop tests against real vLLM 0.33.0 (``nox -s interop``)."""

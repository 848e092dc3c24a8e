"""Interop tests against real vLLM 0.33.0 and 0.34.0 (``nox -s interop``)."""

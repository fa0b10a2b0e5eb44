"""Serving icekv behind Triton: request parsing, scheduling, the Python-backend model, launcher.

Nothing here imports ``triton_python_backend_utils``; the shim passes it to :class:`TritonModel`.
"""

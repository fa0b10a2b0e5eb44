"""icekv: a long-context KV cache backend for Triton Inference Server.

Importing this package has no side effects and does not import triton, tensorrt or Triton's
``triton_python_backend_utils``; the submodules are imported where they are used.
"""

__version__ = "0.1.0"

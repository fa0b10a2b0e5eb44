"""Triton Python-backend entry point for icekv: a thin shim over ``icekv.serving``.

Copied to ``<model repository>/icekv/1/model.py``; it is the only file that imports Triton's
``triton_python_backend_utils`` (available inside the backend's stub process only).
"""

import triton_python_backend_utils as pb_utils

from icekv.serving.triton_model import TritonModel


class TritonPythonModel:
    def initialize(self, args):
        self.model = TritonModel(pb_utils)
        self.model.initialize(args)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()

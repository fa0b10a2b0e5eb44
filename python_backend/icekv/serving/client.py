"""A small tritonclient (gRPC streaming) helper: send one generate request, iterate its pieces.

Used by ``icekv demo``, the serving tests and the load benchmark; any Triton client works.
"""

from __future__ import annotations

import queue
from typing import Iterator

import numpy as np

from icekv.serving.repository import DTYPES, INPUTS
from icekv.serving.response import Final, OUTPUTS



class GenerateError(RuntimeError):
    """The server answered the request with an error."""


def infer_inputs(grpcclient, fields: dict) -> list:
    """The model's input tensors for ``fields`` (name -> value or list of values)."""
    out = []
    for name, ttype, dims, _ in INPUTS:
        if name not in fields:
            continue
        wire, dtype = DTYPES[ttype]
        value = fields[name]
        values = value if isinstance(value, (list, tuple)) else [value]
        arr = np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=dtype)
        tensor = grpcclient.InferInput(name, list(arr.shape), wire)
        tensor.set_data_from_numpy(arr)
        out.append(tensor)
    return out


def read_response(result) -> str | Final:
    """One streamed response: a text piece, or the request's :class:`Final` (its last response)."""
    if result.as_numpy("finish_reason") is not None:
        values = {name: result.as_numpy(name)[0] for name, _ in OUTPUTS[1:]}  # Final's fields
        return Final(**{k: v.decode() if isinstance(v, bytes) else int(v) for k, v in values.items()})
    return result.as_numpy("text_output")[0].decode()


def stream_generate(url: str, text: str | None, model: str = "icekv", timeout_s: float = 600,
                    **fields) -> Iterator[str | Final]:
    """Yield text pieces as they arrive, then one :class:`Final`. Raises GenerateError. ``text``
    None sends no prompt (a request that only compresses its ``context``)."""
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    finished = False  # the final response (or an error) has come: the request is over
    try:
        prompt = {} if text is None else {"text_input": text}
        client.async_stream_infer(model, infer_inputs(grpcclient, {**prompt, "stream": True, **fields}))
        while True:
            result, error = responses.get(timeout=timeout_s)
            if error is not None:
                finished = True
                raise GenerateError(str(error))
            piece = read_response(result)
            finished = isinstance(piece, Final)
            if piece:
                yield piece
            if finished:
                return
    finally:
        # cancel only an unfinished request: a call cancelled after its final response leaks its
        # state in tritonserver 2.51, and with it the model, which then never unloads
        client.stop_stream(cancel_requests=not finished)
        client.close()

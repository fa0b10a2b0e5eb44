"""One request to the icekv Triton model over gRPC streaming, as an async iterator of pieces.

Closing the iterator (the HTTP client went away, a timeout) cancels the gRPC call, and Triton
then cancels the request in the engine, which frees its pages.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, AsyncIterator

from icekv.serving.client import Final, infer_inputs, read_response
from icekv.serving.error_kinds import kind_of
from icekv.serving.openai.protocol import OpenAIError

STATUS_OF_KIND = {"client": 400, "busy": 503, "cancelled": 499, "internal": 500}
HEALTH_WAIT_S = 10.0  # a health request skips the engine's queue: no answer by then, and the model is stuck


class TritonBridge:
    """A gRPC client of one Triton model, opened inside the frontend's event loop."""

    def __init__(self, url: str, model: str):
        import tritonclient.grpc.aio as grpcclient

        self.model = model
        self._client = grpcclient.InferenceServerClient(url)

    async def live(self) -> bool:
        try:
            return bool(await self._client.is_server_live())
        except Exception:  # unreachable server: not live
            return False

    async def ready(self) -> bool:
        try:
            return bool(await self._client.is_model_ready(self.model))
        except Exception:  # unreachable server: not ready
            return False

    async def engine_alive(self) -> bool:
        """The model's engine thread is alive (:meth:`health`)."""
        return await self.health() is not None

    async def health(self, timeout_s: float = HEALTH_WAIT_S) -> Final | None:
        """The model's answer to a health request (answered without queueing: its engine thread
        is alive, and how it writes tool calls); None when it gives none within ``timeout_s``."""
        async def answer() -> Final | None:
            async for piece in self.generate({"health": True}):
                if isinstance(piece, Final):
                    return piece if piece.finish_reason == "healthy" else None
            return None

        try:
            return await asyncio.wait_for(answer(), timeout_s)
        except (OpenAIError, TimeoutError):
            return None

    async def generate(self, fields: dict[str, Any]) -> AsyncIterator[str | Final]:
        """Yield the text pieces, then the Final; OpenAIError for any failure."""
        import tritonclient.grpc as grpcclient

        request = {"model_name": self.model, "inputs": infer_inputs(grpcclient, fields), "request_id": uuid.uuid4().hex}

        async def requests():
            yield request

        call = self._client.stream_infer(requests())
        finished = False
        try:
            async for result, error in call:
                if error is not None:  # an error is the request's final response
                    finished = True
                    message = error.message() if hasattr(error, "message") else str(error)
                    raise OpenAIError(STATUS_OF_KIND[kind_of(message)], message)
                piece = read_response(result)
                finished = isinstance(piece, Final)
                yield piece
                if finished:
                    return
            raise OpenAIError(500, "the inference server closed the request without a final response")
        except OpenAIError:
            raise
        except Exception:  # gRPC transport failures: the server is down or restarting
            raise OpenAIError(503, "the inference server is unavailable; retry later") from None
        finally:
            if not finished:  # never after the final response (or error): tritonserver 2.51 then
                call.cancel()  # leaks the call's state, and with it the model, which can never unload

    async def close(self) -> None:
        await self._client.close()

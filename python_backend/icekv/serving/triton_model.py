"""icekv as a decoupled Triton Python-backend model: requests in, streamed responses out.

``pb_utils`` (Triton's ``triton_python_backend_utils``) is handed in by the shim, so this module
imports without Triton and can be read and tested like the rest of the package.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np

from icekv.config import ServingConfig
from icekv.engine import Engine, Generation
from icekv.errors import IcekvError
from icekv.serving.error_kinds import tag
from icekv.serving.repository import INPUTS
from icekv.serving.request import RequestError, parse_request
from icekv.serving.engine_loop import BusyError, EngineLoop

log = logging.getLogger(__name__)


class TritonSink:
    """Sends one request's results through its Triton response sender."""

    def __init__(self, pb, sender, stream: bool = False):
        self.pb, self.sender, self.stream = pb, sender, stream

    def _send(self, response, final: bool) -> None:
        if self.sender is None:
            return  # the final response has gone
        flags = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        try:
            self.sender.send(response, flags=flags)
        except Exception as e:  # the client went away: nothing to deliver to
            log.info("could not send a response: %s", e)
        if final:  # Triton frees a request's response factory with its sender; until then the
            self.sender = None  # model counts as in use and cannot unload

    def _tensor(self, name: str, value, dtype) -> object:
        return self.pb.Tensor(name, np.array([value], dtype=dtype))

    def cancelled(self) -> bool:
        return self.sender is None or bool(self.sender.is_cancelled())

    def text(self, delta: str) -> None:
        """Streamed pieces go out at once; a non-streamed request gets the whole text in done()."""
        if self.stream:
            self._send(self.pb.InferenceResponse(output_tensors=[self._tensor("text_output", delta.encode(), np.object_)]), False)

    def done(self, result: Generation) -> None:
        text = "" if self.stream else result.text
        t = self._tensor
        outputs = [
            t("text_output", text.encode(), np.object_),
            t("finish_reason", result.finish_reason.encode(), np.object_),
            t("prompt_tokens", result.prompt_tokens, np.int32),
            t("new_tokens", result.new_tokens, np.int32),
            t("policy", result.policy.encode(), np.object_),
            t("budget", result.budget or 0, np.int32),
            t("kv_resident_bytes", result.kv.resident_bytes, np.int64),
            t("kv_total_bytes", result.kv.total_bytes, np.int64),
            t("kv_bytes_moved", result.kv.bytes_moved, np.int64),
        ]
        self._send(self.pb.InferenceResponse(output_tensors=outputs), True)

    def error(self, message: str, kind: str) -> None:
        errors = self.pb.TritonError
        code = {"client": errors.INVALID_ARG, "busy": errors.UNAVAILABLE,
                "cancelled": errors.CANCELLED}.get(kind, errors.INTERNAL)
        self._send(self.pb.InferenceResponse(error=self.pb.TritonError(tag(message, kind), code)), True)


class Metrics:
    """icekv_* Prometheus metrics on Triton's /metrics (families must stay referenced)."""

    GAUGES = {
        "icekv_kv_resident_bytes": "KV cache bytes on the compute device, all live requests",
        "icekv_kv_host_bytes": "KV cache bytes in the host page pool, all live requests",
        "icekv_active_requests": "requests being prefilled or decoded",
        "icekv_queued_requests": "requests waiting for memory or a turn",
        "icekv_index_bytes_promised": "host bytes of page index the active requests may build (worst case)",
    }
    COUNTERS = {
        "icekv_pages_moved_total": "(layer, KV head) pages copied from the host pool to device slots",
        "icekv_selection_seconds_total": "time spent selecting pages (index search, page scoring)",
        "icekv_context_store_hits_total": "requests served from a stored compressed context",
        "icekv_requests_completed_total": "requests that finished",
        "icekv_requests_failed_total": "requests that ended in an error",
        "icekv_requests_cancelled_total": "requests cancelled by the client",
        "icekv_generated_tokens_total": "tokens generated",
    }

    def __init__(self, pb):
        self.families, self.metrics, self._last = [], {}, {}
        for kind, table in ((pb.MetricFamily.GAUGE, self.GAUGES), (pb.MetricFamily.COUNTER, self.COUNTERS)):
            for name, description in table.items():
                family = pb.MetricFamily(name=name, description=description, kind=kind)
                self.families.append(family)
                self.metrics[name] = family.Metric(labels={"model": "icekv"})

    def update(self, loop: EngineLoop) -> None:
        """Push changed values only: an idle server sends nothing to Triton, so a shutdown never
        races a metrics message (seen: unload hanging while a background update was in flight)."""
        resident, host = loop.engine.kv_bytes()
        s = loop.stats
        snapshot = (resident, host, s.active, s.queued, s.index_bytes_promised, s.pages_moved, s.select_s,
                    s.completed, s.failed, s.cancelled, s.store_hits, s.generated_tokens)
        if snapshot == self._last.get("snapshot"):
            return
        self._last["snapshot"] = snapshot
        for name, value in (("icekv_kv_resident_bytes", resident), ("icekv_kv_host_bytes", host),
                            ("icekv_active_requests", s.active), ("icekv_queued_requests", s.queued),
                            ("icekv_index_bytes_promised", s.index_bytes_promised)):
            self.metrics[name].set(float(value))
        for name, value in (("icekv_pages_moved_total", s.pages_moved), ("icekv_selection_seconds_total", s.select_s),
                            ("icekv_requests_completed_total", s.completed), ("icekv_requests_failed_total", s.failed),
                            ("icekv_requests_cancelled_total", s.cancelled),
                            ("icekv_context_store_hits_total", s.store_hits),
                            ("icekv_generated_tokens_total", s.generated_tokens)):
            delta = value - self._last.get(name, 0)
            if delta:
                self.metrics[name].increment(float(delta))
                self._last[name] = value


class TritonModel:
    def __init__(self, pb):
        self.pb = pb

    def initialize(self, args: dict) -> None:
        model_config = json.loads(args["model_config"])
        if not self.pb.using_decoupled_model_transaction_policy(model_config):
            raise IcekvError("the icekv model must be decoupled (model_transaction_policy { decoupled: true })")
        self.cfg = ServingConfig.from_triton_parameters(model_config.get("parameters", {}))
        t0 = time.perf_counter()
        self.metrics = Metrics(self.pb)
        self.loop = EngineLoop(lambda: Engine(self.cfg.engine), on_tick=self.metrics.update)
        self.engine = self.loop.engine
        self.store = None
        if self.cfg.store:
            from icekv.store import ContextStore

            self.store = ContextStore.open(self.cfg.store, self.engine.model_id, self.cfg.store_max_bytes)
        log.warning("icekv: loaded %s in %.1f s (policy %s)", self.engine.model_dir, time.perf_counter() - t0,
                    self.cfg.engine.selection.policy)

    def execute(self, requests) -> None:
        for request in requests:
            sink = TritonSink(self.pb, request.get_response_sender())
            try:
                inputs = {}
                for name, *_ in INPUTS:
                    tensor = self.pb.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        inputs[name] = tensor.as_numpy()
                params = json.loads(request.parameters() or "{}")
                req = parse_request(inputs, params, self.cfg, self.engine.chat_prompt)
                context = self._context(req.context_key) if req.context_key is not None else None
                sink.stream = req.stream
                self.loop.submit(req, sink, context)
            except BusyError as e:
                sink.error(str(e), kind="busy")
            except (IcekvError, json.JSONDecodeError) as e:
                sink.error(str(e), kind="client")
        return None

    def _context(self, key: str):
        """The stored compressed context for ``key``; a clear client error when there is none."""
        if self.store is None:
            raise RequestError(f"unknown context_key {key!r}: no context store is configured")
        context = self.store.load(key)  # StoreError (corrupt/foreign) is a client-visible error too
        if context is None:
            raise RequestError(f"unknown context_key {key!r}: not in the context store (run icekv compress)")
        self.loop.stats.store_hits += 1
        return context

    def finalize(self) -> None:
        self.loop.stop()
        self.metrics = None

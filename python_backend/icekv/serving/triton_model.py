"""icekv as a decoupled Triton Python-backend model: requests in, streamed responses out.

``pb_utils`` (Triton's ``triton_python_backend_utils``) is handed in by the shim, so this module
imports without Triton and can be read and tested like the rest of the package.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, replace

import numpy as np

from icekv.compress import parse_settings
from icekv.devices import use_huge_pages
from icekv.config.settings import serving_config
from icekv.engine import Engine, Generation
from icekv.errors import IcekvError
from icekv.kv.prefix_cache import PrefixCacheStats
from icekv.policies.index_cache import IndexCacheStats
from icekv.store.prefix_pages import PrefixPageStats
from icekv.serving.error_kinds import tag
from icekv.serving.repository import DTYPES, INPUTS
from icekv.serving.response import OUTPUTS, Final
from icekv.serving.request import parse_request
from icekv.serving.tool_formats import ModelToolCalls, tool_format
from icekv.serving.context_service import ContextService
from icekv.serving.engine_loop import EngineLoop
from icekv.serving.loop_api import EngineStopped, error_reply

log = logging.getLogger(__name__)


class TritonSink:
    """Sends one request's results through its Triton response sender."""

    def __init__(self, pb, sender, stream: bool = False):
        self.pb, self.sender, self.stream = pb, sender, stream
        self.context_key = self.context_cache = ""

    def context_used(self, key: str, status: str) -> None:
        self.context_key, self.context_cache = key, status

    def _send(self, response, final: bool) -> None:
        if self.sender is None:
            return  # the final response has gone
        flags = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        try:
            self.sender.send(response, flags=flags)
        except Exception as e:  # the client went away: nothing to deliver to
            log.warning("could not send a response: %s", e)
            if final:  # the final flag alone still closes the request, which Triton waits for to unload
                try:
                    self.sender.send(flags=flags)
                except Exception as again:
                    log.warning("could not close the request: %s", again)
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
        self._final(Final(finish_reason=result.finish_reason, prompt_tokens=result.prompt_tokens,
                          cached_tokens=result.cached_tokens, new_tokens=result.new_tokens, policy=result.policy, budget=result.budget or 0,
                          kv_resident_bytes=result.kv.resident_bytes, kv_total_bytes=result.kv.total_bytes,
                          kv_bytes_moved=result.kv.bytes_moved,
                          logprobs=json.dumps(result.logprobs, ensure_ascii=False) if result.logprobs else "",
                          prompt_logprobs=json.dumps(result.prompt_logprobs, ensure_ascii=False)
                          if result.prompt_logprobs else ""),
                    "" if self.stream else result.text)

    def context_ready(self, key: str, context) -> None:
        """A compress-only request's answer: the key, and the context's KV bytes compressed
        (kv_resident_bytes) and in full (kv_total_bytes)."""
        self.context_key = key
        self._final(Final(finish_reason="context_ready", prompt_tokens=context.length,
                          kv_resident_bytes=context.nbytes, kv_total_bytes=context.full_bytes))

    def healthy(self, calls_format: str) -> None:
        """A health request's answer: the engine thread is alive; the model's tool-call format."""
        self._final(Final(finish_reason="healthy", tool_format=calls_format))

    def _final(self, final: Final, text: str = "") -> None:
        """The request's last response: its text (if not streamed) and every field of ``final``,
        with this request's context."""
        final = replace(final, context_key=self.context_key, context_cache=self.context_cache)
        values = {"text_output": text, **asdict(final)}
        outputs = [self._tensor(name, values[name].encode() if isinstance(values[name], str) else values[name],
                                DTYPES[triton_type][1]) for name, triton_type in OUTPUTS]
        self._send(self.pb.InferenceResponse(output_tensors=outputs), True)

    def error(self, message: str, kind: str) -> None:
        errors = self.pb.TritonError
        code = {"client": errors.INVALID_ARG, "busy": errors.UNAVAILABLE,
                "cancelled": errors.CANCELLED}.get(kind, errors.INTERNAL)
        self._send(self.pb.InferenceResponse(error=self.pb.TritonError(tag(message, kind), code)), True)


class Metrics:
    """icekv_* Prometheus metrics on Triton's /metrics (families must stay referenced until
    :meth:`close`)."""

    GAUGES = {
        "icekv_kv_resident_bytes": "KV cache bytes on the compute device, all live requests",
        "icekv_kv_host_bytes": "KV cache bytes in the host page pool, all live requests",
        "icekv_kv_pool_pages": "pages of the KV page pool",
        "icekv_kv_pool_pages_in_use": "pool pages live requests hold (idle prefix-cache pages count as free)",
        "icekv_active_requests": "requests being prefilled or decoded",
        "icekv_queued_requests": "requests waiting for memory or a turn",
        "icekv_index_bytes_promised": "host bytes of page index the active requests may build (worst case)",
        "icekv_device_bytes_promised": "device bytes the active requests may hold beside the model, with the KV "
                                       "pool in host memory (worst case; 0 otherwise)",
        "icekv_contexts_in_memory": "compressed contexts held in memory (shared by the requests using them)",
        "icekv_context_bytes_in_memory": "bytes of the compressed contexts held in memory",
        "icekv_prefix_cache_pages": "KV pages the prefix cache holds (shared by requests, or idle until evicted)",
        "icekv_index_cache_bytes": "host bytes of the page indexes kept for requests that continue a finished one",
    }
    COUNTERS = {
        "icekv_pages_moved_total": "(layer, KV head) pages copied from the host pool to device slots",
        "icekv_selection_seconds_total": "time spent selecting pages (index search, page scoring)",
        "icekv_context_store_hits_total": "requests whose context was found compressed (in memory or the store)",
        "icekv_context_store_misses_total": "contexts compressed by this server",
        "icekv_context_store_joined_total": "requests that waited on a compression another request started "
                                            "(here, or on a replica sharing the store)",
        "icekv_context_compression_seconds_total": "time from a compression's start to its result",
        "icekv_context_bytes_saved_total": "KV bytes compression removed (full minus compressed), per compression",
        "icekv_requests_completed_total": "requests that finished",
        "icekv_requests_failed_total": "requests that ended in an error",
        "icekv_requests_cancelled_total": "requests cancelled by the client",
        "icekv_generated_tokens_total": "tokens generated",
        "icekv_prefix_cache_hit_tokens_total": "prompt tokens the prefix cache held, not prefilled",
        "icekv_prefix_cache_miss_tokens_total": "prompt tokens prefilled by requests that looked in the prefix cache",
        "icekv_prefix_cache_evictions_total": "cached pages evicted for room in the pool",
        "icekv_prefix_cache_retained_evictions_total": "of them, pages evicted before the retention a request asked "
                                                       "for ended (the pool had no other idle page)",
        "icekv_prefix_cache_reloaded_pages_total": "pages of a hit read back from the store (prefix_cache_spill)",
        "icekv_prefix_cache_spilled_pages_total": "cached pages written to the store (prefix_cache_spill)",
        "icekv_prefix_cache_spill_refused_total": "stored pages refused: corrupt (deleted), foreign or misshapen",
        "icekv_prefix_cache_spill_failures_total": "page writes or reads the store failed, or writes skipped "
                                                   "(too many pending)",
        "icekv_index_cache_hits_total": "decodes that continued the page index a finished request left, not built anew",
        "icekv_index_cache_reused_tokens_total": "tokens those decodes found indexed already",
        "icekv_index_cache_evictions_total": "kept indexes dropped for the index memory of admitted requests",
    }

    def __init__(self, pb):
        self.families, self.metrics, self._last = [], {}, {}
        self.pages = None  # the prefix cache's pages in the store, when they are spilled there
        for kind, table in ((pb.MetricFamily.GAUGE, self.GAUGES), (pb.MetricFamily.COUNTER, self.COUNTERS)):
            for name, description in table.items():
                family = pb.MetricFamily(name=name, description=description, kind=kind)
                self.families.append(family)
                self.metrics[name] = family.Metric(labels={"model": "icekv"})

    def close(self) -> None:
        """Finish the pages still being written, and release the metrics now, while the backend's
        stub is alive: a family still referenced (the engine loop's tick holds this object) would
        be released in the stub's own teardown, which then crashes (triton-inference-server/server
        issue 8662)."""
        if self.pages is not None:
            self.pages.close()
        self.metrics.clear()
        self.families.clear()

    def update(self, loop: EngineLoop) -> None:
        """Push changed values only: an idle server sends nothing to Triton, so a shutdown never
        races a metrics message (seen: unload hanging while a background update was in flight)."""
        resident, host = loop.engine.kv_bytes()
        s, c, shared = loop.stats, loop.contexts.stats, loop.contexts.shared
        pool = loop.engine.cache
        prefix = pool.prefix
        cached, pc = (prefix.pages, prefix.stats) if prefix is not None else (0, PrefixCacheStats())
        indexes = loop.engine.kv.indexes
        kept, ic = (indexes.nbytes, indexes.stats) if indexes is not None else (0, IndexCacheStats())
        spill = self.pages.stats if self.pages is not None else PrefixPageStats()
        gauges = (("icekv_kv_resident_bytes", resident), ("icekv_kv_host_bytes", host),
                  ("icekv_kv_pool_pages", pool.allocator.num_pages),
                  ("icekv_kv_pool_pages_in_use", pool.allocator.num_pages - pool.pages_available),
                  ("icekv_active_requests", s.active), ("icekv_queued_requests", s.queued),
                  ("icekv_index_bytes_promised", s.index_bytes_promised),
                  ("icekv_device_bytes_promised", s.device_bytes_promised),
                  ("icekv_contexts_in_memory", shared.count), ("icekv_context_bytes_in_memory", shared.nbytes),
                  ("icekv_prefix_cache_pages", cached), ("icekv_index_cache_bytes", kept))
        counters = (("icekv_pages_moved_total", s.pages_moved), ("icekv_selection_seconds_total", s.select_s),
                    ("icekv_requests_completed_total", s.completed), ("icekv_requests_failed_total", s.failed),
                    ("icekv_requests_cancelled_total", s.cancelled), ("icekv_generated_tokens_total", s.generated_tokens),
                    ("icekv_context_store_hits_total", c.hits), ("icekv_context_store_misses_total", c.misses),
                    ("icekv_context_store_joined_total", c.joined),
                    ("icekv_context_compression_seconds_total", c.compress_s),
                    ("icekv_context_bytes_saved_total", c.bytes_saved),
                    ("icekv_prefix_cache_hit_tokens_total", pc.hit_tokens),
                    ("icekv_prefix_cache_miss_tokens_total", pc.miss_tokens),
                    ("icekv_prefix_cache_evictions_total", pc.evictions),
                    ("icekv_prefix_cache_retained_evictions_total", pc.retained_evictions),
                    ("icekv_prefix_cache_reloaded_pages_total", pc.reloaded_pages),
                    ("icekv_prefix_cache_spilled_pages_total", spill.written),
                    ("icekv_prefix_cache_spill_refused_total", spill.refused),
                    ("icekv_prefix_cache_spill_failures_total", spill.failed),
                    ("icekv_index_cache_hits_total", ic.hits), ("icekv_index_cache_reused_tokens_total", ic.reused_tokens),
                    ("icekv_index_cache_evictions_total", ic.evictions))
        snapshot = (gauges, counters)
        if snapshot == self._last.get("snapshot"):
            return
        self._last["snapshot"] = snapshot
        for name, value in gauges:
            self.metrics[name].set(float(value))
        for name, value in counters:
            delta = value - self._last.get(name, 0)
            if delta:
                self.metrics[name].increment(float(delta))
                self._last[name] = value


class TritonModel:
    def __init__(self, pb):
        self.pb = pb

    def initialize(self, args: dict) -> None:
        use_huge_pages()  # before the stub process's first tensor
        model_config = json.loads(args["model_config"])
        if not self.pb.using_decoupled_model_transaction_policy(model_config):
            raise IcekvError("the icekv model must be decoupled (model_transaction_policy { decoupled: true })")
        self.cfg = serving_config(model_config.get("parameters", {}))
        t0 = time.perf_counter()
        self.metrics = Metrics(self.pb)
        self.loop = EngineLoop(lambda: Engine(self.cfg.engine), on_tick=self.metrics.update,
                               make_contexts=self._contexts)
        self.engine = self.loop.engine
        self.kv_events = self._kv_events()
        template = self.engine.chat_template.source if self.engine.chat_template else None
        self.tool_calls = ModelToolCalls(tool_format(self.cfg.tool_format, template), self.engine.tokenizer.token_id)
        self.engine.tokenizer.keep_in_text(self.tool_calls.format.markup)  # before any request decodes
        log.warning("icekv: loaded %s in %.1f s (policy %s)", self.engine.model_name, time.perf_counter() - t0,
                    self.cfg.engine.selection.policy)

    def execute(self, requests) -> None:
        for request in requests:
            sink = TritonSink(self.pb, request.get_response_sender())
            try:
                if self._is_health_check(request):  # answered here, without the engine's queue
                    self.loop.check_alive()
                    sink.healthy(self.tool_calls.format.name)
                    continue
                self.loop.check_accepting()  # cheap refusals before any parsing or tokenizing
                inputs = {}
                for name, *_ in INPUTS:
                    tensor = self.pb.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        inputs[name] = tensor.as_numpy()
                params = json.loads(request.parameters() or "{}")
                req = parse_request(inputs, params, self.cfg, self.engine.chat_prompt, self.tool_calls)
                sink.stream = req.stream
                self.loop.serve(req, sink)
            except Exception as e:
                message, kind = error_reply(e)
                if kind == "internal" and not isinstance(e, EngineStopped):  # our bug: the log has the rest
                    log.exception("request handling failed")
                sink.error(message, kind=kind)
        return None

    def _is_health_check(self, request) -> bool:
        tensor = self.pb.get_input_tensor_by_name(request, "health")
        return tensor is not None and bool(tensor.as_numpy().reshape(-1)[0])

    def _contexts(self, engine: Engine) -> ContextService:
        """The context service over this server's store (if any), bounded as admission bounds
        contexts; with ``prefix_cache_spill``, the store under the prefix cache too."""
        store = None
        if self.cfg.store:
            from icekv.store import ContextStore
            from icekv.store.prefix_pages import spill_prefixes

            store = ContextStore.open(self.cfg.store, engine.model_id, self.cfg.store_max_bytes)
            if self.cfg.prefix_cache_spill:
                self.metrics.pages = spill_prefixes(engine.cache, store.backend, engine.model_id, store.secret)
        return ContextService(engine, store, engine.kv.context_limit, self.cfg.compression.max_compress_tokens,
                              {"kv2": parse_settings("kv2", self.cfg.compression.kv2)})

    def _kv_events(self):
        """With ``kv_events_endpoint``: a publisher of the prefix cache's page events, listening to it."""
        if not self.cfg.kv_events_endpoint:
            return None
        from icekv.serving.kv_events import KVEventPublisher

        cache = self.engine.cache
        publisher = KVEventPublisher(self.cfg.kv_events_endpoint, self.cfg.kv_events_topic, cache.page_size,
                                     "GPU" if cache.pool.device.type == "cuda" else "CPU",
                                     replay_endpoint=self.cfg.kv_events_replay_endpoint,
                                     replay_batches=self.cfg.kv_events_replay_batches)
        cache.prefix.events = publisher  # the engine has served nothing yet
        log.warning("icekv: prefix cache page events on %s%s", publisher.endpoint,
                    f" (replayed on {publisher.replay_endpoint})" if publisher.replay_endpoint else "")
        return publisher

    def finalize(self) -> None:
        self.loop.stop()
        if self.kv_events is not None:
            self.kv_events.close()
        self.metrics.close()

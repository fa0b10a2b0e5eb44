"""vLLM's CPU worker, telling icekv's metadata builders which request each batch row holds and
which requests are gone (imports vLLM: named by ``--worker-cls icekv.vllm.worker.IceKVCPUWorker``).

vLLM hands an attention backend batch rows, never request ids, and no signal when a request ends.
The worker sees both: before each step it gives the builders the model runner (whose batch lists
each row's request id when the builders run) and releases the indexes of the requests that
finished or were aborted, preempted or resumed (a preempted request's blocks are freed; resumed,
it has new ones, and continues the index it released).
"""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from icekv.vllm.backend import IceKVBuilder


class IceKVCPUWorker(CPUWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.preemptions = 0  # requests vLLM preempted (their indexes released with their blocks)

    def execute_model(self, scheduler_output):
        preempted = set(scheduler_output.preempted_req_ids or ())
        self.preemptions += len(preempted)
        gone = set(scheduler_output.finished_req_ids) | preempted
        gone |= set(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        for builder in self._icekv_builders():
            builder.runner = self.model_runner
            builder.release(gone)
        return super().execute_model(scheduler_output)

    def icekv_stats(self) -> dict:
        """What icekv holds in this worker (``LLM.collective_rpc("icekv_stats")``): the live
        requests' indexes and the released ones kept, the indexes built or continued and the
        selecting decode steps run (finished requests' too), and the preemptions seen."""
        builders = self._icekv_builders()
        indexes = [i for b in builders for i in b.indexes.values()]
        caches = [b.index_cache for b in builders if b.index_cache is not None]
        return {"builders": len(builders), "indexes": len(indexes),
                "index_bytes": sum(i.selector.index_bytes() for i in indexes),
                "kept_indexes": sum(len(c) for c in caches), "kept_index_bytes": sum(c.nbytes for c in caches),
                "indexes_built": sum(b.indexes_built for b in builders),
                "indexes_continued": sum(b.indexes_continued for b in builders),
                "selecting_steps": sum(b.selecting_steps for b in builders), "preemptions": self.preemptions}

    def _icekv_builders(self) -> list[IceKVBuilder]:
        groups = getattr(self.model_runner, "attn_groups", [])
        return [b for group in groups for attn in group for b in attn.metadata_builders if isinstance(b, IceKVBuilder)]

"""vLLM's CPU worker, telling icekv's metadata builders which request each batch row holds and
which requests are gone (imports vLLM: named by ``--worker-cls icekv.vllm.worker.IceKVCPUWorker``).

vLLM hands an attention backend batch rows, never request ids, and no signal when a request ends.
The worker sees both: before each step it gives the builders the model runner (whose batch lists
each row's request id when the builders run) and drops the indexes of the requests that finished
or were aborted, preempted or resumed (a preempted request's blocks are freed; resumed, it has new
ones, so its index is built again).
"""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from icekv.vllm.backend import IceKVBuilder


class IceKVCPUWorker(CPUWorker):
    def execute_model(self, scheduler_output):
        gone = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
        gone |= set(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        for builder in self._icekv_builders():
            builder.runner = self.model_runner
            builder.forget(gone)
        return super().execute_model(scheduler_output)

    def icekv_stats(self) -> dict:
        """What icekv holds in this worker (``LLM.collective_rpc("icekv_stats")``): the live
        requests' indexes and the selecting decode steps they ran, all layers."""
        builders = self._icekv_builders()
        indexes = [i for b in builders for i in b.indexes.values()]
        return {"builders": len(builders), "indexes": len(indexes),
                "index_bytes": sum(i.selector.index_bytes() for i in indexes),
                "selecting_steps": sum(b.selecting_steps for b in builders)}

    def _icekv_builders(self) -> list[IceKVBuilder]:
        groups = getattr(self.model_runner, "attn_groups", [])
        return [b for group in groups for attn in group for b in attn.metadata_builders if isinstance(b, IceKVBuilder)]

"""Request execution: the scheduler, batched steps, sampling, streaming text and statistics."""

from icekv.engine.engine import Engine
from icekv.engine.results import Generation, KVStats, Prefilled
from icekv.engine.scheduler import BusyError
from icekv.engine.sequence import Cancelled, Sequence

__all__ = ["BusyError", "Cancelled", "Engine", "Generation", "KVStats", "Prefilled", "Sequence"]

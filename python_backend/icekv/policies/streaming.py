"""StreamingLLM at a fixed budget: the sink and the newest pages (no index)."""

from icekv.policies.base import Policy
from icekv.select.streaming import StreamingSelector

POLICY = Policy("streaming", selector=lambda cfg: StreamingSelector(cfg.page_size))

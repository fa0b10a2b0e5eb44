"""Full attention: every token of every layer, no index."""

from icekv.methods.base import Policy

POLICY = Policy("full", selector=None, compressed_context=True)

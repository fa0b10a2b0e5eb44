"""The OpenAI-compatible frontend: an ASGI app that forwards to the icekv Triton model over gRPC."""

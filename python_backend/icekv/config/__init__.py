"""icekv's settings, one module per concern, each a frozen dataclass with one source of each
default: paging, selection (the methods' own settings live in :mod:`icekv.methods`), the engine,
a request's sampling, the server; :mod:`.settings` declares every server setting once (flags,
Triton parameters, ConfigMap keys, the README table) and :mod:`.paths` addresses fields by path.

Import from the module that declares a name (``from icekv.config.engine import EngineConfig``):
this package imports nothing, so the paged cache can read its layout without the methods."""

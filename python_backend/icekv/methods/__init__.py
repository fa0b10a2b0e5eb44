"""Decode-time methods, one file each (kvpress style): a method's settings dataclass, its page
selector and its registry entry (:class:`icekv.methods.base.Policy`) together. The registry that
lists them, and resolves a request's method into its plan, is :mod:`icekv.policies`; what the
selectors share is in :mod:`.selector`, :mod:`.tokens` and :mod:`.gqa`."""

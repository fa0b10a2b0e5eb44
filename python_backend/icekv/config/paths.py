"""Frozen config trees addressed by dotted field paths (``"selection.icecache.search"``): how the
settings table says which field each setting sets."""

from __future__ import annotations

from dataclasses import fields


def build_config(cls, values: dict[str, object]):
    """A ``cls`` config with ``values`` (dotted field paths -> values) and every other field its
    default; each nested config is built, and so validated, once, with all of its values."""
    kwargs = {}
    for f in fields(cls):
        nested = {path.removeprefix(f.name + "."): v for path, v in values.items() if path.startswith(f.name + ".")}
        if nested:
            kwargs[f.name] = build_config(type(f.default_factory()), nested)  # a nested config's own class
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def field_value(config, path: str):
    """The value at a dotted field path of a config."""
    for name in path.split("."):
        config = getattr(config, name)
    return config

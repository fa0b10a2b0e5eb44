"""The registry of prefix compressors (one dataclass per file).

Every method maps a prefilled context to scores S [layer, KV head, token] with
``score_steps(ctx)`` over a :class:`icekv.compress.scoring.ScoringContext` (the prefilled context,
the model, the share of its KV to be kept): a generator that yields after each model pass
(so a server can interleave other requests' steps) and returns the scores;
:func:`icekv.compress.evict` turns them into a physically smaller cache. None of them sees the
future questions. A method's settings are its dataclass fields.
"""

from __future__ import annotations

import dataclasses

from icekv.compress.keydiff import KeyDiffCompressor
from icekv.compress.kv2 import KV2Compressor
from icekv.compress.kvzip import KVzipCompressor
from icekv.compress.snapkv import SnapKVCompressor
from icekv.compress.streaming import StreamingCompressor
from icekv.errors import ConfigError

COMPRESSORS = {
    "kv2": KV2Compressor,
    "kvzip": KVzipCompressor,
    "snapkv": SnapKVCompressor,
    "keydiff": KeyDiffCompressor,
    "streaming": StreamingCompressor,
}


def _compressor_class(method: str):
    if method not in COMPRESSORS:
        raise ConfigError(f"unknown compression method {method!r}; choose from {', '.join(COMPRESSORS)}")
    return COMPRESSORS[method]


def make_compressor(method: str, **settings):
    cls = _compressor_class(method)
    try:
        return cls(**settings)
    except TypeError as e:
        raise ConfigError(f"{method}: {e}") from None


def resolved_settings(method: str, settings: dict | None = None) -> dict:
    """Every setting of ``method`` as it will run (its defaults filled in): what a compressed
    context depends on, so what its store key records."""
    return dataclasses.asdict(make_compressor(method, **(settings or {})))


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse_value(method: str, name: str, text: str, hint: str):
    try:
        if "None" in hint and text.lower() == "none":
            return None
        if hint.startswith("bool"):
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError
            return text.lower() in _TRUE
        if hint.startswith("int"):
            return int(text)
        if hint.startswith("float"):
            return float(text)
        return text
    except ValueError:
        raise ConfigError(f"{method} setting {name}={text!r}: expected {hint}") from None


def parse_settings(method: str, text: str) -> dict:
    """``"rho_scale=4,normalize=true"`` -> {"rho_scale": 4.0, "normalize": True}, each value
    typed by the field of ``method``'s dataclass; unknown names and bad values are ConfigErrors."""
    hints = {f.name: str(f.type) for f in dataclasses.fields(_compressor_class(method))}
    settings = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ConfigError(f"{method} settings: {item!r} is not NAME=VALUE")
        if name not in hints:
            raise ConfigError(f"{method} has no setting {name!r}; it has {', '.join(hints) or 'none'}")
        settings[name] = _parse_value(method, name, value.strip(), hints[name])
    try:
        make_compressor(method, **settings)  # the dataclass checks the values
    except ConfigError as e:
        raise ConfigError(f"{method} settings: {e}") from None
    return settings

"""Argument helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from icekv.config.engine import KV_POOLS
from icekv.methods.icecache import IceCacheConfig
from icekv.errors import ConfigError, IcekvError
from icekv.registry import DEFAULT_MODEL, KNOWN_MODELS, is_gguf, not_a_model
from icekv.serving.openai.config import checked_timeout

TRITON_GRPC_PORT = 8001  # icekv serve's Triton gRPC and metrics ports, one replica (--router picks free ones)
TRITON_METRICS_PORT = 8002


def _positive_int(flag: str, least: int = 1):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {least}, got {value}")
        return value

    return parse


def _timeout(flag: str):
    """A timeout flag's parser: a number, held to the frontend's rule for timeouts."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got {text!r}") from None
        try:
            return checked_timeout(flag, value)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _csv(flag: str, text: str, cast):
    try:
        values = tuple(cast(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise IcekvError(f"{flag}: cannot read {text!r} as a comma-separated list") from None
    if not values:
        raise IcekvError(f"{flag} is empty")
    return values


def _device_flags(parser, random_weights: bool = False) -> None:
    """Where the engine computes and keeps its KV pool; with ``random_weights``, also a model shape."""
    parser.add_argument("--device", default=None, help="auto (a GPU when there is one) | cpu | cuda | cuda:N")
    parser.add_argument("--kv-pool", choices=KV_POOLS, default=None,
                        help="the KV page pool: host memory (pinned for a GPU) or the compute device "
                             "(auto: host under a sparse policy, device under full attention)")
    _setting_flag(parser, "dtype")
    _setting_flag(parser, "weights")
    _setting_flag(parser, "kv_dtype")
    _setting_flag(parser, "allow_extra_weights")
    if random_weights:
        parser.add_argument("--random-weights", default=None, metavar="SHAPE",
                            help="a model of this shape (llama-3.1-8b, llama-tiny: icekv.model.random) with "
                                 "random weights drawn on the device, instead of --model (benchmarks)")


def _bench_run_flags(parser) -> None:
    """What ``bench decode | batch`` share: the warm-up, and the admission and memory plan."""
    parser.add_argument("--warmup-steps", type=_positive_int("--warmup-steps", least=0), default=None,
                        help="untimed decode steps at the measured shape before the timed ones (default 2)")
    parser.add_argument("--plan", action="store_true",
                        help="print the admission and memory plan and exit (nothing is loaded); exit 1 when "
                             "a wave would not be admitted at once or the memory does not fit")
    parser.add_argument("--host-memory-gib", type=float, default=None,
                        help="host memory the plan checks against (default: this machine's)")
    parser.add_argument("--device-memory-gib", type=float, default=None,
                        help="compute-device memory the plan checks against (default: the GPU's)")


def _device_settings(args) -> dict:
    """The EngineConfig fields the device flags set (absent ones keep their defaults)."""
    names = ("device", "kv_pool", "dtype", "weights", "allow_extra_weights", "random_weights")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def _kv_dtype(args) -> str:
    """The ``--kv-dtype`` flag's value, ``auto`` where the command was given none."""
    return getattr(args, "kv_dtype", None) or "auto"


def _model_flag(parser, what: str = "") -> None:
    parser.add_argument("--model", help=f"a known model ({', '.join(KNOWN_MODELS)}: fetched on first use), a "
                        f"Hugging Face model folder{' ' + what if what else ''}, or a GGUF file (converted once into "
                        f"the cache) (default {DEFAULT_MODEL})")


def _serving_flags(parser) -> None:
    """One flag per server setting (:data:`icekv.config.settings.SETTINGS`); unset ones keep the server's defaults."""
    from icekv.config.settings import SETTINGS

    for setting in SETTINGS:
        _setting_flag(parser, setting.name)


def _setting_flag(parser, name: str, default=None) -> None:
    """The flag of server setting ``name``, with its parsing, choices and meaning; ``default``:
    this command's value when the flag is not given (None: the server's own)."""
    from icekv.config.settings import BY_NAME, choices

    setting = BY_NAME[name]
    shown = default if default is not None else setting.default_doc or setting.default()
    if setting.kind is bool:
        shown = str(shown).lower()
    parser.add_argument(setting.cli_flag, dest=setting.dest, default=default, choices=choices(setting) or None,
                        metavar="{true,false}" if setting.kind is bool else None,
                        type=_setting_type(setting), help=f"{setting.meaning} (default {shown})".replace("%", "%%"))


def _setting_type(setting):
    """The flag's argparse type: the setting's own parsing, its error shown as argparse's."""
    def parse(text: str):
        try:
            return setting.parse(text)
        except IcekvError as e:
            raise argparse.ArgumentTypeError(str(e).replace(setting.name, setting.cli_flag, 1)) from None

    return parse


def _kv2_flag(parser, what: str) -> None:
    parser.add_argument("--kv2", default=None, metavar="NAME=VALUE,...",
                        help=f"{what}: rho (share re-fed), rho_scale (re-fed share as a multiple of the budget), "
                             "rounds, normalize, attend (chunk|context), proxy (keydiff|snapkv), chunk, n_sinks")


def _icecache_flags(parser) -> None:
    """The server's IceCache settings as flags of ``generate``, ``eval`` and ``bench decode | batch``,
    with the engine's defaults."""
    for setting, field in _icecache_settings():
        _setting_flag(parser, setting.name, getattr(IceCacheConfig, field))


def _icecache_config(args):
    return IceCacheConfig(**{field: getattr(args, setting.dest) for setting, field in _icecache_settings()})


def _icecache_settings() -> list:
    """(setting, IceCacheConfig field) of every server setting that sets one."""
    from icekv.config.settings import SETTINGS

    prefix = "engine.selection.icecache."
    return [(s, s.fields[0].removeprefix(prefix)) for s in SETTINGS if s.fields[0].startswith(prefix)]


def _serving_parameters(args, served_here: bool = False) -> dict[str, str]:
    """CLI flags -> config.pbtxt parameters, validated here so a typo fails before the server starts
    (``served_here``: also that this machine has the device they name)."""
    from icekv.config.settings import SETTINGS, serving_config

    params = {s.name: getattr(args, s.dest) for s in SETTINGS if getattr(args, s.dest, None) is not None}
    if "model_dir" in params:
        params["model_dir"] = _model_location(params["model_dir"], served_here)
    params = {k: str(v) for k, v in params.items()}
    config = serving_config(params)
    if served_here and config.engine.device.startswith("cuda"):  # a clear error now, not a model load failure
        from icekv.devices import resolve_device

        resolve_device(config.engine.device)
    return params


def _model_location(model: str, served_here: bool) -> str:
    """A known model's name as is (the server resolves it), a folder or a GGUF file as an absolute path (which
    must exist where it is ``served_here``)."""
    if model in KNOWN_MODELS:
        return model
    if served_here and not (Path(model).is_dir() or is_gguf(model)):
        raise not_a_model(model)
    return str(Path(model).resolve())


def _open_store(location: str | None, engine):
    from icekv.config.engine import default_cache_dir
    from icekv.store import ContextStore

    return ContextStore.open(location or str(default_cache_dir() / "contexts"), engine.model_id)


def _meta(engine) -> dict:
    """What a benchmark is measured with: command, model, machine."""
    import platform

    import torch

    from icekv.devices import huge_pages_setting

    return {"command": "icekv " + " ".join(sys.argv[1:]), "model": engine.model_name,
            "device": str(engine.device), "kv_pool": str(engine.cache.pool.device),
            "dtype": str(engine.cache.dtype), "weights": engine.weights, "kv_dtype": engine.cache.kv_format.name,
            "gpu": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
                       f"{huge_pages_setting()}"}


def _timed(engine, run) -> tuple[list[dict], dict]:
    """A benchmark's records and its :func:`_meta`, with its wall time; ``run`` gets the meta."""
    import time

    t0 = time.perf_counter()
    meta = _meta(engine)
    records = run(meta)
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    return records, meta

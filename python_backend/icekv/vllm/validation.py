"""A request's icekv settings (``vllm_xargs``: ``policy``, ``budget``) checked when vLLM admits it,
so a bad one is answered with vLLM's own 400 instead of failing inside a step (imports vLLM:
registered as a ``vllm.logits_processors`` plugin, the hook vLLM gives for checking a request's
extra arguments; it leaves the logits as they are)."""

from __future__ import annotations

from vllm.v1.sample.logits_processor import LogitsProcessor

from icekv.config.selection import REQUEST_SETTINGS, SelectionConfig
from icekv.errors import ConfigError
from icekv.vllm import settings


class IceKVSettings(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params) -> None:
        extra = sampling_params.extra_args or {}
        if not any(k in extra for k in REQUEST_SETTINGS):
            return
        try:  # only policy and budget are the request's, and the server's other settings cannot refuse them
            settings.plan(settings.request_selection(SelectionConfig(), extra))
        except ConfigError as e:
            raise ValueError(f"icekv: {e}") from None

    def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits):
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass

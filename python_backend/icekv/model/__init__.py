"""Llama-family decoder, weight loading and tokenizer."""

from icekv.model.args import ModelArgs
from icekv.model.llama import AttentionBackend, Decoder
from icekv.model.loader import load_model
from icekv.model.tokenizer import Tokenizer

__all__ = ["AttentionBackend", "Decoder", "ModelArgs", "Tokenizer", "load_model"]

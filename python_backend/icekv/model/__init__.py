"""Llama-family decoder, weight loading and tokenizer."""

from icekv.model.args import ModelArgs
from icekv.model.llama import AttentionBackend, Decoder
from icekv.model.loader import load_model
from icekv.model.random import random_model, shape_args
from icekv.model.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["AttentionBackend", "ByteTokenizer", "Decoder", "ModelArgs", "Tokenizer", "load_model", "random_model",
           "shape_args"]

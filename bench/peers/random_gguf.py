"""A GGUF of a Llama-shaped model with random Q8_0 weights, for timing llama.cpp on a shape whose
weights are not at hand (``run.py --shape``). Run in .venv-llamacpp (numpy and gguf only).

The shape comes from a Hugging Face ``config.json`` (the one vLLM loads with dummy weights, so both
peers run the same shape). Linear weights and the embedding are Q8_0 blocks whose codes are uniform
and whose scale gives each linear layer a std of ``1/sqrt(fan_in)`` (the embedding 1), norms are 1.
The vocabulary is SentencePiece-shaped (unknown, begin, end, the 256 byte tokens, then placeholder
pieces) so that llama.cpp loads it; prompts are token ids, never text. RoPE runs unscaled (speed
does not depend on the frequencies). Tensors are written one at a time: the writer holds one.

    .venv-llamacpp/bin/python bench/peers/random_gguf.py CONFIG_JSON OUT_GGUF
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np

Q8_0_BLOCK = 32  # values per block: an fp16 scale, then 32 int8 codes
UNIFORM_STD = 127 / 3 ** 0.5  # std of codes uniform over -127..127


def tensors(config: dict) -> list[tuple[str, tuple[int, ...], bool]]:
    """(GGUF name, torch-order shape, quantized) of each tensor, in the file's order."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, inter, vocab = config["head_dim"], config["intermediate_size"], config["vocab_size"]
    out = [("token_embd.weight", (vocab, hidden), True)]
    for i in range(config["num_hidden_layers"]):
        out += [(f"blk.{i}.attn_norm.weight", (hidden,), False),
                (f"blk.{i}.attn_q.weight", (heads * head_dim, hidden), True),
                (f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden), True),
                (f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden), True),
                (f"blk.{i}.attn_output.weight", (hidden, heads * head_dim), True),
                (f"blk.{i}.ffn_norm.weight", (hidden,), False),
                (f"blk.{i}.ffn_gate.weight", (inter, hidden), True),
                (f"blk.{i}.ffn_up.weight", (inter, hidden), True),
                (f"blk.{i}.ffn_down.weight", (hidden, inter), True)]
    return out + [("output_norm.weight", (hidden,), False), ("output.weight", (vocab, hidden), True)]


def q8_0_bytes(shape: tuple[int, int], std: float, rng: np.random.Generator) -> np.ndarray:
    """Random Q8_0 blocks of a [rows, columns] weight of standard deviation ``std``, as the bytes
    [rows, columns / 32 * 34] that GGUF stores."""
    rows, columns = shape
    blocks = np.empty((rows, columns // Q8_0_BLOCK, 2 + Q8_0_BLOCK), dtype=np.uint8)
    blocks[..., :2] = np.full(1, std / UNIFORM_STD, dtype=np.float16).view(np.uint8)
    blocks[..., 2:] = rng.integers(-127, 128, size=(rows, columns // Q8_0_BLOCK, Q8_0_BLOCK),
                                   dtype=np.int8).view(np.uint8)
    return blocks.reshape(rows, -1)


def vocabulary(size: int) -> tuple[list[str], list[int]]:
    """SentencePiece-shaped pieces and their types: <unk>, <s>, </s>, the byte tokens, placeholders."""
    types = gguf.TokenType
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    kinds = [types.UNKNOWN, types.CONTROL, types.CONTROL] + [types.BYTE] * 256
    pieces += [f"\u2581t{i}" for i in range(size - len(pieces))]
    return pieces, [int(k) for k in kinds] + [int(types.NORMAL)] * (size - len(kinds))


def write(config: dict, path: Path, seed: int = 0) -> None:
    """The GGUF of ``config``'s shape at ``path``: metadata, then each tensor drawn from ``seed``."""
    writer = gguf.GGUFWriter(str(path), "llama")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    writer.add_name("random " + config.get("_name_or_path", "llama"))
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    pieces, kinds = vocabulary(config["vocab_size"])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_types(kinds)
    writer.add_token_scores([0.0] * len(pieces))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    layout = tensors(config)
    for name, shape, quantized in layout:
        if quantized:
            nbytes = shape[0] * shape[1] // Q8_0_BLOCK * (2 + Q8_0_BLOCK)
            writer.add_tensor_info(name, (shape[0], nbytes // shape[0]), np.dtype(np.uint8), nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, quantized in layout:
        if not quantized:
            writer.write_tensor_data(np.ones(shape, dtype=np.float32))
            continue
        std = 1.0 if name == "token_embd.weight" else shape[1] ** -0.5
        writer.write_tensor_data(q8_0_bytes(shape, std, rng))
    writer.close()


def main() -> int:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.rsplit("\n\n", 1)[-1])
    write(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

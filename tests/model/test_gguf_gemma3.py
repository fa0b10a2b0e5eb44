"""A Gemma 3 GGUF as llama.cpp writes one (its tensor names, Gemma's norms stored as 1 + w, the
global layers' linear RoPE scaling in the metadata, no query scale) converts into a folder that
runs as the Hugging Face model it was written from."""

import numpy as np
import pytest
import torch

from icekv.convert import gemma3_config
from icekv.engine.model_dir import resolve_model_dir
from icekv.errors import ModelLoadError
from icekv.model import ModelArgs, load_model
from tests.model.test_parity_tiny import _Dense, _paged_greedy

LETTERS = "abcdefghijklmnopqrstuvwxyz"
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
TOKENS = SPECIAL + ["\u2581"] + list(LETTERS) + ["\u2581" + c for c in LETTERS]  # a sentencepiece vocabulary
MODULES = {  # transformers' Gemma 3 module -> llama.cpp's tensor name
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def tiny_gemma3(layers: int = 6):
    """A random-weight Gemma3ForCausalLM whose layout a GGUF can state: every sixth layer global,
    the query scale its head size, tied embeddings, linear RoPE scaling x4 on the global layers."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=len(TOKENS), hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, sliding_window=24,
        query_pre_attn_scalar=32, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # norms away from their initial values, so a norm read wrong shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def write_gemma3_gguf(path, model, scaling: str = "linear", factor: bool = True):
    """``model`` as a GGUF file of llama.cpp's ``gemma3`` architecture, its weights in F32 (``factor``
    False: the scaling's factor left out)."""
    from gguf import GGUFWriter

    cfg = model.config
    writer = GGUFWriter(str(path), "gemma3")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_string("gemma3.rope.scaling.type", scaling)
    if factor:
        writer.add_rope_scaling_factor(cfg.rope_parameters["full_attention"]["factor"])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(TOKENS)
    writer.add_token_scores([0.0] * len(TOKENS))
    writer.add_token_types([3] * len(SPECIAL) + [1] * (len(TOKENS) - len(SPECIAL)))  # 3: control, 1: normal
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    for name, weight in model.state_dict().items():
        if name == "lm_head.weight":  # tied: the file holds the embedding only
            continue
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:  # model.layers.N.<module>.weight
            parts = name.split(".")
            gguf_name = f"blk.{parts[2]}.{MODULES['.'.join(parts[3:-1])]}.weight"
        values = weight.float().numpy() + (1.0 if "norm" in name else 0.0)  # llama.cpp stores Gemma's norms as 1 + w
        writer.add_tensor(gguf_name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The tiny model, and the folder its GGUF converts into (through the model cache, as --model PATH does)."""
    work = tmp_path_factory.mktemp("gemma3_gguf")
    model = tiny_gemma3()
    gguf = write_gemma3_gguf(work / "tiny-gemma3.Q8.gguf", model)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ICEKV_CACHE", str(work / "cache"))
        return model, resolve_model_dir(str(gguf))


def test_the_folder_states_what_llama_cpp_reads_from_the_file(converted):
    _, folder = converted
    args = ModelArgs.from_dir(folder)
    assert args.local_layers == (0, 1, 2, 3, 4) and args.sliding_window == 24
    assert args.rope_scaling == {"rope_type": "linear", "factor": 4.0} and args.rope_theta == 1e6
    assert args.local_rope_theta == 1e4
    assert args.query_pre_attn_scalar == 32  # the head size (transformers' reader leaves its default, 256)


def test_the_converted_gguf_runs_as_the_model_it_was_written_from(converted):
    hf, folder = converted
    model = load_model(folder)
    ids = torch.randint(0, len(TOKENS), (1, 80), generator=torch.Generator().manual_seed(1))  # past the 24-token window
    with torch.no_grad():
        reference = hf(ids).logits[0]  # [T, V]
    torch.testing.assert_close(model(ids[0], torch.arange(80), _Dense(model.args)), reference, rtol=1e-4, atol=1e-4)
    expected = ids[0].tolist()
    for _ in range(20):  # each token from transformers' forward over the whole sequence (its generate()
        with torch.no_grad():  # parts from that forward on this model at the 14th token)
            expected.append(int(hf(torch.tensor([expected])).logits[0, -1].argmax()))
    assert _paged_greedy(model, ids[0].tolist(), 20, page_size=4) == expected[80:]


class _Metadata:
    """A GGUF reader's metadata lookups over a dict."""

    def __init__(self, values: dict):
        self.values = values

    def get_field(self, key):
        value = self.values.get(key)
        return None if value is None else type("Field", (), {"contents": lambda self: value})()


def test_only_the_27b_scales_queries_by_hidden_size_over_heads():
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    shape = dict(hidden_size=5376, num_attention_heads=32, head_dim=128, rope_parameters=rope)
    reader = _Metadata({"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0})
    big = gemma3_config({**shape, "num_hidden_layers": 62}, reader)
    assert big["query_pre_attn_scalar"] == 168  # 5376 / 32, as the 27B's own config.json says
    assert big["rope_parameters"]["full_attention"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    assert big["rope_parameters"]["sliding_attention"] == rope["sliding_attention"]
    assert rope["full_attention"]["rope_type"] == "default"  # the given config is left as it was
    assert gemma3_config({**shape, "num_hidden_layers": 48}, reader)["query_pre_attn_scalar"] == 128
    plain = gemma3_config({**shape, "num_hidden_layers": 26}, _Metadata({}))  # the 1B: no scaling
    assert plain["rope_parameters"] == rope


@pytest.mark.parametrize("scaling, factor, refusal", [
    ("yarn", True, "a Gemma 3 GGUF with RoPE scaling 'yarn'"),
    ("linear", False, "linear RoPE scaling and no gemma3.rope.scaling.factor")])
def test_a_rope_scaling_icekv_cannot_read_is_refused_before_converting(scaling, factor, refusal, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setenv("ICEKV_CACHE", str(tmp_path / "cache"))
    gguf = write_gemma3_gguf(tmp_path / "m.gguf", tiny_gemma3(layers=1), scaling, factor)
    with pytest.raises(ModelLoadError, match=refusal):
        resolve_model_dir(str(gguf))
    assert not (tmp_path / "cache" / "models").exists()

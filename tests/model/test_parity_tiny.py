"""Our decoder vs Hugging Face transformers on tiny random-weight models of every architecture."""

import pytest
import torch

from icekv.config.paging import PagingConfig
from icekv.model import ModelArgs, load_model
from tests.conftest import TINY_CONFIGS, make_tiny_hf_model


class _Dense:
    """Test backend: plain causal attention over the whole prompt (within a local layer's window),
    no cache."""

    def __init__(self, args):
        self.args = args

    def attend(self, layer, q, k, v):
        from icekv.attention import causal_attention

        return causal_attention(q, k.transpose(0, 1), v.transpose(0, 1), torch.arange(q.shape[0]),
                                self.args.window(layer))


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_logits_and_greedy_match_transformers(arch, tmp_path):
    hf = make_tiny_hf_model(arch, tmp_path)
    model = load_model(tmp_path)
    ids = torch.randint(0, 512, (1, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [T, V]
    ours = model(ids[0], torch.arange(100), _Dense(model.args))  # [T, V]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)

    with torch.no_grad():
        ref_new = hf.generate(ids, max_new_tokens=20, do_sample=False, min_new_tokens=20)[0, 100:]
    run = _paged_greedy(model, ids[0].tolist(), 20, page_size=4)
    assert run == ref_new.tolist()


def _paged_greedy(model, ids, n, page_size):
    """Greedy decode through the real paged cache, prefilling in uneven chunks."""
    from icekv.engine.backends import DenseAttention, RequestPages
    from icekv.kv import PagedKVCache

    a = model.args
    cache = PagedKVCache(a.num_layers, a.num_kv_heads, a.head_dim, PagingConfig(page_size, 256),
                         layer_windows=a.layer_windows)
    cache.add(0)
    backend = DenseAttention(RequestPages(cache, 0))
    for chunk in (ids[:37], ids[37:]):
        logits = model(torch.tensor(chunk), backend.begin_step(len(chunk)), backend)
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = model(torch.tensor(out[-1:]), backend.begin_step(1), backend)
    return out


def test_args_read_architecture_features(tmp_path):
    make_tiny_hf_model("qwen3", tmp_path / "q3")
    make_tiny_hf_model("qwen2", tmp_path / "q2")
    make_tiny_hf_model("llama", tmp_path / "l")
    q3, q2, l = (ModelArgs.from_dir(tmp_path / n) for n in ("q3", "q2", "l"))
    assert q3.qk_norm and not q3.qkv_bias and q3.head_dim == 32
    assert q2.qkv_bias and not q2.qk_norm
    assert l.rope_scaling is not None and l.rope_theta == 500000.0

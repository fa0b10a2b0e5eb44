"""bench/small_batch_linear.py times both linear forms per row count over a model's weight shapes."""

import importlib.util
from pathlib import Path

from icekv.model.args import ModelArgs

BENCH = Path(__file__).resolve().parents[2] / "bench"
spec = importlib.util.spec_from_file_location("small_batch_linear", BENCH / "small_batch_linear.py")
small_batch_linear = importlib.util.module_from_spec(spec)
spec.loader.exec_module(small_batch_linear)


def test_shapes_cover_every_matrix_of_a_step():
    args = ModelArgs.from_hf_config({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 50, "hidden_size": 16,
                                     "intermediate_size": 40, "num_hidden_layers": 3, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "max_position_embeddings": 64})
    shapes = small_batch_linear.weight_shapes(args)
    assert len(shapes) == 3 * 7 + 1 and shapes[-1] == (50, 16)
    assert shapes[:7] == [(16, 16), (8, 16), (8, 16), (16, 16), (40, 16), (40, 16), (16, 40)]


def test_both_forms_timed_per_row_count_and_reported():
    seconds = small_batch_linear.time_forms([(24, 8), (8, 24)], rows=[1, 3], repeats=2)
    assert set(seconds) == {(n, f) for n in (1, 3) for f in small_batch_linear.FORMS}
    assert all(len(t) == 2 and min(t) > 0 for t in seconds.values())
    text = small_batch_linear.report(seconds, "tiny", 4 * 2 * 24 * 8, "cmd")
    assert "| 1 |" in text and "| 3 |" in text and "cmd" in text

from icekv.engine.text_stream import TextStream


class _ByteTokenizer:
    """Each token is one UTF-8 byte, so multi-byte characters span tokens."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_multibyte_characters_are_held_until_complete():
    stream = TextStream(_ByteTokenizer())
    out = [stream.push(b) for b in "aé€".encode()]
    assert "".join(out) == "aé€"
    assert all("\ufffd" not in o for o in out)


def test_stop_string_is_cut_and_never_emitted():
    stream = TextStream(_ByteTokenizer(), stop=("END",))
    out = "".join(stream.push(b) for b in b"hello EN")
    out += stream.push(ord("D"))
    assert stream.stopped and out == "hello "
    assert stream.flush() == ""


def _reference(tokenizer, ids, stop):
    """The plain definition: decode everything so far at each token and cut at the first stop string;
    once generation ends, everything. (text emitted, stopped)."""
    for n in range(1, len(ids) + 1):
        full = tokenizer.decode(ids[:n])
        cuts = [full.find(s) for s in stop if s and s in full]
        if cuts:
            return full[:min(cuts)], True
    return tokenizer.decode(ids), False


def _run(tokenizer, ids, stop):
    stream = TextStream(tokenizer, stop)
    out = []
    for token in ids:
        out.append(stream.push(token))
        assert "".join(out) == stream.text  # text is what was emitted
        if stream.stopped:
            break
    out.append(stream.flush())
    return "".join(out), stream.stopped


def test_matches_the_full_decode_reference_on_bytes():
    import random

    rng = random.Random(0)
    alphabet = ["a", "b", " ", "é", "€", "😀", "\n"]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stop = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 3)))
        ids = list(text.encode())
        assert _run(_ByteTokenizer(), ids, stop) == _reference(_ByteTokenizer(), ids, stop), (text, stop)


def test_matches_the_full_decode_reference_on_the_real_tokenizer(smollm2_dir):
    from icekv.model import Tokenizer

    tokenizer = Tokenizer(smollm2_dir)
    text = "The café’s menu: 3 crêpes, 2 teas — 😀 total €7.50.\nNext line; the end. " * 3
    ids = tokenizer.encode(text)
    for stop in [(), ("\n",), ("end.",), ("crêpes", "teas"), ("€7",), ("zzz", " the"), ("😀",)]:
        assert _run(tokenizer, ids, stop) == _reference(tokenizer, ids, stop), stop
    assert _run(tokenizer, ids, ())[0] == tokenizer.decode(ids)


def test_work_per_token_does_not_grow_with_the_text():
    """Each push decodes only the newest tokens: the tokenizer sees a bounded number of ids."""

    class Counting(_ByteTokenizer):
        longest = 0

        def decode(self, ids):
            Counting.longest = max(Counting.longest, len(ids))
            return super().decode(ids)

    stream = TextStream(Counting(), stop=("STOP",))
    for b in ("word é " * 500).encode():
        stream.push(b)
    assert Counting.longest <= 4 and stream.text == "word é " * 500

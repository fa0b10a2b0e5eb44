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

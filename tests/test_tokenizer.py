"""Tokenizer wrapper: round trip, chat template (sandboxed, raise_exception), streaming
detokenization that never prints half a UTF-8 character, and stop strings."""
import pytest

from freetoken.errors import ModelError
from freetoken.tokenizer import TextStream, Tokenizer

TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('no bad role') }}"
            "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers
    t = HFTokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>",
                                  "<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    t.train_from_iterator(["hello world, the expert cache is warm. STOP here."] * 20, trainer=trainer)
    return Tokenizer(t.to_str(), TEMPLATE, bos_token_id=0, eos_token_ids=(2,))


def stream_all(tok, ids, stop=()):
    s = TextStream(tok, stop)
    pieces = []
    for i in ids:
        pieces.append(s.push(i))
        if s.stopped:
            break
    pieces.append(s.finish())
    return pieces, s


def test_round_trip_and_specials(tok):
    text = "hello world, héllo 🙂"
    assert tok.decode(tok.encode(text)) == text
    assert tok.token(0) == "<|endoftext|>" and tok.token(None) == ""


def test_chat_template(tok):
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat("hi")
    assert tok.decode(ids, skip_special_tokens=False) == out
    with pytest.raises(ModelError, match="no bad role"):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])


def test_template_is_sandboxed(tok):
    evil = Tokenizer(tok._tok.to_str(), "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(Exception) as e:
        evil.apply_chat_template([{"role": "user", "content": "x"}])
    assert "unsafe" in str(e.value).lower() or "SecurityError" in type(e.value).__name__


def test_no_template_and_no_tokenizer_errors(tok):
    with pytest.raises(ModelError, match="--raw"):
        Tokenizer(tok._tok.to_str()).apply_chat_template([])
    with pytest.raises(ModelError, match="no tokenizer"):
        Tokenizer(None)


def test_stream_never_splits_a_character(tok):
    text = "héllo 🙂 world ✓✓"
    ids = tok.encode(text)
    pieces, _ = stream_all(tok, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert len(ids) > len([p for p in pieces if p])  # multi-byte chars were held back


def test_stop_string_truncates_and_stops(tok):
    ids = tok.encode("hello world STOP here")
    pieces, s = stream_all(tok, ids, stop=("STOP",))
    assert s.stopped and "".join(pieces) == "hello world " == s.text


def test_stop_prefix_released_at_end(tok):
    ids = tok.encode("hello ST")
    pieces, s = stream_all(tok, ids, stop=("STOP",))
    assert not s.stopped and "".join(pieces) == "hello ST"
    assert "ST" not in "".join(pieces[:-1])  # held back until finish()


def test_stop_across_token_boundaries(tok):
    text = "the expert cache is warm"
    for stop in ("cache", "t c", "e i", "warm", "t"):
        ids = tok.encode(text)
        pieces, s = stream_all(tok, ids, stop=(stop, "zzz"))
        assert s.stopped and "".join(pieces) == text[:text.index(stop)], stop

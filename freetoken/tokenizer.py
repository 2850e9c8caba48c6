"""Text <-> token ids for one model: the `tokenizers` tokenizer and jinja2 chat template stored in
the FTW file, and TextStream (incremental detokenization with stop strings) for streaming.

Knows nothing of the model or sampling.
"""
import json
from datetime import datetime
from typing import Optional, Sequence

from .errors import ModelError

REPLACEMENT = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence


class Tokenizer:
    """One model's tokenizer. encode/decode are thread-safe; nothing mutates after __init__."""

    def __init__(self, tokenizer_json: Optional[str], chat_template: Optional[str] = None,
                 bos_token_id: Optional[int] = None, eos_token_ids: Sequence[int] = ()):
        if not tokenizer_json:
            raise ModelError("the model file has no tokenizer; re-convert it from a checkpoint "
                             "folder that has tokenizer.json")
        from tokenizers import Tokenizer as HFTokenizer
        try:
            self._tok = HFTokenizer.from_str(tokenizer_json)
        except Exception as e:  # the tokenizers library raises a bare Exception subclass
            raise ModelError(f"the model's tokenizer cannot be read ({e}); re-convert the "
                             "model") from None
        self.chat_template = chat_template or None
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer.json text it was made from (for libraries that read it themselves)."""
        return self._tok.to_str()

    def token(self, token_id: Optional[int]) -> str:
        """The token's string form ('' for None or an unknown id)."""
        if token_id is None:
            return ""
        return self._tok.id_to_token(token_id) or ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True,
                            **extra) -> str:
        """Render `messages` ([{'role': ..., 'content': ...}]) with the model's template."""
        if self.chat_template is None:
            raise ModelError("this model has no chat template; pass the prompt as raw text "
                             "(`--raw`, or chat=False)")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        variables = dict(messages=messages, add_generation_prompt=add_generation_prompt,
                         bos_token=self.token(self.bos_token_id), eos_token=self.token(eos))
        variables.update(extra)
        try:
            return self._template.render(**variables)
        except TemplateError as e:
            raise ModelError(f"the model's chat template failed: {e}; use `--raw` to send the "
                             "prompt as is") from None

    def encode_chat(self, prompt: str, system: Optional[str] = None) -> list:
        """Token ids of a one-turn chat: the template adds any BOS itself, so no special tokens."""
        messages = ([{"role": "system", "content": system}] if system else [])
        messages.append({"role": "user", "content": prompt})
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


class TemplateError(Exception):
    """Raised by a chat template through raise_exception(...) or by jinja2 while rendering."""


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _compile_template(source: str):
    """A sandboxed jinja2 template with the helpers HF chat templates expect."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ModelError(f"the model's chat template is not valid jinja2 ({e}); use `--raw`") from None


class TextStream:
    """Turns a stream of token ids into text pieces that are safe to print.

    push(id) returns the new text (maybe ''), holding back (a) a trailing incomplete UTF-8
    character and (b) a tail that could still grow into a stop string. Once a stop string
    appears, `stopped` is True and the text before it is all that was (and will be) returned.
    finish() returns whatever is held back when generation ends without a stop.

    Worked example, stop=("</s>",): pieces "Hi", " <", "/s", ">" -> push returns "Hi", " ",
    "", "" and stopped becomes True after ">"; the caller printed "Hi ".
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self._tok = tokenizer
        self._stop = tuple(stop)
        self._ids = []
        self._prefix = 0  # ids[_prefix:_read] is context for decoding the next piece
        self._read = 0
        self._text = ""  # all text decoded so far (complete characters only)
        self._emitted = 0  # len of _text already returned
        self.stopped = False

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix:self._read])
        after = self._tok.decode(self._ids[self._prefix:])
        if after.endswith(REPLACEMENT) or len(after) < len(before):
            return ""  # mid-character: wait for the next byte(s)
        self._text += after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        return self._release(final=False)

    def finish(self) -> str:
        """Text held back at the end (a stop-string prefix that never completed, or a broken tail)."""
        if self.stopped:
            return ""
        tail = self._tok.decode(self._ids[self._prefix:])
        before = self._tok.decode(self._ids[self._prefix:self._read])
        if len(tail) > len(before):
            self._text += tail[len(before):]
            self._prefix = self._read = len(self._ids)
        return self._release(final=True)

    @property
    def text(self) -> str:
        """All text returned so far."""
        return self._text[:self._emitted]

    def _release(self, final: bool) -> str:
        cut = self._find_stop()
        if cut is not None:
            self.stopped = True
            piece = self._text[self._emitted:cut]
            self._emitted = cut
            return piece
        safe = len(self._text) if final else len(self._text) - self._held_tail()
        piece = self._text[self._emitted:max(safe, self._emitted)]
        self._emitted = max(safe, self._emitted)
        return piece

    def _find_stop(self) -> Optional[int]:
        """Index of the earliest stop string in the not-yet-emitted text, or None."""
        if not self._stop:
            return None
        # NOTE: a stop string cannot start inside emitted text: _held_tail kept any such start back.
        hits = [i for i in (self._text.find(s, self._emitted) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _held_tail(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:n]):
                    best = n
                    break
        return best

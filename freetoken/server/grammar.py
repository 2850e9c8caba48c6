"""Constrained decoding through llguidance (chosen over xgrammar: it reads the model's
tokenizer.json itself and needs no transformers; docs/MEASUREMENTS.md#grammar-masks).

Grammars compiles a request's response_format (a JSON schema, or any JSON object) or its forced
tool_choice (tool calls in Qwen's format) once per request; each job gets its own Constraint,
which the engine calls every step: mask(logits) puts -inf on every token the grammar forbids
next, advance(token_id) moves the grammar on. Knows nothing of HTTP; what the library refuses
is a GrammarError (the routes' 400)."""
import json
import threading

import torch

from .parsers import CALL_CLOSE, CALL_OPEN

NEG_INF = float("-inf")
BITS = torch.arange(32, dtype=torch.int32)
# compact JSON unless the schema asks otherwise: with free whitespace between tokens a weak or
# unsure model can write newlines until its budget ends
COMPACT = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The schema cannot be compiled; the message says why."""


class Grammars:
    """One model's grammar compiler: tokenizer (freetoken Tokenizer) and the logits' width. The
    library's tokenizer is built on first use (once, under a lock)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lib_tokenizer, self._lock = None, threading.Lock()

    def _library_tokenizer(self):
        import llguidance
        with self._lock:
            if self._lib_tokenizer is None:
                self._lib_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.to_json(), n_vocab=self.vocab_size,
                    eos_token=list(self.tokenizer.eos_token_ids))
            return self._lib_tokenizer

    def json_schema(self, schema: dict) -> str:
        """The compiled grammar of JSON text valid against schema (compact unless the schema has
        its own "x-guidance" options); GrammarError when the library refuses the schema. Blocks
        for milliseconds: call off the event loop."""
        import llguidance
        return self._compiled(llguidance.LLMatcher.grammar_from_json_schema,
                              json.dumps({"x-guidance": COMPACT, **schema}),
                              "the JSON schema cannot be compiled")

    def tool_calls(self, tools: list, parallel: bool) -> str:
        """The compiled grammar of tool calls in Qwen's format (CALL_OPEN, JSON {"name",
        "arguments"}, CALL_CLOSE): one, or several on their own lines when parallel; tools:
        [(name, parameters schema or None)], any one of them per call. GrammarError as above."""
        import llguidance
        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "arguments"],
                  "properties": {"name": {"const": name},
                                 "arguments": parameters or {"type": "object"}}}
                 for name, parameters in tools]
        schema = {"x-guidance": COMPACT, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}
        lark = "\n".join([
            'start: call ("\\n" call)*' if parallel else "start: call",
            f"call: {json.dumps(CALL_OPEN + chr(10))} body {json.dumps(chr(10) + CALL_CLOSE)}",
            f"body: %json {json.dumps(schema)}"])
        return self._compiled(llguidance.LLMatcher.grammar_from_lark, lark,
                              "the tools' parameters cannot be compiled")

    def _compiled(self, build, source: str, what: str) -> str:
        """build(source), validated against this tokenizer; GrammarError(what: why) if refused."""
        import llguidance
        try:
            grammar = build(source)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"{what}: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self._library_tokenizer())
        if error:
            raise GrammarError(f"{what}: {error}")
        return grammar

    def constraint(self, grammar: str) -> "Constraint":
        """A fresh Constraint of a compiled grammar (one per job: it holds the job's state)."""
        import llguidance
        return Constraint(llguidance.LLMatcher(self._library_tokenizer(), grammar),
                          self.vocab_size, tuple(self.tokenizer.eos_token_ids))


class Constraint:
    """The engine's constraint of one generation (Engine.generate's `constraint`)."""

    def __init__(self, matcher, vocab_size: int, eos_ids: tuple):
        self.matcher, self.vocab_size, self.eos_ids = matcher, vocab_size, eos_ids

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size] on the host: the tokens the grammar takes next (EOS alone once the
        grammar is done or has failed, so that the generation ends)."""
        if self.matcher.is_error() or self.matcher.is_stopped():
            allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
            allowed[list(self.eos_ids)] = True
            return allowed
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        return ((words.view(-1, 1) >> BITS) & 1).view(-1)[:self.vocab_size].bool()

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with the forbidden tokens at -inf (a new tensor)."""
        allowed = self.allowed().to(logits.device, non_blocking=True)
        return logits.masked_fill(~allowed, NEG_INF)

    def advance(self, token_id: int) -> None:
        if token_id not in self.eos_ids:
            self.matcher.consume_token(token_id)

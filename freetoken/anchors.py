"""Anchors: the prompt positions where a hybrid model's recurrent state is kept in the prefix cache
(kv/radix.py), so that an agent that edits its context resumes from the nearest one before the
edit. Owns where (token ids, positions); not the copies (state_cache.py) nor the tree.

An anchor is the position right after a token that closes a block: a reasoning block, a tool
call, a tool output (added tokens `</...>` of the tokenizer that its chat template writes) or a
turn (the model's EOS tokens that the template writes, e.g. <|im_end|>); plus the end of the
prompt, and the token before it (the same prompt again, its last token always prefilled,
resumes there): the state is kept exactly there (the tree keeps partial pages). Inside a longer
span a state is also kept every `interval` tokens, at the last page boundary before each. A
prefill chunk does not end at these points: its forward copies the state at each one inside it
(models/linear_attention.py), so a prompt takes ceil(tokens / --prefill-chunk) forwards.

    P = 4, closer c at index 5, interval 8, 19 prompt tokens:
    tokens  a b c d e c f g h i j k l m n o p q r      anchors 6 (after c), 19 (end), 18
    points  6, 12, 18, 19                              12: 6 + 8 rounded down to a page
"""
import json
from typing import Optional


def closer_token_ids(tokenizer) -> frozenset:
    """Ids of the added tokens that close a block or a turn in this model's chat template: those
    the template text contains that are a closing tag (`</think>`, `</tool_call>`,
    `</tool_response>`) or an EOS token (`<|im_end|>`). No template: the EOS tokens."""
    eos = frozenset(tokenizer.eos_token_ids)
    template = tokenizer.chat_template
    if template is None:
        return eos
    added = json.loads(tokenizer.to_json()).get("added_tokens") or []
    return frozenset(t["id"] for t in added if t["content"] in template
                     and (t["content"].startswith("</") or t["id"] in eos))


class Anchors:
    """One engine's anchor rule: closer ids, the interval and the page size (see the module)."""

    def __init__(self, closer_ids: frozenset, interval: int, page_size: int):
        self.closer_ids, self.interval, self.page_size = closer_ids, interval, page_size

    def points(self, tokens, start: int, end: int) -> list:
        """Positions p, start < p <= end, sorted, where the state of tokens[:p] is kept: each
        anchor of tokens[:end] (end and end - 1 included), and within a span of more than
        `interval` tokens between them every interval tokens rounded down to a page."""
        P, interval = self.page_size, self.interval
        anchors = [i + 1 for i, t in enumerate(tokens[:end]) if t in self.closer_ids]
        out, last = {end - 1}, 0
        for a in anchors + [end]:
            for p in range(last + interval, a, interval):  # inside a long span
                out.add(p - p % P)
            out.add(a)
            last = a
        return sorted(p for p in out if p > start)

    def is_closer(self, token_id: int) -> bool:
        return token_id in self.closer_ids

    def is_end(self, tokens, n: int, num_prompt_tokens: int) -> bool:
        """Whether the state after tokens[:n], kept while its prompt is prefilled, is a request
        end (the prompt's end or the token before it, not after a closer): the prefix cache
        drops those once a request resumes past them (kv/radix.py drop_ends)."""
        return n >= num_prompt_tokens - 1 and not self.is_closer(tokens[n - 1])


# A prefill forward takes the states at the state points inside its chunk (each a full copy of
# the sequence's state, alive until the forward ends: the memory plan counts them); a chunk with
# more points ends at the last one it takes.
SNAPSHOTS_PER_FORWARD = 16


def next_chunk_end(start: int, end: int, chunk: int, points: list,
                   max_snapshots: Optional[int] = None) -> int:
    """Where the prefill chunk from start ends: start + chunk capped at end, or sooner at its
    max_snapshots-th point (default SNAPSHOTS_PER_FORWARD; its forward keeps the state at each
    of its points); before its first point (start: no chunk) when max_snapshots is 0 (a packed
    forward's snapshots used up)."""
    if max_snapshots is None:
        max_snapshots = SNAPSHOTS_PER_FORWARD
    stop = min(start + chunk, end)
    inside = [p for p in points if start < p <= stop]
    if len(inside) <= max_snapshots:
        return stop
    return inside[max_snapshots - 1] if max_snapshots else start


def create_anchors(config, tokenizer, state, page_size: int) -> Optional[Anchors]:
    """The engine's Anchors, or None: no linear-attention state, or --no-state-checkpoints, or
    no prefix cache."""
    if state is None or not config.state_checkpoints or not config.prefix_cache:
        return None
    return Anchors(closer_token_ids(tokenizer), config.state_interval, page_size)

"""Sequence: one request's state (tokens, how many came from the prefix cache, how many have
their K/V written, its page table, status), with its invariants in check(). Owns no pages:
kv/manager.py gives and takes them."""
import enum
from dataclasses import dataclass, field
from typing import Any


class Status(enum.Enum):
    WAITING = "waiting"    # not admitted: no pages
    RUNNING = "running"    # admitted: holds its pages (and a lock on its cached prefix)
    FINISHED = "finished"  # released: no pages


@dataclass
class Sequence:
    """tokens: prompt then generated ids. Slots [0, num_cached_tokens) of the page table came
    from the prefix cache, [0, num_kv_tokens) hold written K/V; token i's K/V is at slot
    i % page_size of page page_table[i // page_size]."""
    tokens: list
    num_prompt_tokens: int
    page_table: list = field(default_factory=list)
    num_cached_tokens: int = 0
    num_kv_tokens: int = 0
    status: Status = Status.WAITING
    prefix_node: Any = None  # the radix node locked for this sequence (None: nothing locked)

    @classmethod
    def from_prompt(cls, prompt_ids) -> "Sequence":
        return cls(list(prompt_ids), len(prompt_ids))

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    def check(self, page_size: int) -> None:
        """Asserts the invariants (cheap: tests call it after every operation)."""
        assert 0 < self.num_prompt_tokens <= len(self.tokens), "a sequence needs a prompt"
        assert 0 <= self.num_cached_tokens <= self.num_kv_tokens <= len(self.tokens), \
            (self.num_cached_tokens, self.num_kv_tokens, len(self.tokens))
        assert self.num_cached_tokens < self.num_prompt_tokens, "a prompt token is always prefilled"
        if self.status is Status.RUNNING:
            assert len(self.page_table) * page_size >= self.num_kv_tokens, "K/V outside its pages"
            assert len(set(self.page_table)) == len(self.page_table), "a page twice in one table"
        else:
            assert not self.page_table and self.prefix_node is None, "pages outside RUNNING"

"""`freetoken chat` scripted through stdin (click's CliRunner: stdin is not a terminal) on the
bundled model: one turn per line, each reply followed by a blank line, the commands, and the
conversation reused from the prefix cache; ChatSession's stopped replies."""
import pytest
from click.testing import CliRunner

from freetoken import kv_cache
from freetoken.cli import chat, main, run

BASE = ["chat", "--device", "cpu", "--temp", "0", "-n", "8"]


@pytest.fixture
def small_pages(monkeypatch):
    monkeypatch.setattr(kv_cache, "PAGE_SIZE", 4)  # the bundled model's turns are short


def blocks(stdout: str) -> list:
    """The printed replies and answers: each ends with a blank line."""
    assert stdout.endswith("\n\n"), repr(stdout[-40:])
    return stdout[:-2].split("\n\n")


def test_scripted_turns_commands_and_cache(small_pages):
    script = ("def add(a, b):\n\n/stats\n    return a\n/stats\n/reset\ndef add(a, b):\n"
              "/exit\nnot read\n")
    result = CliRunner().invoke(main, BASE, input=script)
    assert result.exit_code == 0, result.output
    out = blocks(result.stdout)
    assert len(out) == 6, out  # reply, stats, reply, stats, reset, reply (the blank line skipped)
    first_stats, second_stats = out[1], out[3]
    assert "prompt cache   = 0 of" in first_stats and "time to first" in first_stats
    cached, _, prompt = second_stats.split("prompt cache   = ")[1].split()[:3]
    assert int(cached) >= 4, second_stats  # the second turn reuses the first turn's pages
    prefilled = int(second_stats.split("prompt eval")[1].split("/")[1].split()[0])
    assert prefilled == int(prompt) - int(cached)  # only the rest was forwarded
    assert out[4] == "(conversation reset)"
    assert out[5] == out[0]  # after /reset the same first turn gives the same greedy reply


def test_chat_options_are_runs():
    def names(command):
        return {p.name: p.default for p in command.params if p.name not in ("model",)}
    run_only = {"prompt", "raw", "stats", "trace_out"}
    assert {k: v for k, v in names(run).items() if k not in run_only} == \
        {k: v for k, v in names(chat).items() if k != "system"}


def test_session_keeps_a_stopped_reply():
    from freetoken import LLM, SamplingParams
    from freetoken.chat import ChatSession
    with LLM(device="cpu") as llm:
        session = ChatSession(llm, SamplingParams(temperature=0, max_tokens=20))
        pieces = session.reply("def f(x):")
        first = next(pieces)
        pieces.close()  # what Ctrl-C does to the stream
        assert session.messages[-1] == {"role": "assistant", "content": first}
        assert llm.stats.stop_reason == "interrupted"
        assert session.command("/nope").startswith("unknown command /nope")
        with pytest.raises(EOFError):
            session.command("/exit")


def test_a_refused_turn_is_not_kept():
    """A turn past --ctx-size is refused before its first piece: the messages stay as they
    were (the next turn does not carry it) and the session goes on."""
    from freetoken import LLM, SamplingParams
    from freetoken.chat import ChatSession
    from freetoken.errors import ConfigError
    with LLM(device="cpu", ctx_size=64) as llm:
        session = ChatSession(llm, SamplingParams(temperature=0, max_tokens=4))
        assert "".join(session.reply("def f(x):"))
        before = list(session.messages)
        with pytest.raises(ConfigError, match="--ctx-size"):
            "".join(session.reply("x = 1\n" * 80))
        assert session.messages == before
        assert "".join(session.reply("def g(y):"))
        assert len(session.messages) == len(before) + 2

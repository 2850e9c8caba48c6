"""tools/chat_pty.py drives `freetoken chat` on the bundled model in a real pseudo-terminal
(prompt_toolkit's interactive path, not the scripted one of test_cli_chat.py): a reply for every
turn, turn 2 from the prefix cache, the mended and the recalled lines as meant, Ctrl-C stopping
a reply without leaving, /reset emptying the cache's share, /exit ending with status 0. Also
the tool's terminal screen on bytes prompt_toolkit wrote, and its replay of the line editing."""
import io
import os
import re

import pytest

if os.name != "posix":
    pytest.skip("chat_pty needs a POSIX pseudo-terminal (pty, termios)", allow_module_level=True)
try:
    os.close(os.openpty()[0])  # (the other end is left to the test process's exit)
except OSError as e:
    pytest.skip(f"no pseudo-terminal can be opened here: {e}", allow_module_level=True)

import chat_pty  # noqa: E402  (tools/ is on sys.path: conftest.py)

CHAT = ["--device", "cpu", "--temp", "0", "-n", "48"]


def cached(stats_step) -> tuple:
    """(cached, prompt) tokens from a /stats answer as the screen showed it."""
    text = "\n".join(stats_step.lines)
    m = re.search(r"prompt cache\s*=\s*(\d+) of (\d+) prompt tokens", text)
    assert m, text
    return int(m.group(1)), int(m.group(2))


def test_chat_in_a_pty(tmp_path):
    script = chat_pty.DEFAULT_SCRIPT.replace("<ctrl-c-after 0.2>", "<ctrl-c-after 0.1>")
    out = io.StringIO()
    steps, failure, status = chat_pty.run(script, CHAT, timeout=60, key_delay=0.01, out=out,
                                          cwd=str(tmp_path))  # the installed freetoken, as CI's
    transcript = out.getvalue()
    assert failure is None, transcript
    assert status == 0, transcript  # /exit ended it cleanly
    assert transcript.rstrip().endswith("-- ok")
    by_line = {s.meant.strip(): s for s in steps}
    turns = [s for s in steps if s.is_turn]
    assert len(turns) == 7
    for turn in turns:  # each typed line shown as meant, each answered with text on the screen
        assert turn.shown == turn.meant and "".join(turn.lines).strip(), transcript
        assert f"| > {turn.meant}" in transcript
        assert 0 < turn.first_s <= turn.prompt_s
    stats = [s for s in steps if s.meant == "/stats"]
    assert cached(stats[0])[0] == 0
    assert cached(stats[1])[0] > 0  # turn 2 reused turn 1 from the prefix cache
    mended, recalled = turns[2], turns[3]
    assert mended.meant == recalled.meant == "def mul(x, y):"
    assert recalled.source == "<up><up>"
    stopped, after = turns[4], turns[5]
    assert stopped.stopped and "^C" in stopped.lines[-1], transcript  # (the tty's echo)
    assert "stopped by     = interrupted" in "\n".join(stats[4].lines)
    assert not after.stopped and after.prompt_s is not None  # still there, and it answered
    assert by_line["/reset"].lines == ["(conversation reset)"]
    before_reset, after_reset = cached(stats[-2]), cached(stats[-1])
    assert after_reset[0] < before_reset[0], transcript  # the conversation's prefix is gone
    assert "-- /exit: the chat ended with status 0" in transcript


def test_screen_applies_prompt_toolkits_redraws():
    """Bytes prompt_toolkit wrote for a line edited in place, then a reply stopped by Ctrl-C."""
    screen = chat_pty.Screen(40, 120)
    raw = ("\x1b[6n\x1b[?2004h\x1b[?1l\x1b[?25l\x1b[0m\x1b[?7l\x1b[0m\x1b[J\x1b[0m>\x08\x1b[2C"
           "\x1b[?7h\x1b[0mdef mul(x, z):\x1b[3D\x1b[0m\x1b[K):\x1b[2D\x1b[0my):\x1b[2D"
           "\x1b[?25l\x1b[?7l\x1b[16D\x1b[0m\x1b[J\x1b[0m> def mul(x, y):\x1b[16D\x1b[0m\r\r\n"
           "\x1b[J\x1b[?7h\x1b[0m\x1b[?12l\x1b[?25h\x1b[?2004ldef _add_add^C [stopped]\r\n"
           "\x1b]0;title\x07\x1b[6n\x1b[?2004h\x1b[0m>")
    for i in range(0, len(raw), 7):  # in pieces that cut escape sequences
        screen.feed(raw[i:i + 7])
    assert [screen.text(r) for r in range(3)] == ["> def mul(x, y):",
                                                  "def _add_add^C [stopped]", ">"]
    assert screen.answers == ["\x1b[1;1R", "\x1b[3;1R"] and screen.num_prompts == 2


def test_script_replays_editing_and_history():
    steps = chat_pty.parse_script("ab<left>X<end>c\n/stats\n# note\n\n<up><up><bs>\n"
                                  "x<home>y<del>\nlong<ctrl-c-after 0.5>\n")
    assert [s.meant for s in steps] == ["aXbc", "/stats", "aXb", "y", "long", "/exit"]
    assert steps[0].keys == ["a", "b", "\x1b[D", "X", "\x1b[F", "c"]
    assert steps[4].ctrl_c_after == 0.5 and steps[-1].source == "/exit (added)"
    with pytest.raises(ValueError, match="must end the line"):
        chat_pty.parse_script("a<ctrl-c-after 1>b\n")

"""Drive `freetoken chat` in a real pseudo-terminal, typed like a person, and print what the
screen showed: for trying the interactive chat (prompt_toolkit line editing and history,
streamed replies, Ctrl-C stopping a reply, /stats, /reset, /exit) where only a batch command
reaches the machine (no TTY). Standard library only on the driving side (no pexpect there).

    python tools/chat_pty.py -- --device cuda --temp 0
    python tools/chat_pty.py --model qwen3.ftw --script my_session.txt --log raw.bin -- --device cpu

Everything after `--` goes to `freetoken chat` as it is (sampling and engine options). The
script has one input per line, typed key by key and then Enter (a line that starts with # is
a comment, blank lines are skipped; leading spaces are typed). Inside a line these are keys:

    <left> <right> <up> <down> <home> <end> <bs> <del>   arrows, Home/End, Backspace, Delete
    <ctrl-c-after S>   (at the end of a line) Ctrl-C S seconds after the reply's first
                       character: the reply must stop ("[stopped]") and the prompt come back

<up>/<down> walk the history as prompt_toolkit does; the tool replays the keys to know the line
it meant and checks that the screen shows it. A session without /exit gets one at the end.
It fails (exit status 1, with the reason) when the chat ends before /exit, a step outlasts
--timeout, the screen shows another line than the one meant, a turn gets no reply, a Ctrl-C
does not stop its reply (or the reply ended before it), or /exit does not end it with status 0.
The transcript is the terminal's screen (the escape sequences applied to a ROWS x COLS grid,
scrollback kept), rows as `| ...`; after each step a `--` line gives its times from Enter: to
the first reply character and to the prompt's return; a table of the turns ends it, with the
chat's own TTFT and prompt-cache numbers from the /stats that follows each turn.
"""
import argparse
import codecs
import fcntl
import os
import pty
import random
import re
import select
import signal
import struct
import sys
import termios
import time
from dataclasses import dataclass, field
from typing import Optional

DEFAULT_SCRIPT = """\
# turn 1, then its timing lines
def add(a, b):
/stats
# turn 2 reuses turn 1 from the prefix cache (its /stats: cached tokens > 0)
    return a + b
/stats
# a line mended before Enter: `z` becomes `y` (two left, Backspace, y, End)
def mul(x, z):<left><left><bs>y<end>
/stats
# the line before the last /stats, recalled with Up (Up once is /stats itself)
<up><up>
/stats
# Ctrl-C while the reply streams (its /stats: stopped by interrupted); the chat must stay
# and answer the next turn
def fib(n):<ctrl-c-after 0.2>
/stats
def sub(a, b):
/stats
/reset
# after /reset the conversation starts again: fewer cached tokens
class Stack:
/stats
/exit
"""

KEYS = {"left": "\x1b[D", "right": "\x1b[C", "up": "\x1b[A", "down": "\x1b[B",
        "home": "\x1b[H", "end": "\x1b[F", "bs": "\x7f", "del": "\x1b[3~"}
KEY = re.compile(r"<(left|right|up|down|home|end|bs|del)>|<ctrl-c-after ([0-9.]+)>")

# Escape sequences: CSI (params, final), OSC, DCS/SOS/PM/APC strings, the two-byte ESC ones
# (ESC 7/8 save and restore the cursor; charsets and keypad modes change nothing shown).
ESCAPE = re.compile(r"\x1b\[([0-?]*)[ -/]*([@-~])|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"
                    r"|\x1b[PX^_][^\x1b]*\x1b\\|\x1b[ -/]*([0-OQ-WYZ\\`a-~])")
PARTIAL = re.compile(r"\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*\x1b?|[PX^_][^\x1b]*\x1b?|[ -/]*)\Z")


class Failed(Exception):
    """A step went wrong; the message says which and how."""


class Ended(Exception):
    """The chat closed its terminal (it exited)."""


class Screen:
    """What a rows x cols terminal shows for the text a program writes: characters, CR/LF/BS/TAB,
    the cursor moves and erases prompt_toolkit uses, autowrap; colours, modes and titles show
    nothing. Rows that scroll off are kept (the transcript is the whole scrollback). It also
    answers cursor-position requests (ESC[6n) as a terminal would (answers) and counts the
    prompts that start (prompt_toolkit turns bracketed paste on at each one)."""

    def __init__(self, rows: int, cols: int):
        self.rows, self.cols = rows, cols
        self.lines = [[]]  # every row so far, each a list of characters
        self.row = self.col = self.top = 0  # cursor; top: the first row on the screen
        self.saved = (0, 0)
        self.autowrap = True
        self.continued = set()  # rows that go on from the row above (autowrapped)
        self.num_prompts = 0
        self.answers = []  # what the terminal sends back (cursor position reports)
        self.watch_row, self.seen_below = None, False
        self._pending = ""  # an escape sequence cut by the end of a read

    def watch(self, row: int) -> None:
        """seen_below becomes True once a visible character is written below row."""
        self.watch_row, self.seen_below = row, False

    def text(self, row: int) -> str:
        return "".join(self.lines[row]).rstrip()

    def logical(self, start: int, stop: int) -> list:
        """Rows [start, stop) as the lines written (autowrapped rows joined)."""
        out = []
        for r in range(start, stop):
            row = "".join(self.lines[r])
            if r in self.continued and out:
                out[-1] += row
            else:
                out.append(row)
        return [line.rstrip() for line in out]

    def feed(self, text: str) -> None:
        text, self._pending = self._pending + text, ""
        i = 0
        while i < len(text):
            ch = text[i]
            if ch == "\x1b":
                m = ESCAPE.match(text, i)
                if m is None:
                    if PARTIAL.match(text, i):
                        self._pending = text[i:]
                        return
                    i += 1  # a lone ESC: nothing shown
                    continue
                if m.group(2):
                    self._csi(m.group(1), m.group(2))
                elif m.group(3) == "7":
                    self.saved = (self.row, self.col)
                elif m.group(3) == "8":
                    self.row, self.col = self.saved
                i = m.end()
                continue
            if ch == "\r":
                self.col = 0
            elif ch == "\n":  # the tty already turned \n into \r\n where the program wanted it
                self._line_feed()
            elif ch == "\b":
                self.col = max(0, min(self.col, self.cols - 1) - 1)
            elif ch == "\t":
                self.col = min(self.cols - 1, (self.col // 8 + 1) * 8)
            elif ch >= " " and ch != "\x7f":
                self._put(ch)
            i += 1

    def _line_feed(self) -> None:
        self.row += 1
        while len(self.lines) <= self.row:
            self.lines.append([])
        self.top = max(self.top, self.row - self.rows + 1)

    def _put(self, ch: str) -> None:
        if self.col >= self.cols:
            if self.autowrap:
                self._line_feed()
                self.col = 0
                self.continued.add(self.row)
            else:
                self.col = self.cols - 1
        line = self.lines[self.row]
        line.extend(" " * (self.col + 1 - len(line)))
        line[self.col] = ch
        self.col += 1
        if ch != " " and self.watch_row is not None and self.row > self.watch_row:
            self.seen_below = True

    def _goto(self, row: int, col: int) -> None:
        self.row = max(self.top, min(self.top + self.rows - 1, row))
        self.col = max(0, min(self.cols - 1, col))
        while len(self.lines) <= self.row:
            self.lines.append([])

    def _erase_below(self) -> None:
        del self.lines[self.row][self.col:]
        for r in range(self.row + 1, len(self.lines)):
            self.lines[r] = []
            self.continued.discard(r)

    def _csi(self, params: str, final: str) -> None:
        if params.startswith("?"):  # private modes: autowrap (7), bracketed paste (2004)
            modes = params[1:].split(";")
            if final in "hl" and "7" in modes:
                self.autowrap = final == "h"
            if final == "h" and "2004" in modes:
                self.num_prompts += 1
            return
        args = [int(p) if p.isdigit() else 0 for p in params.split(";")] if params else []
        n = max(1, args[0]) if args else 1
        line = self.lines[self.row]
        if final == "A":
            self._goto(self.row - n, self.col)
        elif final == "B":
            self._goto(self.row + n, self.col)
        elif final == "C":
            self._goto(self.row, self.col + n)
        elif final == "D":
            self._goto(self.row, min(self.col, self.cols - 1) - n)
        elif final == "G":
            self._goto(self.row, n - 1)
        elif final in "Hf":
            col = args[1] if len(args) > 1 and args[1] else 1
            self._goto(self.top + n - 1, col - 1)
        elif final == "d":
            self._goto(self.top + n - 1, self.col)
        elif final == "J":
            if not args or args[0] == 0:
                self._erase_below()
            elif args[0] in (2, 3):
                for r in range(self.top, len(self.lines)):
                    self.lines[r] = []
        elif final == "K":
            mode = args[0] if args else 0
            if mode == 0:
                del line[self.col:]
            elif mode == 1:
                line[:self.col + 1] = " " * min(len(line), self.col + 1)
            else:
                line.clear()
        elif final == "X":
            line[self.col:self.col + n] = " " * len(line[self.col:self.col + n])
        elif final == "P":
            del line[self.col:self.col + n]
        elif final == "@":
            line[self.col:self.col] = " " * n if self.col < len(line) else ""
        elif final == "n" and args == [6]:
            self.answers.append(f"\x1b[{self.row - self.top + 1};{self.col + 1}R")


@dataclass
class Step:
    """One scripted input: the keys typed, the line they leave (meant), what happened."""
    number: int  # the script's line number
    source: str
    keys: list
    meant: str
    ctrl_c_after: Optional[float] = None
    shown: str = ""  # the input row on the screen after Enter, less the "> "
    lines: list = field(default_factory=list)  # what it printed (autowrapped rows joined)
    first_s: Optional[float] = None  # Enter -> its first visible character
    prompt_s: Optional[float] = None  # Enter -> the prompt back
    stop_s: Optional[float] = None  # the Ctrl-C -> the prompt back
    stopped: bool = False  # "[stopped]" shown: a Ctrl-C stopped the reply
    stats: dict = field(default_factory=dict)  # the chat's numbers from the /stats after it

    @property
    def is_turn(self) -> bool:
        return bool(self.meant.strip()) and not self.meant.strip().startswith("/")


def parse_script(text: str) -> list:
    """Steps from a script (the module docstring), each with the line its keys leave: the
    editing and history of prompt_toolkit's single-line buffer replayed (Up/Down go to the end
    of the entry; an entry equal to the one before is not added again)."""
    steps, history = [], []
    for number, source in enumerate(text.splitlines(), 1):
        if not source.strip() or source.startswith("#"):
            continue
        working, index, cursor, keys, after = history + [""], len(history), 0, [], None
        pieces = KEY.split(source)  # text, key, delay, text, key, delay, ..., text
        for i, piece in enumerate(pieces):
            if piece is None or not piece:
                continue
            if i % 3 == 2:  # a <ctrl-c-after S>
                if any(pieces[i + 1:]):
                    raise ValueError(f"line {number}: <ctrl-c-after S> must end the line")
                after = float(piece)
                continue
            for key in ([piece] if i % 3 == 1 else list(piece)):
                line = working[index]
                if key in ("up", "down"):
                    moved = max(0, index - 1) if key == "up" else min(len(history), index + 1)
                    if moved != index:
                        index, cursor = moved, len(working[moved])
                elif key in ("left", "right", "home", "end"):
                    cursor = {"left": max(0, cursor - 1), "right": min(len(line), cursor + 1),
                              "home": 0, "end": len(line)}[key]
                elif key == "bs":
                    working[index] = line[:max(0, cursor - 1)] + line[cursor:]
                    cursor = max(0, cursor - 1)
                elif key == "del":
                    working[index] = line[:cursor] + line[cursor + 1:]
                else:
                    working[index] = line[:cursor] + key + line[cursor:]
                    cursor += 1
                keys.append(KEYS.get(key, key))
        meant = working[index]
        if meant and (not history or history[-1] != meant):
            history.append(meant)
        steps.append(Step(number, source, keys, meant, after))
    if not steps or steps[-1].meant.strip() not in ("/exit", "/quit"):
        steps.append(Step(0, "/exit (added)", list("/exit"), "/exit"))
    return steps


class Chat:
    """The chat on the child side of a pty; pump() reads what it writes into the screen."""

    def __init__(self, argv: list, rows: int, cols: int, log=None, cwd: Optional[str] = None):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: a rows x cols xterm, then the chat
            try:
                if cwd:
                    os.chdir(cwd)
                fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
                env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
                os.execvpe(argv[0], argv, dict(env, TERM="xterm-256color"))
            finally:
                os._exit(127)
        self.screen = Screen(rows, cols)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.log, self.status = log, None

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def pump(self, seconds: float, until=lambda: False) -> bool:
        """Reads for up to seconds, or until until() holds (True then); Ended if it exits."""
        deadline = time.monotonic() + seconds
        while not until():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if select.select([self.fd], [], [], left)[0]:
                self._read()
        return True

    def _read(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: every holder of the terminal's other side has closed it
            data = b""
        if not data:
            self.screen.feed(self.decoder.decode(b"", final=True))
            self._reap()
            raise Ended
        if self.log:
            self.log.write(data)
        self.screen.feed(self.decoder.decode(data))
        for answer in self.screen.answers:
            self.send(answer)
        self.screen.answers.clear()

    def _reap(self) -> None:
        deadline = time.monotonic() + 10
        while self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
            else:
                time.sleep(0.01)

    def close(self) -> None:
        if self.status is None:
            os.kill(self.pid, signal.SIGKILL)
            self._reap()
        os.close(self.fd)


class Driver:
    """Runs steps on a Chat and prints the screen's rows as they become final."""

    def __init__(self, chat: Chat, timeout: float, key_delay: float, seed: int, out):
        self.chat, self.screen, self.timeout = chat, chat.screen, timeout
        self.key_delay, self.rng, self.out = key_delay, random.Random(seed), out
        self.printed = 0  # rows above this one are printed

    def print_rows(self, stop: int, trim: bool = False) -> None:
        """Prints rows [printed, stop); trim: less the empty rows that end them."""
        while trim and stop > self.printed and not self.screen.text(stop - 1):
            stop -= 1
        for r in range(self.printed, stop):
            print(f"| {self.screen.text(r)}", file=self.out)
        self.printed = max(self.printed, stop)

    def note(self, text: str) -> None:
        print(f"-- {text}", file=self.out, flush=True)

    def prompt_after(self, row: int, prompts: int):
        """A test that the prompt is back below row: a new prompt began and the cursor sits
        after "> " on an otherwise empty row."""
        s = self.screen
        return lambda: (s.num_prompts > prompts and s.row > row and s.col == 2
                        and s.text(s.row) == ">")

    def start(self) -> float:
        begin = time.monotonic()
        try:
            if not self.chat.pump(self.timeout, self.prompt_after(-1, 0)):
                raise Failed(f"no prompt within {self.timeout:g} s of the start (--timeout)")
        except Ended:
            s = self.chat.screen
            shown = "\n".join(f"| {s.text(r)}" for r in range(len(s.lines)) if s.text(r))
            raise Failed(f"the chat ended (status {self.chat.status}) before its first prompt; it showed:\n{shown}")
        self.print_rows(self.screen.row)
        return time.monotonic() - begin

    def type(self, keys: list) -> None:
        self.chat.pump(self.key_delay * self.rng.uniform(3, 8))  # reading the prompt first
        for key in keys:
            self.chat.send(key)
            self.chat.pump(self.key_delay * self.rng.uniform(0.5, 1.5))
        self.chat.pump(self.key_delay * 2)

    def step(self, step: Step) -> None:
        try:
            self._step(step)
        except Ended:
            self.print_rows(len(self.screen.lines), trim=True)
            what = "the Ctrl-C" if step.ctrl_c_after is not None else "this step"
            raise Failed(f"line {step.number}: the chat ended (status {self.chat.status}) "
                         f"after {what}: {step.source!r}")

    def _step(self, step: Step) -> None:
        chat, s = self.chat, self.screen
        self.type(step.keys)
        row, prompts = s.row, s.num_prompts
        s.watch(row)
        prompt_back = self.prompt_after(row, prompts)
        chat.send("\r")
        enter = time.monotonic()
        if step.meant.strip() in ("/exit", "/quit"):
            return self._exit(step, row, enter)

        def first_or_prompt():
            if step.first_s is None and s.seen_below:
                step.first_s = time.monotonic() - enter
            return step.first_s is not None or prompt_back()

        if not chat.pump(self.timeout, first_or_prompt):
            raise Failed(f"line {step.number}: nothing within {self.timeout:g} s of Enter")
        if step.ctrl_c_after is not None:
            if chat.pump(step.ctrl_c_after, prompt_back):
                raise Failed(f"line {step.number}: the reply ended before the Ctrl-C "
                             f"{step.ctrl_c_after:g} s after its first character; ask for "
                             "more tokens (-n) or give a shorter delay")
            chat.send("\x03")
            ctrl_c = time.monotonic()
        if not chat.pump(self.timeout, lambda: first_or_prompt() and prompt_back()):
            raise Failed(f"line {step.number}: no prompt within {self.timeout:g} s of Enter "
                         "(--timeout)")
        step.prompt_s = time.monotonic() - enter
        if step.ctrl_c_after is not None:
            step.stop_s = enter + step.prompt_s - ctrl_c
        step.shown = s.text(row)[2:]
        step.lines = s.logical(row + 1, s.row)
        step.stopped = bool(step.lines) and step.lines[-1].endswith("[stopped]")
        self.print_rows(s.row)
        self.note(self._times(step))
        self._check(step)

    def _exit(self, step: Step, row: int, enter: float) -> None:
        try:
            self.chat.pump(self.timeout)
        except Ended:
            self.print_rows(len(self.screen.lines), trim=True)
            step.prompt_s = time.monotonic() - enter
            step.shown = self.screen.text(row)[2:]
            self.note(f"{step.meant}: the chat ended with status {self.chat.status}")
            if self.chat.status != 0:
                raise Failed(f"{step.meant} ended the chat with status {self.chat.status}")
            return
        self.print_rows(len(self.screen.lines), trim=True)
        raise Failed(f"{step.meant} did not end the chat within {self.timeout:g} s")

    @staticmethod
    def _times(step: Step) -> str:
        name = "turn" if step.is_turn else step.meant.strip() or "(empty line)"
        first = f"{step.first_s * 1e3:.0f} ms" if step.first_s is not None else "-"
        stopped = (f"; Ctrl-C -> prompt back {step.stop_s * 1e3:.0f} ms, [stopped]"
                   if step.stopped else "")
        return (f"{name} (line {step.number}): Enter -> first character {first}, "
                f"-> prompt back {step.prompt_s * 1e3:.0f} ms{stopped}")

    @staticmethod
    def _check(step: Step) -> None:
        if step.shown.rstrip() != step.meant.rstrip():
            raise Failed(f"line {step.number}: the screen shows {step.shown!r} at Enter, the "
                         f"keys of {step.source!r} meant {step.meant!r}")
        if step.ctrl_c_after is not None and not step.stopped:
            raise Failed(f"line {step.number}: Ctrl-C did not stop the reply (no [stopped])")
        if step.is_turn and not "".join(step.lines).strip():
            raise Failed(f"line {step.number}: no reply to {step.meant!r}")


STAT = {"ttft_ms": re.compile(r"time to first\s*=\s*([0-9.]+) ms"),
        "cached": re.compile(r"prompt cache\s*=\s*(\d+) of (\d+) prompt tokens")}


def attach_stats(steps: list) -> list:
    """The turns, each with the numbers of the first /stats after it (before the next turn)."""
    turns, last = [], None
    for step in steps:
        if step.is_turn and step.prompt_s is not None:
            turns.append(step)
            last = step
        elif step.meant.strip() == "/stats" and last is not None and not last.stats:
            text = "\n".join(step.lines)
            for key, pattern in STAT.items():
                m = pattern.search(text)
                if m:
                    last.stats[key] = m.groups() if key == "cached" else float(m.group(1))
    return turns


def summary(turns: list) -> list:
    out = ["turn  first char  prompt back  TTFT (chat)  prompt cache (chat)  input"]
    for i, t in enumerate(turns, 1):
        first = f"{t.first_s * 1e3:7.0f} ms" if t.first_s is not None else "       -  "
        ttft = f"{t.stats['ttft_ms']:8.2f} ms" if "ttft_ms" in t.stats else "        -  "
        cached = " of ".join(t.stats["cached"]) if "cached" in t.stats else "-"
        mark = f"  [stopped {t.stop_s * 1e3:.0f} ms after Ctrl-C]" if t.stopped else ""
        out.append(f"{i:4d}  {first}  {t.prompt_s * 1e3:8.0f} ms  {ttft}  {cached:>19}  "
                   f"{t.meant.strip()}{mark}")
    return out


def run(script: str, chat_args: list, model: Optional[str] = None, timeout: float = 180.0,
        key_delay: float = 0.08, rows: int = 40, cols: int = 120, seed: int = 0,
        log_path: Optional[str] = None, out=sys.stdout, cwd: Optional[str] = None):
    """Runs the script on `freetoken chat [model] chat_args` in a pty, printing the transcript
    to out. Returns (steps, failure message or None, the chat's exit status). cwd: the chat's
    working folder (from a source checkout's root, `-m freetoken` imports that tree, not the
    installed package)."""
    steps = parse_script(script)
    argv = [sys.executable, "-m", "freetoken", "chat"] + ([model] if model else []) + chat_args
    print(f"-- {' '.join(argv)}  (TERM=xterm-256color, {rows}x{cols})", file=out, flush=True)
    log = open(log_path, "wb") if log_path else None
    chat = Chat(argv, rows, cols, log, cwd)
    driver = Driver(chat, timeout, key_delay, seed, out)
    failure = None
    try:
        driver.note(f"first prompt after {driver.start():.2f} s")
        for step in steps:
            driver.step(step)
    except Failed as e:
        failure = str(e)
    finally:
        chat.close()
        if log:
            log.close()
    turns = attach_stats(steps)
    for line in summary(turns):
        print(f"-- {line}", file=out)
    print(f"-- {'FAILED: ' + failure if failure else 'ok'}", file=out, flush=True)
    return steps, failure, chat.status


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chat_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options] [-- CHAT OPTIONS...]")
    parser.add_argument("--model", default=None,
                        help="MODEL.ftw for `freetoken chat` (default: its bundled model)")
    parser.add_argument("--script", "--turns", default=None, metavar="FILE",
                        help="the session, one input per line (default: the built-in one, "
                             "printed by --show-script)")
    parser.add_argument("--show-script", action="store_true", help="print the built-in script")
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="seconds each step may take: the start to the first prompt, Enter "
                             "to the prompt's return, /exit to the end (default: %(default)s)")
    parser.add_argument("--key-delay", type=float, default=0.08,
                        help="mean seconds between keystrokes; a person reads the prompt for "
                             "3-8 of them before typing (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--cols", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0, help="the keystroke timing's seed")
    parser.add_argument("--log", default=None, metavar="FILE",
                        help="write every raw byte the chat sent to the terminal to FILE")
    args = parser.parse_args(ours)
    if args.show_script:
        print(DEFAULT_SCRIPT, end="")
        return 0
    script = DEFAULT_SCRIPT
    if args.script:
        with open(args.script) as f:
            script = f.read()
    _, failure, _ = run(script, chat_args, args.model, args.timeout, args.key_delay, args.rows,
                        args.cols, args.seed, args.log)
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())

"""`freetoken chat`: a multi-turn conversation over LLM.stream_chat, its history kept in the
engine's prefix cache (turn k prefills only turn k's new tokens). Owns the turn loop and the
commands (/reset, /stats, /exit, /help); cli.py only parses options.

On a terminal: prompt_toolkit line editing and history, replies streamed, Ctrl-C stops a reply
(the conversation goes on), Ctrl-D or /exit leaves. Otherwise (scripted): each input line is
one user turn (or a command), each reply is printed followed by a blank line.
"""
import signal
from typing import Iterator, Optional, TextIO

from .errors import FreetokenError

HELP = ("/reset forgets the conversation, /stats prints the latest reply's timing and cache "
        "lines, /exit leaves")


class ChatSession:
    """The messages of one conversation and the replies to them (LLM.stream_chat)."""

    def __init__(self, llm, params, system: Optional[str] = None):
        self.llm, self.params, self.system = llm, params, system
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, text: str) -> Iterator[str]:
        """Streams the reply to user text; the reply so far joins the messages when it ends,
        also when it is stopped (Ctrl-C, or the caller closing the iterator). A turn the engine
        refuses before its first piece (FreetokenError: the conversation outgrew --ctx-size)
        leaves the messages as they were, and the error goes to the caller."""
        self.messages.append({"role": "user", "content": text})
        pieces = []
        try:
            for piece in self.llm.stream_chat(self.messages, self.params):
                pieces.append(piece)
                yield piece
        except FreetokenError:
            if not pieces:
                self.messages.pop()
                raise
            self.messages.append({"role": "assistant", "content": "".join(pieces)})
            raise
        except BaseException:
            self.messages.append({"role": "assistant", "content": "".join(pieces)})
            raise
        else:
            self.messages.append({"role": "assistant", "content": "".join(pieces)})

    def command(self, line: str) -> Optional[str]:
        """The answer to a /command (None: not a command); raises EOFError for /exit."""
        name = line.strip()
        if name in ("/exit", "/quit"):
            raise EOFError
        if name == "/reset":
            self.reset()
            return "(conversation reset)"
        if name == "/stats":
            return "\n".join(self.llm.stats.lines())
        if name in ("/help", "/?"):
            return HELP
        if name.startswith("/"):
            return f"unknown command {name}; {HELP}"
        return None


EXIT = object()  # _command's answer to /exit


def _command(session: ChatSession, text: str):
    """session.command(text): its answer, None for a user turn, EXIT for /exit."""
    try:
        return session.command(text)
    except EOFError:
        return EXIT


def run_scripted(session: ChatSession, lines: TextIO, out: TextIO) -> None:
    """Each line of `lines` is a user turn or a command; replies and answers go to out, each
    followed by a blank line. Empty lines are skipped; /exit or the end of input ends it."""
    for line in lines:
        text = line.rstrip("\n")
        if not text.strip():
            continue
        answer = _command(session, text)
        if answer is EXIT:
            return
        if answer is None:
            for piece in session.reply(text):
                out.write(piece)
                out.flush()
        else:
            out.write(answer)
        out.write("\n\n")
        out.flush()


def run_interactive(session: ChatSession, out: TextIO) -> None:
    """The terminal loop: prompt_toolkit's line editing and history; Ctrl-C at the prompt
    clears the line, during a reply stops it after the next piece; Ctrl-D or /exit leaves."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import InMemoryHistory

    prompt = PromptSession(history=InMemoryHistory())
    out.write(f"freetoken chat: {HELP}; Ctrl-C stops a reply, Ctrl-D leaves\n")
    while True:
        try:
            text = prompt.prompt("> ")
        except KeyboardInterrupt:
            continue
        except EOFError:
            return
        if not text.strip():
            continue
        answer = _command(session, text)
        if answer is EXIT:
            return
        if answer is not None:
            out.write(answer + "\n")
            continue
        try:
            if not _stream(session.reply(text), out):
                out.write(" [stopped]")
        except FreetokenError as e:  # the turn is not kept: the conversation goes on without it
            out.write(f"error: {e}\n(this turn was not kept; /reset starts a new conversation)")
        out.write("\n")


def _stream(pieces: Iterator[str], out: TextIO) -> bool:
    """Writes the pieces as they come; False when Ctrl-C stopped them. SIGINT only raises a
    flag, read after each piece: a KeyboardInterrupt inside an engine step can leave the engine
    unusable (a CPU expert job submitted and never waited for fails the next turn's forward)."""
    stop = []
    previous = signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    try:
        for piece in pieces:
            out.write(piece)
            out.flush()
            if stop:
                pieces.close()  # ends the engine's request between steps
                return False
    finally:
        signal.signal(signal.SIGINT, previous)
    return True

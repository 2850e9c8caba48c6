"""`freetoken serve`: OpenAI (chat completions, completions, responses) and Anthropic (messages)
compatible HTTP APIs over one engine.

The HTTP layer only translates (validate, render the chat, call the worker, stream back); the
engine runs on the worker's thread (worker.py), the one class a batched engine replaces.
"""
from .config import ServeConfig

__all__ = ["ServeConfig"]

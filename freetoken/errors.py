"""User-facing errors of the engine. The CLI prints their message as one line and exits 2.

A message says what is wrong and what to do about it. ftw has its own FTWError tree
(ftw/errors.py), which the CLI treats the same way; ftw never imports freetoken.
"""


class FreetokenError(Exception):
    """Base of every error whose message is meant for the user, not a traceback."""


class ConfigError(FreetokenError):
    """An option or option combination is out of range (bad -n, --top-p, cache size, ...)."""


class ModelError(FreetokenError):
    """The model cannot be loaded or run as asked (unknown family, missing tensor, ...)."""

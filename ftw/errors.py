"""Named errors of the FTW format and converter; each message says what is wrong and what to do."""


class FTWError(Exception):
    """Base of every ftw error meant for the user."""

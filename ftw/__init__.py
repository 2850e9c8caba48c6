"""FTW: the freetoken weight format (see SPEC.md). numpy only; no torch import."""

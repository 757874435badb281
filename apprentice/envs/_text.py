"""Text helpers shared by environment families: forgiving normalisation of tool arguments.

Why: a 135M model writes ``" Up"``, ``"'Zorvan Telik'."`` or ``"The Ostrel Guild"``. Tools compare
normalised strings so that such junk still means what the model meant, and never raise on it.
"""

from __future__ import annotations

import re
from typing import Any

_WORD = re.compile(r"[a-z0-9]+")


def as_text(value: Any) -> str:
    """Any tool argument (a small model may send a number, a list or null) as a string."""
    if value is None:
        return ""
    if isinstance(value, list | tuple):
        return " ".join(as_text(v) for v in value)
    return str(value)


def norm(value: Any) -> str:
    """Lower case, punctuation dropped, whitespace collapsed, a leading article removed."""
    words = _WORD.findall(as_text(value).lower())
    if len(words) > 1 and words[0] in ("the", "a", "an"):
        words = words[1:]
    return " ".join(words)


def words(value: Any) -> list[str]:
    """Lower-case alphanumeric words of ``value`` in order."""
    return _WORD.findall(as_text(value).lower())


def clip(value: Any, n: int = 40) -> str:
    """A short, quoted echo of a bad argument for error observations (keeps them within budget)."""
    s = " ".join(as_text(value).split())
    return repr(s if len(s) <= n else s[: n - 3] + "...")

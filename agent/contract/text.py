"""Text shown to people, made safe to show: what an alarm or an object carries never reorders or
hides what a person reads (Unicode format characters such as U+202E RIGHT-TO-LEFT OVERRIDE, U+200B
ZERO WIDTH SPACE, U+2066..U+2069 isolates: category ``Cf``). Standard library only."""
from __future__ import annotations

import functools
import re
import sys
import unicodedata


@functools.cache
def format_characters() -> re.Pattern[str]:
    """Every Unicode format character (category ``Cf``), as a character class (built on first use)."""
    found = "".join(chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf")
    return re.compile("[" + re.escape(found) + "]")


def has_format_characters(text: str) -> bool:
    return text.isascii() is False and format_characters().search(text) is not None


def strip_format_characters(text: str) -> str:
    """``text`` without Unicode format characters."""
    return text if text.isascii() else format_characters().sub("", text)

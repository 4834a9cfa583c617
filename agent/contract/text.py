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


# -- an incident's GPU telemetry (status.telemetry, docs/telemetry.md), as one line ----------------
TELEMETRY_CORROBORATES = "Corroborates"
TELEMETRY_CLEAN = "Clean"
TELEMETRY_NO_DATA = "NoData"
TELEMETRY_UNAVAILABLE = "Unavailable"


def telemetry_line(telemetry: dict | None) -> str:
    """``status.telemetry`` of an SDCIncident as ``kubectl sdcguard incidents`` shows it:
    ``corroborates (XID 79, DBE +2)``, ``clean``, ``clean (noted: SBE +3)``, ``no DCGM data``,
    ``unavailable (<why>)``, with `` so far`` while the window is still open; ``-`` without one."""
    if not isinstance(telemetry, dict) or not telemetry.get("verdict"):
        return "-"
    verdict = telemetry["verdict"]
    findings = ", ".join(str(f) for f in telemetry.get("findings") or [])
    noted = ", ".join(str(f) for f in telemetry.get("noted") or [])
    if verdict == TELEMETRY_CORROBORATES:
        line = f"corroborates ({findings})" if findings else "corroborates"
    elif verdict == TELEMETRY_CLEAN:
        line = f"clean (noted: {noted})" if noted else "clean"
    elif verdict == TELEMETRY_NO_DATA:
        line = "no DCGM data"
    elif verdict == TELEMETRY_UNAVAILABLE:
        reason = str(telemetry.get("reason") or "").strip()
        line = f"unavailable ({reason[:80]})" if reason else "unavailable"
    else:
        line = str(verdict)
    if verdict != TELEMETRY_UNAVAILABLE and telemetry.get("final") is False:
        line += " so far"
    return strip_format_characters(line)

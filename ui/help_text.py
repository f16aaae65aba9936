"""The help topics: markdown files in assets/help/, one per topic, read as text (no Qt, no torch).

A topic's name is its file's stem (`knobs` is assets/help/knobs.md); its first line is a `# ` heading whose text
is the topic's one-line summary. `kvscope help` (app/help.py) prints them; a Help menu can show `topic_text(name)`.
"""

from __future__ import annotations

import re
from pathlib import Path

HELP_DIR = Path(__file__).resolve().parent.parent / "assets" / "help"

_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")


def topics() -> list[tuple[str, str]]:
    """Every topic as (name, one-line summary), sorted by name."""
    out = []
    for path in sorted(HELP_DIR.glob("*.md")):
        with path.open(encoding="utf-8") as f:
            first = f.readline().strip()
        out.append((path.stem, first.lstrip("#").strip()))
    return out


def topic_text(name: str) -> str:
    """The markdown text of topic `name`; KeyError naming the known topics when there is no such topic."""
    path = HELP_DIR / f"{name}.md"
    if not _NAME.fullmatch(name) or not path.is_file():  # the pattern keeps a name inside HELP_DIR
        known = ", ".join(n for n, _ in topics())
        raise KeyError(f"no help topic {name!r} (topics: {known})")
    return path.read_text(encoding="utf-8")

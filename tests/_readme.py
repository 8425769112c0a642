"""The README's commands and snippets, as the doc test (tests/test_readme_commands.py) and CI read them.

Standard library only: CI calls it before anything is installed, to run the README's two
fresh-machine commands exactly as written there::

    python tests/_readme.py first     # the first command of the README's bash blocks (set up, run the main job)
    python tests/_readme.py second    # the second (set up, run the tests)
    python tests/_readme.py all       # every command, one a line

A command is a logical line of a ```bash block: continuation lines (a trailing backslash)
joined, comments (a ``#`` outside quotes, at the start of a word) removed, blank lines
skipped.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"

_FENCE = re.compile(r"^\s*```\s*([\w+-]*)\s*$")


def fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """Every fenced block: (language, its text, the line number of its first line of text)."""
    blocks, lang, start, body = [], None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if lang is None:
            if match:
                lang, start, body = match.group(1).lower(), number + 1, []
        elif match and not match.group(1):
            blocks.append((lang, "\n".join(body), start))
            lang = None
        else:
            body.append(line)
    if lang is not None:
        raise ValueError(f"README.md: the block opened at line {start - 1} is never closed")
    return blocks


def strip_comment(line: str) -> str:
    """``line`` without its shell comment: a ``#`` outside quotes that starts a word."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
            elif ch == "\\" and quote == '"':
                continue
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands_of(block: str) -> list[str]:
    """The logical command lines of one shell block."""
    commands, pending = [], ""
    for raw in block.splitlines():
        line = strip_comment(raw)
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        line = (pending + line.strip()).strip()
        pending = ""
        if line:
            commands.append(line)
    if pending.strip():
        commands.append(pending.strip())
    return commands


def readme_text(path: Path = README) -> str:
    return path.read_text(encoding="utf-8")


def bash_commands(text: str | None = None) -> list[str]:
    """Every command of the README's ```bash (or ```sh, ```shell) blocks, in order."""
    text = readme_text() if text is None else text
    return [c for lang, body, _ in fenced_blocks(text) if lang in ("bash", "sh", "shell") for c in commands_of(body)]


def blocks_of(lang: str, text: str | None = None) -> list[tuple[str, int]]:
    """The README's blocks in one language (``python``, ``toml``): (text, first line)."""
    text = readme_text() if text is None else text
    return [(body, line) for kind, body, line in fenced_blocks(text) if kind == lang]


def inline_code(text: str | None = None) -> list[str]:
    """The README's inline code spans outside fenced blocks (single backticks)."""
    text = readme_text() if text is None else text
    outside, inside = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            outside.append(line)
    prose = "\n".join(outside)
    return [m.group(1).strip() for m in re.finditer(r"(?<!`)`([^`\n]+)`(?!`)", prose)]


def main(argv: list[str]) -> int:
    commands = bash_commands()
    which = argv[0] if argv else ""
    if which == "first" and commands:
        print(commands[0])
    elif which == "second" and len(commands) > 1:
        print(commands[1])
    elif which == "all":
        print("\n".join(commands))
    else:
        print("usage: python tests/_readme.py first|second|all", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""docs/conformance.md's tables, from the conformance suite's own parameters (tests/_matrix.py).

    python docs/repro/conformance_table.py            # print the tables
    python docs/repro/conformance_table.py --write    # put them into docs/conformance.md between the markers

tests/test_conformance_docs.py fails when docs/conformance.md's tables differ from what this prints, so a new
registry entry, surface, model kind or obligation cannot land without its row.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from _matrix import MODEL_KINDS, OBLIGATIONS, SURFACES, refusal, strategies  # noqa: E402

BEGIN, END = "<!-- matrix: begin (docs/repro/conformance_table.py) -->", "<!-- matrix: end -->"


def tables() -> str:
    columns = [(surface, kind) for surface in SURFACES for kind in MODEL_KINDS]
    lines = ["| strategy | " + " | ".join(f"{surface}: {kind}" for surface, kind in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for strategy in strategies():
        cells = []
        for surface, _ in columns:
            reason = refusal(strategy, surface)
            cells.append("refused: " + reason if reason else "green")
        lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
    lines += ["", "| obligation | " + " | ".join(SURFACES) + " | what is checked |",
              "|---|" + "---|" * len(SURFACES) + "---|"]
    for name, (where, what) in OBLIGATIONS.items():
        marks = " | ".join("checked" if surface in where else "" for surface in SURFACES)
        lines.append(f"| {name} | {marks} | {what} |")
    lines += ["", "| surface | what it is |", "|---|---|"]
    lines += [f"| {name} | {what} |" for name, what in SURFACES.items()]
    lines += ["", "| model kind | what it is |", "|---|---|"]
    lines += [f"| {name} | {what} |" for name, what in MODEL_KINDS.items()]
    return "\n".join(lines)


def documented(text: str) -> str:
    """The tables between the markers of ``text``."""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


if __name__ == "__main__":
    if "--write" in sys.argv:
        doc = ROOT / "docs" / "conformance.md"
        text = doc.read_text()
        head, rest = text.split(BEGIN, 1)
        doc.write_text(f"{head}{BEGIN}\n{tables()}\n{END}{rest.split(END, 1)[1]}")
    else:
        print(tables())

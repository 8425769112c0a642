"""docs/conformance.md's tables are the conformance suite's own parameters (docs/repro/conformance_table.py)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_documented_matrix_is_the_suites() -> None:
    spec = importlib.util.spec_from_file_location("conformance_table", ROOT / "docs/repro/conformance_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    doc = (ROOT / "docs" / "conformance.md").read_text()
    assert table.documented(doc) == table.tables(), \
        "docs/conformance.md is stale: python docs/repro/conformance_table.py --write"

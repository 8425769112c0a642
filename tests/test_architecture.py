"""The structure, checked by machine (docs/architecture.md): no import cycles between modules, no
strategy-name branches outside the registry and the strategies' own packages, no module past 500 lines.

The layers themselves are import-linter's contract in pyproject.toml (``lint-imports``, run by CI).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import grimp
import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # the tomli backport, a dependency of dptrain before 3.11
    import tomli as tomllib

SRC = Path(__file__).resolve().parents[1] / "src" / "dptrain"


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("dptrain", exclude_type_checking_imports=False)  # TYPE_CHECKING imports count


def _cycles(graph) -> list[list[str]]:
    """The import cycles among dptrain's modules: Tarjan's strongly connected components of two or more."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:  # iterative enough for a package of ~200 modules
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph.find_modules_directly_imported_by(module):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_itself_back(graph):
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    class Two:
        modules = {"a", "b", "c"}

        @staticmethod
        def find_modules_directly_imported_by(module):
            return {"a": {"b"}, "b": {"a"}, "c": {"a"}}[module]

    assert _cycles(Two) == [["a", "b"]]


# What "branching on a strategy's name" looks like; the strategies' own packages and the registry may.
NAME_BRANCH = re.compile(r"strategy *(==|!=|in \(|in \[|not in)")
ALLOWED = ("strategies/", "ddp/", "zero/", "ps/", "gossip/", "localsgd/", "diloco/")
# A benchmark measures named strategies by design (bench/diloco.py's variants "ddp", "localsgd", ...).
MEASURES_BY_NAME = ("bench/",)


def _registered_literal() -> re.Pattern:
    """A registered strategy's name, quoted, compared or tested for membership (``== "zero3"``, ``in ("ddp",``)."""
    from dptrain.strategies import REGISTRY

    names = "|".join(map(re.escape, REGISTRY))
    return re.compile(rf"""(==|!=|\bin) *[(\[{{]?["']({names})["']|["']({names})["'] *(==|!=)""")


def _lines(pattern: re.Pattern, allowed: tuple[str, ...], suffix: str = "*.py") -> list[str]:
    return [f"{path.relative_to(SRC)}:{n}: {line.strip()}"
            for path in sorted(SRC.rglob(suffix)) if not str(path.relative_to(SRC)).startswith(allowed)
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]


def test_no_code_outside_the_registry_branches_on_a_strategy_name():
    branches = _lines(NAME_BRANCH, ALLOWED) + _lines(_registered_literal(), ALLOWED + MEASURES_BY_NAME)
    assert branches == [], "ask the registry entry (dptrain.strategies.get_strategy) instead:\n" + "\n".join(branches)


def test_the_pages_scripts_name_no_strategy():
    """A page's script gets the strategies, their labels and their roles from the page's data (the registry's)."""
    from dptrain.strategies import REGISTRY

    named = re.compile(rf"""\b({'|'.join(map(re.escape, REGISTRY))}|hsdp)\b""")
    assert _lines(named, (), "*.js") == []


def test_the_name_checks_catch_a_name_branch():
    literal = _registered_literal()
    assert literal.search('if name == "ddp":') and literal.search('x in ("ddp", "zero1")')
    assert literal.search('"zero3" == strategy') and NAME_BRANCH.search('if strategy == name:')
    assert literal.search('distributed.strategy = "zero3" writes shards') is None  # a name in prose is not a branch


def test_no_module_is_past_500_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}, f"split these along a concept: {long}"


def test_every_package_has_its_place_in_the_layers():
    """A package the contract does not name is unconstrained: each top-level module must be in a layer."""
    pyproject = tomllib.loads((SRC.parents[1] / "pyproject.toml").read_text())
    layers = pyproject["tool"]["importlinter"]["contracts"][0]["layers"]
    named = {name.strip() for layer in layers for name in layer.split("|")}
    top = {f"dptrain.{p.stem if p.is_file() else p.name}" for p in SRC.iterdir()
           if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()}
    assert top - named == set(), "add these to a layer in pyproject.toml (docs/architecture.md)"

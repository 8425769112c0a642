"""How a benchmark module becomes ``dptrain bench NAME``: a click command that owns its options.

Each benchmark module defines ``main`` with :func:`bench_command` and its ``click.option``\\ s;
``dptrain bench`` (:class:`BenchGroup`) imports the module only to run it or show its
``--help``, and lists every benchmark from its module docstring, read without importing it
(the modules import torch: a second at every ``dptrain bench --help``). ``python -m
dptrain.bench.NAME`` runs the same command. :class:`Variadic` keeps argparse's
``nargs="+"`` spelling that the docs use (``--caps 1 25``).

This module imports nothing heavy: ``dptrain --help`` loads it.
"""

from __future__ import annotations

import ast
import importlib.util
import textwrap
from collections.abc import Callable

import click

# dptrain bench NAME -> the module whose ``main`` runs it
BENCHMARKS = {"ddp": "dptrain.bench.ddp", "allocator": "dptrain.bench.allocator",
              "run-overhead": "dptrain.bench.run_overhead", "comm": "dptrain.bench.comm",
              "zero": "dptrain.bench.zero", "plan": "dptrain.bench.plan", "cluster": "dptrain.bench.cluster",
              "cluster-zero": "dptrain.bench.cluster_zero",
              "compression": "dptrain.bench.compression", "async": "dptrain.bench.async_study",
              "compression-link": "dptrain.bench.compression_link", "gpu": "dptrain.bench.gpu",
              "faults": "dptrain.bench.faults", "loader": "dptrain.bench.loader",
              "ddp-timeline": "dptrain.bench.ddp_timeline", "diloco": "dptrain.bench.diloco",
              "live": "dptrain.bench.live", "bucket-cost": "dptrain.bench.bucket_cost"}


def summary(doc: str | None) -> str:
    """A module docstring's first paragraph on one line, without its reST markup."""
    first = (doc or "").strip().split("\n\n")[0]
    return " ".join(first.split()).replace("``", "")


def module_summary(module: str) -> str:
    """:func:`summary` of a module's docstring, read from its source without importing the module."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return ""
    with open(spec.origin, encoding="utf-8") as f:
        return summary(ast.get_docstring(ast.parse(f.read())))


def _listed(text: str) -> str:
    """A summary as ``dptrain bench --help`` lists it: without the "Benchmark: " every module starts with."""
    return text.removeprefix("Benchmark: ")


class Variadic(click.Option):
    """An option that takes one or more values after one flag, as argparse's ``nargs="+"``: ``--caps 1 4 25``.

    Its value is a tuple (``multiple=True``); :class:`VariadicCommand` turns the spelling above
    into ``--caps 1 --caps 4 --caps 25`` before click parses it.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs["multiple"] = True
        super().__init__(*args, **kwargs)
        self.metavar = self.metavar or f"{self.type.name.upper()} [...]"


class VariadicCommand(click.Command):
    """A click command whose :class:`Variadic` options take every value up to the next option."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            spread = spread_variadic(args, self._variadic_flags())
        except click.UsageError as e:
            e.ctx = ctx  # the usage line and "Try ... --help" under the error
            raise
        return super().parse_args(ctx, spread)

    def _variadic_flags(self) -> set[str]:
        return {flag for p in self.params if isinstance(p, Variadic) for flag in p.opts}


def spread_variadic(args: list[str], flags: set[str]) -> list[str]:
    """``--caps 1 4 --rounds 2`` -> ``--caps 1 --caps 4 --rounds 2`` for the flags in ``flags``."""
    out: list[str] = []
    flag, values = None, 0
    for arg in args:
        if flag is not None and not _is_option(arg):
            out += [flag, arg]
            values += 1
            continue
        if flag is not None and values == 0:
            raise click.UsageError(f"{flag} needs at least one value, e.g. {flag} A B")
        flag, values = None, 0
        name, eq, value = arg.partition("=")
        if name in flags and not eq:
            flag = name
        else:
            out.append(arg)
            flag, values = (name, 1) if name in flags else (None, 0)  # --caps=1 4: 4 joins it too
    if flag is not None and values == 0:
        raise click.UsageError(f"{flag} needs at least one value, e.g. {flag} A B")
    return out


def _is_option(arg: str) -> bool:
    """Whether an argument is a flag rather than a value: starts with '-' and is not a number like -1.5."""
    if not arg.startswith("-") or arg == "-":
        return False
    try:
        float(arg)
    except ValueError:
        return True
    return False


def bench_command(doc: str | None) -> Callable[[Callable], click.Command]:
    """The decorator a benchmark's ``main`` takes: a command whose help is its module's first paragraph."""
    return click.command(cls=VariadicCommand, help=summary(doc), context_settings={
        "help_option_names": ["-h", "--help"], "show_default": True})


class BenchGroup(click.Group):
    """``dptrain bench``: the commands of :data:`BENCHMARKS`, each imported when it is run or asked for help."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(BENCHMARKS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in BENCHMARKS:
            return None
        return importlib.import_module(BENCHMARKS[name]).main

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names))
        rows = [(name, textwrap.shorten(_listed(module_summary(BENCHMARKS[name])), limit, placeholder="..."))
                for name in names]
        with formatter.section("Benchmarks"):
            formatter.write_dl(rows)

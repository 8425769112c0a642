"""Run torch's own DDP tests (from the installed wheel) with dptrain's DistributedDataParallel patched in.

Driven as torch's test/distributed/test_distributed_spawn.py drives them: BACKEND=gloo,
WORLD_SIZE=2, a TEMP_DIR for the file store, one spawned process per rank
(``DPTRAIN_CONFORMANCE_START=fork``: forked from this process, as torch's
test_distributed_fork.py ran them, about 0.5 s a test instead of 4; only from a plain
process such as this script's, never from a pytest worker). The class is patched in every rank (``torch.nn.parallel.DistributedDataParallel``,
``torch.nn.parallel.distributed.DistributedDataParallel`` and the test module's own name).

    python tests/conformance/torch_ddp_suite.py dptrain|torch [test names... | --named | --other]

prints one line per test, ``name outcome``, and a summary. Without names it runs all 104
DDP tests (``--named``: the 76 named ``test_ddp*``/``test_DistributedDataParallel*``;
``--other``: the 28 others that name DDP, :func:`other_ddp_test_names`), about 8 and 2
minutes. tests/test_torch_conformance.py runs the lists of tests expected to pass.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import tempfile
import unittest


def _patch(which: str) -> None:
    if which != "dptrain":
        return
    import torch.nn.parallel
    import torch.nn.parallel.distributed
    import torch.testing._internal.distributed.distributed_test as dt

    from dptrain import DistributedDataParallel

    torch.nn.parallel.DistributedDataParallel = DistributedDataParallel
    torch.nn.parallel.distributed.DistributedDataParallel = DistributedDataParallel
    dt.DistributedDataParallel = DistributedDataParallel
    if hasattr(dt, "DDP"):
        dt.DDP = DistributedDataParallel


os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="dptrain-conformance-"))
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402


class Conformance(TestDistBackend, DistributedTest._DistTestBase):
    """torch's TestDistBackendWithSpawn, whose spawned ranks patch the class named by DPTRAIN_CONFORMANCE in first."""

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        _patch(os.environ.get("DPTRAIN_CONFORMANCE", "dptrain"))
        super()._run(rank, test_name, file_name, pipe, **kwargs)

    def setUp(self):
        super().setUp()
        if os.environ.get("DPTRAIN_CONFORMANCE_START") == "fork":  # as torch's test_distributed_fork.py ran them
            import torch.multiprocessing

            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()


def ddp_test_names(cls) -> list[str]:
    return sorted(n for n in dir(cls) if n.startswith(("test_ddp", "test_DistributedDataParallel")))


def other_ddp_test_names() -> list[str]:
    """The tests of ``_DistTestBase`` not named ``test_ddp*``/``test_DistributedDataParallel*`` whose source, decorators
    included, names DDP (``DistributedDataParallel`` or ``DDP``) directly or through a ``self.`` helper that does.

    Read from the installed harness's source (issue 41 counted 28 in torch 2.13 this way); two of them only mention
    DDP (a helper's name, a comment) and construct none: the conformance test lists them so.
    """
    import torch.testing._internal.distributed.distributed_test as dt

    source = open(dt.__file__).read()
    lines = source.splitlines()
    base = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == "_DistTestBase")
    methods = {f.name: "\n".join(lines[min([d.lineno for d in f.decorator_list] + [f.lineno]) - 1:f.end_lineno])
               for f in base.body if isinstance(f, ast.FunctionDef)}
    users = {name for name, text in methods.items() if re.search(r"DistributedDataParallel|DDP", text)}
    grown = True
    while grown:  # through helpers: a method that calls self.<a user> is a user
        callers = {name for name, text in methods.items() if name not in users
                   and any(re.search(rf"self\.{re.escape(u)}\b", text) for u in users)}
        users |= callers
        grown = bool(callers)
    named = set(ddp_test_names(dt.DistributedTest._DistTestBase))
    return sorted(n for n in users if n.startswith("test") and n not in named)


def run(which: str, names: list[str]) -> dict[str, str]:
    os.environ["DPTRAIN_CONFORMANCE"] = which
    cls = Conformance
    outcomes: dict[str, str] = {}

    class Result(unittest.TestResult):
        def addSuccess(self, test): outcomes[test._testMethodName] = "passed"
        def addFailure(self, test, err): outcomes[test._testMethodName] = "failed: " + str(err[1]).splitlines()[-1][:200]
        def addError(self, test, err): outcomes[test._testMethodName] = "error: " + str(err[1]).splitlines()[-1][:200]
        def addSkip(self, test, reason): outcomes[test._testMethodName] = "skipped: " + reason[:100]

    if not names or names in (["--named"], ["--other"]):
        names = ((ddp_test_names(cls) if names != ["--other"] else [])
                 + (other_ddp_test_names() if names != ["--named"] else []))
    suite = unittest.TestSuite(cls(n) for n in names)
    suite.run(Result())
    return outcomes


if __name__ == "__main__":
    results = run(sys.argv[1], sys.argv[2:])
    for name, outcome in sorted(results.items()):
        print(name, outcome)
    kinds = [o.split(":")[0] for o in results.values()]
    print({k: kinds.count(k) for k in sorted(set(kinds))})

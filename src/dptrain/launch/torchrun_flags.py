"""torchrun's flags on ``dptrain launch``: a torchrun command line with ``torchrun`` replaced by ``dptrain launch``.

:func:`split_torchrun_flags` reads the options before the script, as torchrun's parser
(``torch.distributed.run.get_args_parser``) would: both spellings (``--nproc-per-node`` and
``--nproc_per_node``), ``--flag=value`` and ``--flag value``, ``-r3``. A torchrun flag with a
``dptrain launch`` option of its own becomes that option (``--nproc-per-node`` is ``--nproc``,
``--log-dir`` is ``--run-dir``); the others come back in a :class:`TorchrunFlags` for the command
to act on; a flag dptrain cannot honour is refused by name (:class:`TorchrunFlagError`), with what
to use instead. Everything after the script is the script's, untouched.

What each flag does is in docs/launch.md ("torchrun's flags").
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["TorchrunFlags", "TorchrunFlagError", "split_torchrun_flags", "nproc_per_node", "nnodes_count",
           "terminal_ranks"]

RUN_TORCHRUN = "run torchrun itself for it"

# torchrun's flags (dash spelling) that are dptrain launch's own options under another name or with other values
# (--node-rank, --rdzv-endpoint, --max-restarts and -m/--module are the same in both)
SAME_AS = {"--nproc-per-node": "--nproc", "--nnodes": "--nnodes", "--log-dir": "--run-dir",
           "--start-method": "--start-method"}
# torchrun's flags that dptrain launch acts on itself: name -> takes a value
OWN_WAY = {"--standalone": False, "--run-path": False, "--rdzv-backend": True, "--rdzv-id": True,
           "--master-addr": True, "--master-port": True, "--tee": True, "--redirects": True,
           "--local-ranks-filter": True, "--role": True, "--rdzv-conf": True, "--monitor-interval": True,
           "--local-addr": True}
SHORT = {"-t": "--tee", "-r": "--redirects"}
# torchrun's flags dptrain launch refuses: name -> (takes a value, why and what to do instead)
REFUSED = {
    "--no-python": (False, "dptrain launch runs Python scripts and modules (its workers record their Python "
                           "tracebacks); run a non-Python program with torchrun itself"),
    "--event-log-handler": (True, f"torchrun's event handlers are not wired into dptrain launch; {RUN_TORCHRUN}"),
    "--logs-specs": (True, "dptrain launch writes each rank's output to RUN_DIR/logs/rank<r>.console; drop it, or "
                           + RUN_TORCHRUN),
    "--numa-binding": (True, f"dptrain launch binds no worker to CPUs; {RUN_TORCHRUN}"),
    "--signals-to-handle": (True, "dptrain launch stops its workers on SIGINT and SIGTERM; drop it, or "
                                  + RUN_TORCHRUN),
    "--shutdown-timeout": (True, "dptrain launch gives a stopped worker 5 s before SIGKILL; drop it, or "
                                 + RUN_TORCHRUN),
    "--virtual-local-rank": (False, f"dptrain launch gives each worker its own LOCAL_RANK; {RUN_TORCHRUN}"),
    "--duplicate-stdout-filters": (True, f"grep RUN_DIR/logs/rank<r>.console instead, or {RUN_TORCHRUN}"),
    "--duplicate-stderr-filters": (True, f"grep RUN_DIR/logs/rank<r>.console instead, or {RUN_TORCHRUN}"),
}
BACKENDS = ("c10d", "static")  # rendezvous backends torchrun's agent runs for dptrain launch
STD = re.compile(r"^[0-3]$|^\d+:[0-3](,\d+:[0-3])*$")  # torchrun's --tee/--redirects values
DEVICE_COUNTS = ("auto", "cpu", "gpu", "xpu")  # torchrun's non-numeric --nproc-per-node values


class TorchrunFlagError(ValueError):
    """A torchrun flag ``dptrain launch`` refuses, or a bad value for one: one line, exit 2."""


@dataclass(frozen=True)
class TorchrunFlags:
    """What torchrun's flags ask of ``dptrain launch`` beyond its own options (defaults: not given)."""

    standalone: bool = False  # this machine alone; --rdzv-backend/-endpoint/-id ignored, as torchrun does
    rdzv_backend: str | None = None  # c10d or static
    rdzv_id: str | None = None  # the job's id: TORCHELASTIC_RUN_ID
    master_addr: str | None = None  # the static rendezvous: MASTER_ADDR
    master_port: int | None = None  # ... and MASTER_PORT
    role: str | None = None  # ROLE_NAME
    tee: str | None = None  # torchrun's -t: 0 or 3, for all ranks or as RANK:VALUE,...
    redirects: str | None = None  # torchrun's -r, the same form
    local_ranks_filter: str | None = None  # the ranks whose output reaches the terminal
    monitor_interval_s: float | None = None  # how often torchrun's agent looks at its workers
    agent_args: tuple[str, ...] = ()  # passed to torchrun's agent when it runs the workers
    notes: tuple[str, ...] = field(default=())  # what was ignored, as torchrun ignores it: said on stderr

    @property
    def output(self) -> bool:
        """Whether any of --tee, --redirects, --local-ranks-filter was given."""
        return (self.tee, self.redirects, self.local_ranks_filter) != (None, None, None)


def split_torchrun_flags(argv: list[str], own: Mapping[str, bool]) -> tuple[list[str], TorchrunFlags]:
    """``argv`` with torchrun's flags turned into ``dptrain launch``'s (``own``: option -> takes a value), and
    what remains of them; everything from the script on is left as it is. Raises :class:`TorchrunFlagError`."""
    out: list[str] = []
    seen: dict[str, object] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--" or not token.startswith("-") or token == "-":
            return out + argv[i:], _flags(seen)
        name, value, i = _read(argv, i, own)
        if name in SAME_AS:
            out += _same_as(name, value, seen)
        elif name in own:
            out += [name] if value is None else [name, value]
            seen.setdefault(name, value)
        else:
            seen[name] = True if value is None else value
    return out, _flags(seen)


def _read(argv: list[str], i: int, own: Mapping[str, bool]) -> tuple[str, str | None, int]:
    """The option at ``argv[i]`` in its dash spelling, its value (None for a flag), and where the next one starts."""
    token = argv[i]
    if token[:2] in SHORT and len(token) > 2 and token not in own:  # -r3
        return SHORT[token[:2]], token[2:], i + 1
    name, eq, value = token.partition("=")
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
    name = SHORT.get(name, name)
    takes = _takes_value(name, own)
    if not takes:
        if eq:
            raise TorchrunFlagError(f"{token}: {name} is a flag and takes no value")
        return name, None, i + 1
    if eq:
        return name, value, i + 1
    if i + 1 >= len(argv):
        raise TorchrunFlagError(f"{name} needs a value, and the command line ends after it (no script either)")
    return name, argv[i + 1], i + 2


def _takes_value(name: str, own: Mapping[str, bool]) -> bool:
    """Whether option ``name`` takes a value; refused and unknown options raise here, by name."""
    if name in SAME_AS:
        return True
    if name in own:
        return own[name]
    if name in OWN_WAY:
        return OWN_WAY[name]
    if name in REFUSED:
        raise TorchrunFlagError(f"{name} is torchrun's, and dptrain launch does not support it: {REFUSED[name][1]}")
    known = sorted({*own, *SAME_AS, *OWN_WAY})
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]}?" if close else "; see dptrain launch --help and docs/launch.md"
    raise TorchrunFlagError(f"no option {name} (options go before the script, the script's own after it){hint}")


def _same_as(name: str, value: str | None, seen: dict[str, object]) -> list[str]:
    """A torchrun flag as ``dptrain launch``'s option of the same meaning, its value translated."""
    if name in seen:
        raise TorchrunFlagError(f"{name} is given twice; give it once")
    seen[name] = value
    if name == "--nproc-per-node":
        value = str(nproc_per_node(value))
    elif name == "--nnodes":
        value = str(nnodes_count(value))
    elif name == "--start-method" and value in ("spawn", "fork"):
        value = "exec"  # torchrun starts a script as a fresh interpreter whatever this says: exec is that
    return [SAME_AS[name], value]


def nproc_per_node(value: str) -> int:
    """torchrun's ``--nproc-per-node``: a number, or ``cpu`` (the cores this process may use), ``gpu``/``xpu``
    (the devices; an error when there are none) or ``auto`` (the accelerators, else the cores)."""
    if value.strip().lstrip("-").isdigit():
        return int(value)
    if value not in DEVICE_COUNTS:
        raise TorchrunFlagError(f"--nproc-per-node {value!r} is not a number of workers per node, nor one of "
                                f"{', '.join(DEVICE_COUNTS)}; give a number, e.g. --nproc-per-node 2")
    if value == "cpu":
        return _cpu_count()
    import torch  # only for a device count

    if value == "auto":
        return torch.accelerator.device_count() if torch.accelerator.is_available() else _cpu_count()
    device = torch.cuda if value == "gpu" else torch.xpu
    if not device.is_available():
        raise TorchrunFlagError(f"--nproc-per-node {value}: this machine has no {value.upper()} that torch can "
                                "use; give a number of workers, or auto (the cores when there is no accelerator)")
    return device.device_count()


def _cpu_count() -> int:
    """The cores this process may run on, as torchrun counts them (``torch._utils.cpu_count``)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def nnodes_count(value: str) -> int:
    """torchrun's ``--nnodes``: ``N``, or ``MIN:MAX`` with MIN == MAX (a fixed count); elastic ranges are refused."""
    low, _, high = value.partition(":")
    if not low.isdigit() or high and not high.isdigit():
        raise TorchrunFlagError(f"--nnodes {value!r} is not N or MIN:MAX; give the number of machines, e.g. "
                                "--nnodes 2")
    if high and int(high) != int(low):
        raise TorchrunFlagError(f"--nnodes {value}: dptrain launch runs a fixed number of machines, not an "
                                f"elastic range; give --nnodes {high} (every machine), or run torchrun itself for "
                                "elastic membership")
    return int(low)


def _flags(seen: dict[str, object]) -> TorchrunFlags:
    """The flags read, checked, as a :class:`TorchrunFlags`."""
    if "--log-dir" in seen and "--run-dir" in seen:
        raise TorchrunFlagError("--log-dir and --run-dir both say where the logs go; give one")
    if "--ranks" in seen and any(n in seen for n in ("--tee", "--redirects", "--local-ranks-filter")):
        raise TorchrunFlagError("--ranks and torchrun's --tee/--redirects/--local-ranks-filter both choose the "
                                "ranks shown on this terminal; give one")
    backend = seen.get("--rdzv-backend")
    if backend is not None and backend not in BACKENDS:
        what = "etcd's rendezvous is not supported by dptrain launch" if str(backend).startswith("etcd") else \
            "no rendezvous backend dptrain launch knows"
        raise TorchrunFlagError(f"--rdzv-backend {backend}: {what}; use --rdzv-backend c10d (a store on one of "
                                "the machines, at --rdzv-endpoint HOST:PORT), or run torchrun itself for it")
    for name in ("--tee", "--redirects"):
        _check_std(name, seen.get(name))
    port = seen.get("--master-port")
    if port is not None and not (str(port).isdigit() and 0 < int(port) < 65536):
        raise TorchrunFlagError(f"--master-port {port!r} is not a TCP port; give a number from 1 to 65535")
    monitor = _positive(seen.get("--monitor-interval"), "--monitor-interval")
    agent = [f"{name}={seen[name]}" for name in ("--rdzv-conf", "--local-addr", "--role") if name in seen]
    notes = []
    if seen.get("--standalone"):
        ignored = [n for n in ("--rdzv-backend", "--rdzv-id") if n in seen]
        if ignored:
            notes.append(f"--standalone: {' and '.join(ignored)} ignored, as torchrun ignores them")
    return TorchrunFlags(standalone=bool(seen.get("--standalone")), rdzv_backend=backend,
                         rdzv_id=seen.get("--rdzv-id"), master_addr=seen.get("--master-addr"),
                         master_port=None if port is None else int(port), role=seen.get("--role"),
                         tee=seen.get("--tee"), redirects=seen.get("--redirects"),
                         local_ranks_filter=seen.get("--local-ranks-filter"), monitor_interval_s=monitor,
                         agent_args=tuple(agent) + ((f"--monitor-interval={monitor}",) if monitor else ()),
                         notes=tuple(notes))


def _positive(value: object, name: str) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(str(value))
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise TorchrunFlagError(f"{name} {value!r} is not a positive number of seconds; e.g. {name} 0.5")
    return seconds


def _check_std(name: str, value: object) -> None:
    """torchrun's stream selector: 0 or 3 (for every rank, or ``RANK:VALUE,...``); 1 and 2 are refused."""
    if value is None:
        return
    if not STD.match(str(value)):
        raise TorchrunFlagError(f"{name} {value!r} is not torchrun's form: 0 (none), 3 (stdout and stderr), or "
                                "LOCAL_RANK:VALUE,... (e.g. 0:3,1:0)")
    if re.search(r"(^|:)[12](,|$)", str(value)):
        raise TorchrunFlagError(f"{name} {value}: dptrain launch keeps a rank's stdout and stderr together, so it "
                                f"takes 0 or 3 (both streams), not 1 (stdout) or 2 (stderr); give {name} 3")


def _std_ranks(value: str | None, nproc: int) -> set[int]:
    """The local ranks a --tee/--redirects value selects (value 3)."""
    if value is None:
        return set()
    if ":" not in value:
        return set(range(nproc)) if value == "3" else set()
    pairs = dict(part.split(":") for part in value.split(","))
    return {int(r) for r, v in pairs.items() if v == "3" and int(r) < nproc}


def terminal_ranks(flags: TorchrunFlags, nproc: int) -> frozenset[int] | None:
    """The local ranks whose output reaches this terminal, prefixed ``[rank r]`` (``launch.output``), as torchrun's
    --tee, --redirects and --local-ranks-filter choose them; None when none of those was given (dptrain's
    default: rank 0's output, unprefixed). Every rank's output is in RUN_DIR/logs/rank<r>.console either way."""
    if not flags.output:
        return None
    teed, redirected = _std_ranks(flags.tee, nproc), _std_ranks(flags.redirects, nproc)
    shown = {r for r in range(nproc) if r in teed or r not in redirected}  # what torchrun prints
    if flags.local_ranks_filter is not None:
        try:
            chosen = {int(r) for r in flags.local_ranks_filter.split(",") if r.strip()}
        except ValueError:
            raise TorchrunFlagError(f"--local-ranks-filter {flags.local_ranks_filter!r} is not a comma-separated "
                                    "list of local ranks, e.g. 0,1") from None
        shown &= chosen
    return frozenset(shown)

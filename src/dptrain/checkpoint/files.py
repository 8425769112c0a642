"""Checkpoints that are complete or absent, checked before they are trusted.

Layout of a run directory's ``checkpoints/``::

    step_00000100/
        model.pt        the model's state (replicated, so rank 0's): get_model_state_dict
        optimizer.pt    the optimizer's: get_optimizer_state_dict, flattened (state.<fqn>.<key>,
                        param_groups.<fqn>.<name>)
        trainer.pt      step, loss scaler, and every rank's RNG states
        meta.json       written last: step, world size, strategy, global batch, the config's
                        identity and its hash, and a sha256 of each file above
    step_00000200/ ...

A run whose strategy's checkpoint layout is ``sharded`` (ZeRO's stages) writes ``sharded/`` (every
rank's row chunks of the parameters and optimizer state as DTensors, in
``torch.distributed.checkpoint``'s format, loadable on any world size:
:mod:`dptrain.zero.checkpoint`) instead of ``model.pt`` and ``optimizer.pt``;
``meta.json`` then says ``"format": "sharded"`` and holds a checksum of every file
under ``sharded/`` too. Both use the same names for the same state, so a run may
change between a replicated and a sharded strategy when it resumes (:mod:`dptrain.checkpoint.state`).
A parameter-server run (layout ``ps``) writes ``ps/`` instead: each server's
shard and the workers' positions, ``"format": "ps"`` (:mod:`dptrain.ps.checkpoint`).

**Atomic**: rank 0 writes into ``.step_00000200.tmp/`` and renames it to
``step_00000200/`` only when every file, ``meta.json`` last, is written and flushed to
disk; a crash mid-save leaves a ``.tmp`` directory that the next run deletes, never a
checkpoint that looks complete. Older checkpoints beyond ``keep_last`` are deleted only
after the new one is in place, each renamed to a hidden trash name first, and never
while a reader (``dptrain consolidate``) holds it ([Note: rotation and readers]).

**Trusted by content, not by name**: only a real directory (not a link) whose name is
``step_`` and eight ASCII digits, holding a ``meta.json`` that records that same step,
counts as a checkpoint (:func:`scan_checkpoints`); anything else under ``checkpoints/`` (a
copy, a link, a file, a name in other digits) is neither resumed from nor rotated away,
and is named in a note. Rotation never deletes the checkpoint it has just written.

**Checked**: before resuming, the checkpoint's files are hashed against ``meta.json``
(a truncated or edited file is caught) and its config identity (the fields that decide
what a step computes, ``config.identity``) is compared with the current config's; a
mismatch is a :class:`CheckpointError` naming the differing keys, which the CLI reports
with exit code 2 before anything is written.

Data position needs no state of its own: the loader's position is a function of the
step (``ShardedLoader``). A replicated model's state is saved by rank 0 alone (RNG
states are gathered to it), so saving needs no shared file system; a sharded one is
written by every rank, and resuming reads the files on every rank, so both need one
across nodes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import random
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dptrain.config.loader import identity_hash as hash_identity
from dptrain.config.loader import normalize_identity
from dptrain.utils.atomic import TRASH, remove_tree
from dptrain.utils.files import UnsafePath, describe, inside, open_file, read_bytes

__all__ = ["SHARDED", "CheckpointError", "save_checkpoint", "load_checkpoint", "find_latest", "scan_checkpoints",
           "verify_checkpoint", "verify_files", "prune_checkpoints", "reading", "remove_partial", "rng_state",
           "set_rng_state", "fresh_dir", "check_readable", "layout_mismatch"]

# A checkpoint's subdirectory that every rank writes into (the sharded layout, :mod:`dptrain.checkpoint.sharded`).
# Named here, not there, so that reading a run's checkpoints does not import torch.distributed.checkpoint
# (0.24 s of CPU after dptrain.run's own imports: bench_results/import_cost.txt).
SHARDED = "sharded"

_NAME = re.compile(r"^step_([0-9]{8})$", re.ASCII)  # ASCII digits: \d would take other scripts' digits too
META_LIMIT = 64 << 20  # bytes a meta.json may hold: a few KB in practice
_FILES = ("model.pt", "optimizer.pt", "trainer.pt")
_INTERCHANGEABLE = ("replicated", "sharded")  # the same names in two containers (checkpoint/state.py)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from: corrupt, incomplete, or from another config."""


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def find_latest(run_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step (:func:`scan_checkpoints`), or None."""
    found, _ = scan_checkpoints(run_dir)
    return found[-1][1] if found else None


def scan_checkpoints(run_dir: Path) -> tuple[list[tuple[int, Path]], list[str]]:
    """The run's checkpoints, sorted by step, and a note on each entry of ``checkpoints/`` that is not one.

    A checkpoint is a real directory named ``step_<8 ASCII digits>`` whose ``meta.json`` (a regular
    file) records that step: what :func:`save_checkpoint` publishes, whole, with one rename. Hidden
    entries (staging and trash) are not listed.
    """
    root = checkpoint_root(run_dir)
    found, strays = [], []
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return found, strays
    for entry in entries:
        if entry.name.startswith("."):
            continue
        why = _not_a_checkpoint(Path(entry.path), entry)
        if why:
            strays.append(f"{entry.path} {why}")
        else:
            found.append((int(_NAME.match(entry.name).group(1)), Path(entry.path)))
    return found, strays


def _not_a_checkpoint(path: Path, entry: os.DirEntry) -> str | None:
    """Why ``path`` is not one of the run's checkpoints, or None when it is."""
    m = _NAME.match(path.name)
    if m is None:
        return "is not named step_<8 digits>"
    if entry.is_symlink():
        return f"is a symbolic link (to {os.readlink(path)})"
    if not entry.is_dir(follow_symlinks=False):
        return "is not a directory"
    try:
        step = json.loads(read_bytes(path / "meta.json", META_LIMIT)).get("step")
    except FileNotFoundError:
        return "has no meta.json (incomplete)"
    except (OSError, ValueError, AttributeError):
        return "has an unreadable meta.json"
    if step != int(m.group(1)):
        return f"records step {step!r} in its meta.json, not {int(m.group(1))} (a copy or a renamed checkpoint)"
    return None


def staging_dir(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written before it is renamed into place."""
    return checkpoint_root(run_dir) / f".step_{step:08d}.tmp"


def fresh_dir(path: Path) -> Path:
    """An empty new directory at ``path``: whatever was there (a directory, a file, a link) removed first."""
    remove_tree(path)
    path.mkdir(parents=True)
    return path


def save_checkpoint(run_dir: Path, step: int, files: dict[str, Any], meta: dict[str, Any],
                    staged: bool = False, progress: Callable[[], None] = lambda: None) -> Path:
    """Write ``files`` (name -> object for torch.save) and ``meta`` atomically; return the directory.

    ``staged``: the staging directory already holds files written by every rank (a
    sharded checkpoint); they are kept and their checksums go into ``meta.json`` too.
    ``progress`` is called after each file (the heartbeat's mark: a long save is not a hang).
    """
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = staging_dir(run_dir, step)
    if not staged:
        fresh_dir(tmp)
    digests = {}
    for name in _staged_files(tmp):
        digests[name] = hashlib.sha256(read_bytes(tmp / name)).hexdigest()
        progress()
    for name, obj in files.items():
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = buffer.getvalue()
        digests[name] = hashlib.sha256(data).hexdigest()
        _write_synced(tmp / name, data)
        progress()
    meta = dict(meta, step=step, files=digests, saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    _write_synced(tmp / "meta.json", json.dumps(meta, indent=2).encode())
    remove_tree(final)  # the same step saved again (e.g. a re-run that ended here): replace it
    tmp.rename(final)
    _fsync_dir(root)
    return final


def _staged_files(tmp: Path) -> list[str]:
    """The files the ranks wrote into the staging directory, relative names, sorted; a link or a special file
    there is refused (nothing in a checkpoint is one)."""
    names = []
    for top, dirs, files in os.walk(tmp, followlinks=False):
        for name in [*files, *(d for d in dirs if os.path.islink(os.path.join(top, d)))]:
            path = Path(top) / name
            if path.is_symlink() or not path.is_file():
                raise UnsafePath(f"{path} is {describe(path)}: a checkpoint holds regular files only")
            names.append(str(path.relative_to(tmp)))
    return sorted(names)


def verify_checkpoint(path: Path, identity: dict[str, Any], identity_hash: str, global_batch_size: int,
                      layout: str = "replicated", writers: Mapping[str, Sequence[str]] | None = None
                      ) -> dict[str, Any]:
    """``meta.json`` of the checkpoint at ``path`` once it is known to be intact and compatible with a run whose
    strategy writes ``layout``. ``writers``: each layout's strategies, for the message on another layout (the
    registry's ``checkpoint_writers()``, passed down: checkpoints sit below the strategies and know no name)."""
    meta = verify_files(path)
    saved_layout = meta.get("format", "replicated")
    if saved_layout != layout and {saved_layout, layout} != set(_INTERCHANGEABLE):
        raise CheckpointError(layout_mismatch(path, saved_layout, layout, writers or {}))
    stored = meta.get("identity")
    saved = normalize_identity(stored if isinstance(stored, dict) else {})  # as computed now (older ones kept more)
    if meta.get("identity_hash") != identity_hash and hash_identity(saved) != identity_hash:
        diffs = [f"{k}: {saved.get(k, '<absent>')!r} -> {identity.get(k, '<absent>')!r}"
                 for k in sorted(set(saved) | set(identity)) if saved.get(k) != identity.get(k)]
        raise CheckpointError(
            f"checkpoint {path} was written by a different config (hash {meta.get('identity_hash')} vs "
            f"{identity_hash}); resuming would not continue the same run. Differences (checkpoint -> now): "
            f"{'; '.join(diffs) or 'unknown'}. Restore those values, or start afresh with another "
            "run_dir")
    saved_batch = meta.get("global_batch_size")
    if type(saved_batch) is not int:  # noqa: E721 - a bool or a string is not a batch size
        raise CheckpointError(f"checkpoint {path}: meta.json records the global batch as {saved_batch!r}, not a "
                              f"whole number, so it was not written by dptrain (or was edited); delete {path} to "
                              "resume from an earlier checkpoint, or start afresh with another run_dir")
    if saved_batch != global_batch_size:
        raise CheckpointError(
            f"checkpoint {path} was trained with global batch {saved_batch}, this run "
            f"resolves to {global_batch_size}; the data position and learning rate would not continue. "
            "Keep the global batch (micro batch and accumulation may change with the world size)")
    return meta


def layout_mismatch(path: Path, saved_layout: str, layout: str, writers: Mapping[str, Sequence[str]]) -> str:
    """Why a run writing ``layout`` cannot resume the checkpoint at ``path`` of ``saved_layout``, and which strategies
    can: those writing it, or either of the two interchangeable layouts (the same names in two containers)."""
    readable = _INTERCHANGEABLE if saved_layout in _INTERCHANGEABLE else (saved_layout,)
    readers = [name for kind in readable for name in writers.get(kind, ())]
    by = writers.get(saved_layout)
    written = f" (written with distributed.strategy {_listed(by, 'or')})" if by else ""
    fix = (f"a strategy that reads it ({_listed(readers, 'or')})" if readers else
           f"a strategy that writes {_listed(readable, 'or')} checkpoints")
    return (f"checkpoint {path} is {saved_layout}{written} and this run's strategy writes {layout} checkpoints; "
            f"resume with {fix}, or start afresh with another run_dir")


def _listed(items: Sequence[str], conjunction: str) -> str:
    """``a, b or c``."""
    items = list(items)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {conjunction} {items[-1]}"


def verify_files(path: Path, fix: str | None = None) -> dict[str, Any]:
    """``meta.json`` of the checkpoint at ``path`` once every file it lists matches its sha256, or a
    :class:`CheckpointError` naming what is missing, corrupt or modified and ``fix`` (what to do)."""
    meta_path = path / "meta.json"
    fix = fix or f"delete {path} to resume from an earlier checkpoint, or start afresh with another run_dir"
    try:
        meta = json.loads(read_bytes(meta_path, META_LIMIT))
        files = meta["files"]
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no meta.json, so it is incomplete or not a "
                              f"dptrain checkpoint; {fix}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, UnsafePath) as e:
        raise CheckpointError(f"checkpoint {path}: meta.json is corrupt ({e}); {fix}") from None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise CheckpointError(f"checkpoint {path}: meta.json is corrupt (its files are not a mapping of names to "
                              f"checksums); {fix}")
    required = _FILES if meta.get("format", "replicated") == "replicated" else ("trainer.pt",)
    for name in required:
        if name not in files:
            raise CheckpointError(f"checkpoint {path}: meta.json lists no {name}; {fix}")
    for name in files:
        try:
            digest = hashlib.sha256(read_bytes(inside(path, name))).hexdigest()
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path}: {name} is missing; {fix}") from None
        except UnsafePath as e:
            raise CheckpointError(f"checkpoint {path}: its meta.json lists {name!r}, which it will not read: {e}. "
                                  "A checkpoint's files are regular files inside it; this one was made or edited "
                                  f"by hand. {fix[0].upper() + fix[1:]}") from None
        if digest != files[name]:
            raise CheckpointError(f"checkpoint {path}: {name} does not match its checksum in meta.json "
                                  f"(sha256 {digest[:12]}..., expected {str(files[name])[:12]}...), so it was "
                                  f"truncated or modified; {fix}")
    return meta


def check_readable(path: Path, meta: dict[str, Any]) -> None:
    """Every ``.pt`` file the checkpoint lists loads with ``weights_only`` (memory-mapped: nothing is read in
    full), or a :class:`CheckpointError` naming it: before launch, rather than a traceback from every worker
    once the run directory is written. The checksums catch damage; this catches a file that passes them but
    holds what ``weights_only`` refuses (crafted, or written by something else)."""
    for name in sorted(meta["files"]):
        if not name.endswith(".pt"):
            continue
        try:
            torch.load(inside(path, name), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - whatever torch.load raises on a file it will not load
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"checkpoint {path}: {name} cannot be loaded safely ({first[:300]}); it holds "
                                  "what a dptrain checkpoint never does, and nothing in it was run. Delete "
                                  f"{path} to resume from an earlier checkpoint, or start afresh with another "
                                  "run_dir") from None


def load_checkpoint(path: Path, device: torch.device) -> dict[str, Any]:
    """The checkpoint's ``.pt`` files, loaded with ``weights_only`` (no code runs from a checkpoint).

    A sharded checkpoint's ``sharded/`` is read by :mod:`dptrain.zero.checkpoint`; a run
    resumes through :func:`dptrain.checkpoint.state.load_model_and_optimizer`.
    """
    return {name.removesuffix(".pt"): torch.load(path / name, map_location=device, weights_only=True)
            for name in _FILES if (path / name).exists()}


def prune_checkpoints(run_dir: Path, keep_last: int, saved: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints; return what was deleted.

    Only the run's checkpoints count (:func:`scan_checkpoints`): a stray entry is never deleted,
    and ``saved`` (the checkpoint just written) never is, whatever stands beside it.

    [Note: rotation and readers] A reader (``dptrain consolidate`` of a live run) holds a
    shared ``flock`` on the checkpoint directory it reads (:func:`reading`); rotation
    takes an exclusive one without waiting and skips a directory it cannot lock, leaving
    it to a later rotation. What it deletes it first renames to a hidden trash name
    (:func:`~dptrain.utils.atomic.remove_tree`), so :func:`find_latest` (a resume) never
    picks a checkpoint being deleted, and a reader finds it whole or gone, never half.
    """
    found, _ = scan_checkpoints(run_dir)
    doomed = [path for _, path in found[:-keep_last]] if keep_last > 0 else []
    return [path for path in doomed if path != saved and _remove_unless_read(path)]


def _remove_unless_read(path: Path) -> bool:
    """Delete checkpoint ``path`` unless a reader holds it (or it is gone already); whether it was deleted."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False  # pinned by a reader: a later rotation deletes it
    try:
        return remove_tree(path)
    finally:
        os.close(fd)


@contextlib.contextmanager
def reading(path: Path) -> Iterator[Path]:
    """Hold checkpoint ``path`` against rotation while the block reads it ([Note: rotation and readers]).

    Raises :class:`CheckpointError` when rotation deleted it before the hold was taken.
    """
    gone = CheckpointError(f"checkpoint {path} was deleted (its run's rotation, checkpoint.keep_last) while it "
                           "was being opened; give a newer checkpoint, or the run directory for its newest")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        raise gone from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a rotation renames it away
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            raise gone
        yield path
    finally:
        os.close(fd)


def remove_partial(run_dir: Path) -> list[Path]:
    """Delete ``.step_*.tmp`` directories left by a save that was interrupted, and trash a deletion left behind."""
    root = checkpoint_root(run_dir)
    partial = [*root.glob(".step_*.tmp"), *root.glob(f".step_*{TRASH}-*")] if root.is_dir() else []
    for path in partial:
        remove_tree(path)
    return partial


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random number generator states, in types ``weights_only`` loading accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(_tuples(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def _write_synced(path: Path, data: bytes) -> None:
    with open_file(path, "xb") as f:  # a new file in a fresh directory: nothing there to write through
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""Text and Hugging Face datasets into token files, once: what ``dptrain prepare-data`` does.

The result is a token directory (``data/tokens.py``): ``train.bin``, ``val.bin`` and a
``meta.json`` that records the dtype, the vocabulary size, the tokenizer and the recipe
the files were made from (the inputs with their sizes and modification times, the
validation split, the text column). A run that asks for the same recipe finds the
directory prepared and uses it; one that asks for another is refused rather than
trained on stale tokens.

Sources:

- ``text``: files, directories (their files, recursively, in sorted order) or globs; each
  file is one document. Hidden files and directories (``.git/``, ``.venv/``, ``.DS_Store``)
  are skipped, and the output lists what was skipped;
- ``hf``: local data files read by Hugging Face ``datasets`` (json/jsonl, parquet, csv,
  arrow; the ``hf`` extra); each row's ``text_column`` is one document.

Validation is the token stream's tail (``val_fraction``, split as the built-in task
splits its corpus), or separate files (``val_files``). Files are written into a staging
directory beside the destination and renamed into place when complete: an interrupted
preparation leaves nothing that looks prepared.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dptrain.config import ConfigError
from dptrain.config.extras import require
from dptrain.data.tokenize import Tokenizer, describe_tokenizer, load_tokenizer
from dptrain.data.tokens import DTYPES, META, SPLITS, TokenFiles, open_token_dir, read_meta, scan_max_id
from dptrain.utils.atomic import replacing_dir

__all__ = ["Recipe", "PrepareReport", "prepare", "prepared", "prepare_command", "expand_inputs"]

HF_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


@dataclass(frozen=True)
class Recipe:
    """What a token directory is made from (``[data]``'s text and hf fields)."""

    source: str  # "text" or "hf"
    inputs: tuple[str, ...]
    out: Path
    tokenizer: str = "bytes"
    val_inputs: tuple[str, ...] = ()
    val_fraction: float = 0.05
    text_column: str = "text"

    @classmethod
    def from_config(cls, data) -> Recipe:
        inputs = tuple(data.text if data.source == "text" else data.files)
        out = data.dir or default_dir(inputs)
        return cls(data.source, inputs, Path(out), data.tokenizer, tuple(data.val_files), data.val_fraction,
                   data.text_column)

    def files(self, skipped: dict[str, int] | None = None) -> tuple[list[Path], list[Path]]:
        """(training files, validation files) the patterns name, checked (``expand_inputs``); ``skipped``
        collects the hidden entries left out of directories."""
        return (expand_inputs(self.source, self.inputs, _key(self.source), skipped),
                expand_inputs(self.source, self.val_inputs, "data.val_files", skipped))

    def fingerprint(self, files: tuple[list[Path], list[Path]] | None = None) -> dict:
        """What must match for an existing directory to count as this recipe's (stored in meta.json).

        ``files``: what :meth:`files` returned, when the caller has it already."""
        def stat(paths):
            return [{"path": str(p.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
                    for p in paths for st in (p.stat(),)]
        train, val = files if files is not None else self.files()
        return {"source": self.source, "inputs": stat(train), "val_inputs": stat(val),
                "val_fraction": None if self.val_inputs else self.val_fraction,
                "text_column": self.text_column if self.source == "hf" else None,
                "tokenizer": describe_tokenizer(self.tokenizer)}


@dataclass(frozen=True)
class PrepareReport:
    files: TokenFiles
    train_tokens: int
    val_tokens: int
    vocab_size: int
    bytes_written: int
    seconds: float

    def summary(self) -> str:
        return (f"{self.train_tokens + self.val_tokens:,} tokens ({self.train_tokens:,} train, {self.val_tokens:,} "
                f"validation), vocabulary "
                f"{self.vocab_size:,} ({self.files.dtype}), {self.bytes_written:,} bytes written to {self.files.dir} "
                f"in {self.seconds:.1f} s")


def _key(source: str) -> str:
    return "data.text" if source == "text" else "data.files"


def default_dir(inputs: tuple[str, ...]) -> str:
    """``data/<name of the first input>``, as nanoGPT keeps ``data/<dataset>``."""
    if not inputs:
        return ""
    first = Path(str(inputs[0]).split("*")[0].rstrip("/") or ".")
    return str(Path("data") / (first.stem or first.resolve().name or "text"))


def expand_inputs(source: str, patterns: tuple[str, ...] | list[str], key: str,
                  skipped: dict[str, int] | None = None) -> list[Path]:
    """The files ``patterns`` name: files as given, directories' files recursively (sorted), globs' matches (sorted).

    Empty files a directory or glob matches are skipped (an empty ``__init__.py`` is
    normal), and so are a directory's hidden files and directories (``skipped`` counts
    them: ``{".git/": 25}``; a glob skips hidden names itself); a ConfigError for a file
    named on its own that is empty, and for a pattern that names no file or only empty ones.
    """
    out: list[Path] = []
    for pattern in patterns:
        path = Path(pattern)
        if any(c in str(pattern) for c in "*?["):
            found = sorted(Path(m) for m in glob.glob(str(pattern), recursive=True) if Path(m).is_file())
            what = f"{pattern!r} matches"
        elif path.is_dir():
            found = visible_files(path, {} if skipped is None else skipped)
            what = f"the directory {path} holds"
        elif path.is_file():
            if path.stat().st_size == 0:
                raise ConfigError(f"{key}: {path} is empty")
            found, what = [path], ""
        else:
            raise ConfigError(f"{key}: {path} does not exist")
        matches = [p for p in found if p.stat().st_size > 0]
        if not matches:
            raise ConfigError(f"{key}: {what} {'only empty files' if found else 'no file'}")
        out += matches
    for path in out:
        if source == "hf" and path.suffix not in HF_FORMATS:
            raise ConfigError(f"{key}: {path} is not a format Hugging Face datasets reads here; use "
                              f"{', '.join(HF_FORMATS)} files")
    return out


def visible_files(root: Path, skipped: dict[str, int]) -> list[Path]:
    """The files under ``root``, sorted, without hidden files or directories; ``skipped`` counts what was left out,
    by hidden directory (``"repo/.git/": files under it``) or hidden file (``"repo/.gitignore": 1``)."""
    found = []
    for top, dirs, names in os.walk(root):
        for d in [d for d in dirs if d.startswith(".")]:
            dirs.remove(d)  # not descended into: its files are counted, never read as text
            skipped[str(Path(top) / d) + os.sep] = sum(len(f) for _, _, f in os.walk(Path(top) / d))
        for name in names:
            if name.startswith("."):
                skipped[str(Path(top) / name)] = 1
            elif (Path(top) / name).is_file():
                found.append(Path(top) / name)
    return sorted(found)


def skipped_line(skipped: dict[str, int], shown: int = 8) -> str | None:
    """One line listing the hidden entries left out (the ``shown`` largest, then a count); None if none."""
    if not skipped:
        return None
    items = sorted(skipped.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = [f"{name} ({n:,} file{'s' if n != 1 else ''})" if name.endswith(os.sep) else name
             for name, n in items[:shown]]
    more = f" and {len(items) - shown:,} more" if len(items) > shown else ""
    return (f"skipped {sum(skipped.values()):,} hidden file(s): {', '.join(parts)}{more} (hidden files and "
            "directories are never read as text; name a hidden file on its own to include it)")


def prepared(recipe: Recipe) -> TokenFiles | None:
    """The recipe's token directory if it is prepared; None if it does not exist yet.

    A ConfigError if the directory exists but holds something else (other inputs, another tokenizer,
    files that changed since): training on it would use stale tokens.
    """
    if not recipe.out.exists():
        return None
    meta = read_meta(recipe.out)
    made_from = meta.get("recipe")
    if made_from is None:
        raise ConfigError(f"data.dir {recipe.out} exists but was not prepared by dptrain (no recipe in its "
                          f"{META}); for token files you made yourself use data.source = \"tokens\", or choose "
                          "another data.dir")
    now = recipe.fingerprint()
    if made_from != now:
        changed = [k for k in now if made_from.get(k) != now.get(k)]
        raise ConfigError(f"data.dir {recipe.out} was prepared from another recipe (differs in: "
                          f"{', '.join(changed)}): the inputs, the tokenizer or the split changed since. Delete "
                          f"{recipe.out} to prepare it again, or choose another data.dir")
    return open_token_dir(recipe.out)  # its dtype from the same meta.json


def prepare_command(recipe: Recipe) -> str:
    """The ``dptrain prepare-data`` command line that prepares ``recipe``."""
    args = ["dptrain", "prepare-data", *recipe.inputs, "--out", str(recipe.out), "--tokenizer", recipe.tokenizer]
    if recipe.source == "hf":
        args += ["--hf", "--text-column", recipe.text_column]
    for val in recipe.val_inputs:
        args += ["--val", val]
    if not recipe.val_inputs:
        args += ["--val-fraction", f"{recipe.val_fraction:g}"]
    return shlex.join(args)


def prepare(recipe: Recipe, progress: bool = True, log: Callable[[str], None] = print) -> PrepareReport:
    """Tokenize the recipe's inputs into ``recipe.out``; returns what was written.

    Checks come first (the inputs exist and are not empty, the tokenizer loads, the
    split leaves tokens on both sides), then the staging directory is filled and renamed.
    """
    t0 = time.perf_counter()
    if recipe.out.exists():
        raise ConfigError(f"{recipe.out} already exists; delete it or choose another --out")
    if not recipe.inputs:
        raise ConfigError(f"{_key(recipe.source)} is empty: give the text files (or data files) to prepare")
    if not recipe.val_inputs and not 0.0 < recipe.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in (0, 1), got {recipe.val_fraction}")
    skipped: dict[str, int] = {}
    train_files, val_files = recipe.files(skipped)  # checks that every input exists and is not empty
    fingerprint = recipe.fingerprint((train_files, val_files))
    tokenizer = load_tokenizer(recipe.tokenizer)
    dtype = "uint16" if tokenizer.vocab_size <= 1 << 16 else "uint32"
    with replacing_dir(recipe.out) as staging:
        with _Progress(train_files + val_files, recipe.source, progress) as bar:
            train = _write(staging / SPLITS[0], _documents(recipe, train_files, tokenizer, bar), dtype)
            if val_files:
                val = _write(staging / SPLITS[1], _documents(recipe, val_files, tokenizer, bar), dtype)
            else:
                train, val = _split_tail(staging, train, recipe.val_fraction, dtype)
        if train == 0 or val == 0:
            raise ConfigError(f"the inputs give {train:,} train and {val:,} validation tokens; both need some "
                              "(more text, or another val_fraction or val_files)")
        meta = {"dtype": dtype, "vocab_size": tokenizer.vocab_size, "separator": tokenizer.separator,
                "train_tokens": train, "val_tokens": val,
                "max_token_id": {split: scan_max_id(staging / split, dtype) for split in SPLITS},
                "recipe": fingerprint, "prepared_by": "dptrain prepare-data"}
        (staging / META).write_text(json.dumps(meta, indent=2))
    written = sum(f.stat().st_size for f in recipe.out.iterdir())
    report = PrepareReport(open_token_dir(recipe.out), train, val, tokenizer.vocab_size, written,
                           time.perf_counter() - t0)
    line = skipped_line(skipped)
    if line:
        log(line)
    log(f"prepared: {report.summary()}")
    return report


def _documents(recipe: Recipe, files: list[Path], tokenizer: Tokenizer, bar: _Progress) -> Iterator[np.ndarray]:
    """Each document's token ids, the separator after it when the tokenizer has one."""
    sep = None if tokenizer.separator is None else np.asarray([tokenizer.separator], dtype=np.int64)
    if recipe.source == "text":
        for path in files:
            data = path.read_bytes()
            yield tokenizer.encode_bytes(data, str(path))
            if sep is not None:
                yield sep
            bar.update(len(data))
        return
    for texts in _hf_texts(files, recipe.text_column, bar):
        for ids in tokenizer.encode_texts(texts):
            yield ids
            if sep is not None:
                yield sep


def _hf_texts(files: list[Path], column: str, bar: _Progress, batch: int = 1000) -> Iterator[list[str]]:
    """Batches of the ``column`` values of local data files, read by Hugging Face datasets (nothing downloaded)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    datasets = require("datasets", "data.source = \"hf\"")
    datasets.disable_progress_bars()
    formats = {HF_FORMATS[p.suffix] for p in files}
    if len(formats) > 1:
        raise ConfigError(f"data.files mixes formats ({', '.join(sorted(formats))}); one load reads one format")
    with tempfile.TemporaryDirectory(prefix="dptrain-datasets-") as cache:  # no cache left in the user's home
        try:
            ds = datasets.load_dataset(formats.pop(), data_files=[str(p) for p in files], split="train",
                                       cache_dir=cache)
        except Exception as e:  # the library raises many kinds of errors for a file it cannot parse
            raise ConfigError(f"Hugging Face datasets cannot read {', '.join(map(str, files))}: "
                              f"{type(e).__name__}: {e}") from None
        if column not in ds.column_names:
            raise ConfigError(f"data.text_column {column!r} is not a column of {', '.join(map(str, files))}; its "
                              f"columns are {ds.column_names}")
        for start, rows in enumerate(ds.iter(batch_size=batch)):
            texts = rows[column]
            bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
            if bad is not None:
                raise ConfigError(f"row {start * batch + bad:,} of column {column!r} holds "
                                  f"{type(texts[bad]).__name__} {texts[bad]!r}, not text")
            yield texts
            bar.update(len(texts))


def _write(path: Path, arrays: Iterator[np.ndarray], dtype: str) -> int:
    """Stream ``arrays`` into ``path`` as ``dtype``; returns the token count."""
    limit, count = np.iinfo(DTYPES[dtype]).max, 0
    with open(path, "wb") as f:
        for ids in arrays:
            if len(ids) and int(ids.max()) > limit:  # a tokenizer whose ids exceed its own vocabulary size
                raise ConfigError(f"token id {int(ids.max())} does not fit {dtype}")
            f.write(np.ascontiguousarray(ids, dtype=DTYPES[dtype]).tobytes())
            count += len(ids)
    return count


def _split_tail(staging: Path, total: int, fraction: float, dtype: str) -> tuple[int, int]:
    """Move the last ``fraction`` of train.bin's tokens to val.bin, as the built-in task splits its corpus."""
    split = int(total * (1 - fraction))
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    train = staging / SPLITS[0]
    with open(train, "rb") as src, open(staging / SPLITS[1], "wb") as dst:
        src.seek(split * itemsize)
        shutil.copyfileobj(src, dst)
    os.truncate(train, split * itemsize)
    return split, total - split


class _Progress:
    """A tqdm bar over the inputs (bytes of text files, rows of data files) on stderr, or nothing."""

    def __init__(self, files: list[Path], source: str, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            total = sum(p.stat().st_size for p in files) if source == "text" else None
            self.bar = tqdm(total=total, unit="B" if source == "text" else " rows", unit_scale=True,
                            desc="tokenizing", file=sys.stderr, dynamic_ncols=True)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()

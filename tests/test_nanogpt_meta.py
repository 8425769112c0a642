"""nanoGPT's data directory as it is: train.bin, val.bin (uint16) and meta.pkl, read as plain data only."""

import os
import pickle

import numpy as np
import pytest

from _cli import dptrain, tiny_gpt_config
from dptrain.config import ConfigError
from dptrain.data.pickle_meta import pkl_vocab_size, read_meta_pkl

SHAKESPEARE = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 300


def nanogpt_dir(directory, meta: object | None = None):
    """What nanoGPT's data/shakespeare_char/prepare.py writes: character ids as uint16, and meta.pkl."""
    chars = sorted(set(SHAKESPEARE))
    stoi = {ch: i for i, ch in enumerate(chars)}
    ids = np.array([stoi[c] for c in SHAKESPEARE], dtype=np.uint16)
    directory.mkdir(parents=True, exist_ok=True)
    split = int(len(ids) * 0.9)
    ids[:split].tofile(directory / "train.bin")
    ids[split:].tofile(directory / "val.bin")
    if meta is None:
        meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}
    with open(directory / "meta.pkl", "wb") as f:
        pickle.dump(meta, f)
    return directory, len(chars)


class _Payload:
    """Unpickling this calls ``call(*args)``: what a crafted meta.pkl would do."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def test_nanogpt_meta_pkl_gives_the_vocabulary(tmp_path):
    directory, vocab = nanogpt_dir(tmp_path / "shakespeare_char")
    assert pkl_vocab_size(directory) == vocab == 30
    assert read_meta_pkl(directory / "meta.pkl")["itos"][0] == "\n"
    assert pkl_vocab_size(tmp_path) == 0  # no meta.pkl


@pytest.mark.parametrize("payload", [
    lambda target: _Payload(open, str(target), "w"),
    lambda target: _Payload(os.system, f"touch {target}"),
    lambda target: {"vocab_size": 65, "hook": _Payload(os.makedirs, str(target))},
])
def test_a_meta_pkl_that_would_run_code_is_refused_and_runs_nothing(tmp_path, payload):
    target = tmp_path / "pwned"
    directory, _ = nanogpt_dir(tmp_path / "data", payload(target))
    with pytest.raises(ConfigError, match=r"meta\.pkl is refused: it names .*plain data"):
        pkl_vocab_size(directory)
    assert not target.exists()


@pytest.mark.parametrize("meta, why", [
    ({"vocab_size": 65, "chars": {"a", "b"}}, "is a set"),
    ({"vocab_size": 65, "raw": b"abc"}, "is a bytes"),
    ([65], "holds a list, not nanoGPT's dict"),
    ({"vocab_size": "65"}, "no positive integer vocab_size"),
    ({"vocab_size": 0}, "no positive integer vocab_size"),
])
def test_a_meta_pkl_holding_anything_but_plain_data_is_refused(tmp_path, meta, why):
    directory, _ = nanogpt_dir(tmp_path / "data", meta)
    with pytest.raises(ConfigError, match=why):
        pkl_vocab_size(directory)


def test_a_truncated_meta_pkl_is_one_clear_error(tmp_path):
    directory, _ = nanogpt_dir(tmp_path / "data")
    raw = (directory / "meta.pkl").read_bytes()
    (directory / "meta.pkl").write_bytes(raw[:len(raw) // 2])
    with pytest.raises(ConfigError, match="cannot be read as a pickle"):
        pkl_vocab_size(directory)


@pytest.mark.timeout(300)
def test_dptrain_run_on_a_nanogpt_directory_reads_meta_pkl_and_says_so(tmp_path):
    directory, vocab = nanogpt_dir(tmp_path / "shakespeare_char")
    proc = dptrain("run", "--nproc", "1", "--config", str(tiny_gpt_config(tmp_path)), "--run-dir", "run",
                   "--set", "data.source=tokens", "--set", f"data.dir={directory}", "--set", "train.steps=2",
                   "--set", "checkpoint.every=0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"note: vocabulary size {vocab} read from {directory / 'meta.pkl'}" in proc.stderr


@pytest.mark.timeout(300)
def test_dptrain_run_on_a_hostile_meta_pkl_exits_2_before_anything_runs(tmp_path):
    target = tmp_path / "pwned"
    directory, _ = nanogpt_dir(tmp_path / "data", _Payload(open, str(target), "w"))
    proc = dptrain("run", "--nproc", "1", "--config", str(tiny_gpt_config(tmp_path)), "--run-dir", "run",
                   "--set", "data.source=tokens", "--set", f"data.dir={directory}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("error: ") == 1 and "meta.pkl is refused: it names io.open" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not target.exists() and not (tmp_path / "run").exists()


@pytest.mark.timeout(300)
def test_a_vocabulary_no_token_file_can_hold_is_one_line_not_a_crash_in_cpp(tmp_path):
    directory, _ = nanogpt_dir(tmp_path / "data", {"vocab_size": 2**70})
    proc = dptrain("run", "--nproc", "1", "--config", str(tiny_gpt_config(tmp_path)), "--run-dir", "run",
                   "--set", "data.source=tokens", "--set", f"data.dir={directory}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert f"the vocabulary size {2**70:,} ({directory / 'meta.pkl'}) is more ids than token files can hold" \
        in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()

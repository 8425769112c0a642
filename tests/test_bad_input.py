"""Bad input met by trying dptrain as a careless user would: one clear error, exit 2, no traceback, nothing written."""

import json

import numpy as np
import pytest

from _cli import dptrain
from dptrain.data.tokens import open_token_dir

RUN = ["--set", "task.name=classifier", "--set", "train.steps=2", "--set", "log.plots=false"]


def refused(proc, *texts):
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    for text in texts:
        assert text in proc.stderr, proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--config", "conf"], "config file conf is a directory; --config takes a TOML file, e.g. conf/job.toml"),
    (["--config", "latin1.toml"], "config file latin1.toml is not UTF-8 text (line 2, byte 13: b'\\xe9'); TOML files "
                                  "are UTF-8"),
    (["--set", "train.lr=nan"], "'train.lr' in --set train.lr=nan must be a finite number, got nan"),
    (["--set", "train.lr=inf"], "'train.lr' in --set train.lr=inf must be a finite number, got inf"),
    (["--set", "train.lr=0"], "train.lr must be a positive learning rate, got 0.0"),
    (["--set", "train.lr=-1e-3"], "train.lr must be a positive learning rate, got -0.001"),
    (["--set", "train.grad_clip=nan"], "'train.grad_clip' in --set train.grad_clip=nan must be a finite number"),
    (["--set", "train.weight_decay=-inf"], "'train.weight_decay' in --set train.weight_decay=-inf must be a finite"),
    (["--set", "train.weight_decay=-0.1"], "train.weight_decay must be at least 0.0, got -0.1"),
    (["--set", "train.min_lr_ratio=nan"], "'train.min_lr_ratio' in --set train.min_lr_ratio=nan must be a finite"),
    (["--set", "distributed.timeout_s=inf"], "'distributed.timeout_s' in --set distributed.timeout_s=inf must be a finite number"),
    (["--set", "train.betas=[nan, 0.99]"], "train.betas must be two numbers in [0, 1), got [nan, 0.99]"),
])
def test_a_bad_config_or_value_is_refused_before_the_run_directory_exists(tmp_path, args, message):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "job.toml").write_text("[train]\nsteps = 2\n")
    (tmp_path / "latin1.toml").write_bytes("[train]\n# caf\u00e9\nsteps = 2\n".encode("latin-1"))
    proc = dptrain("run", "--run-dir", "out", *RUN, *args, cwd=tmp_path)
    refused(proc, "error: " + message)
    assert proc.stderr.count("error: ") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "1e30", "-5", "0", "1.5"])
def test_plan_refuses_a_parameter_count_that_is_not_one(tmp_path, value):
    proc = dptrain("plan", "--params", value, cwd=tmp_path)
    refused(proc, "a whole parameter count from 1 to 1e+15", "e.g. --params 7e9")


def test_plan_refuses_a_device_memory_that_is_not_a_size(tmp_path):
    refused(dptrain("plan", "--params", "7e9", "--device-memory", "nan", cwd=tmp_path),
            "--device-memory must be positive GiB, got nan")


# ----------------------------------------------------------------------------- token ids beyond the vocabulary


def tokens_with_one_bad_id(directory, tokens: int = 3 << 20, at: int = 3 * (3 << 16) + 100_000):
    """Bytes-valued uint16 ids and one id 300 at ``at``: between the stretches a sampled check would read."""
    directory.mkdir(parents=True, exist_ok=True)
    ids = (np.arange(tokens) % 256).astype(np.uint16)
    ids[at] = 300
    ids.tofile(directory / "train.bin")
    ids[:5000].tofile(directory / "val.bin")
    return directory


@pytest.mark.timeout(120)
def test_a_token_id_beyond_the_vocabulary_anywhere_in_the_file_is_refused_before_launch(tmp_path):
    data = tokens_with_one_bad_id(tmp_path / "data")
    proc = dptrain("run", "--nproc", "1", "--run-dir", "out", "--set", "data.source=tokens", "--set",
                   f"data.dir={data}", "--set", "gpt.vocab_size=256", cwd=tmp_path)
    refused(proc, f"{data / 'train.bin'} holds token id 300, but the model's vocabulary has 256 ids (0 to 255)",
            "gpt.vocab_size")
    assert not (tmp_path / "out").exists()


def test_meta_jsons_max_id_is_used_while_the_counts_match_and_the_file_is_read_when_they_do_not(tmp_path):
    data = tokens_with_one_bad_id(tmp_path / "data")
    meta = {"dtype": "uint16", "vocab_size": 512, "train_tokens": 3 << 20, "val_tokens": 5000,
            "max_token_id": {"train.bin": 299, "val.bin": 255}}
    (data / "meta.json").write_text(json.dumps(meta))
    assert open_token_dir(data).max_id("train.bin") == 299  # recorded by prepare-data: the file is not read
    (data / "meta.json").write_text(json.dumps({**meta, "train_tokens": 1000}))  # the file changed since
    assert open_token_dir(data).max_id("train.bin") == 300


# ----------------------------------------------------------------------------- prepare-data and hidden directories


def test_prepare_data_skips_hidden_directories_and_lists_them_and_records_the_max_id(tmp_path):
    repo = tmp_path / "repo"
    (repo / ".git" / "objects" / "ab").mkdir(parents=True)
    for i in range(25):
        (repo / ".git" / "objects" / "ab" / f"obj{i}").write_bytes(bytes([200 + i % 50]) * 1000)
    (repo / ".venv" / "lib").mkdir(parents=True)
    (repo / ".venv" / "lib" / "site.py").write_text("import os\n" * 100)
    (repo / ".gitignore").write_text("*.pyc\n")
    (repo / "src").mkdir()
    text = "def f():\n    return 1\n" * 200
    (repo / "src" / "a.py").write_text(text)
    proc = dptrain("prepare-data", str(repo), "--out", str(tmp_path / "tokens"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"skipped 27 hidden file(s): {repo / '.git'}/ (25 files), {repo / '.gitignore'}, " \
           f"{repo / '.venv'}/ (1 file)" in proc.stdout, proc.stdout
    meta = json.loads((tmp_path / "tokens" / "meta.json").read_text())
    assert meta["train_tokens"] + meta["val_tokens"] == len(text)  # a.py only: no git object was read
    assert [i["path"] for i in meta["recipe"]["inputs"]] == [str((repo / "src" / "a.py").resolve())]
    assert meta["max_token_id"] == {"train.bin": max(text.encode()), "val.bin": max(text.encode()[-len(text) // 20:])}

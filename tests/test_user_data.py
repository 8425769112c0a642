"""`dptrain run` on what users bring: token files, text, local datasets, their own Datasets, Hugging Face models.

Every dataset here is made by the test (no download): token files from the built-in
corpus's bytes, text files and jsonl written on the spot, a BPE tokenizer trained on
them, a 2-layer GPT-2 config written with ``save_pretrained``.
"""

import json
import math
import pickle

import numpy as np
import pytest
import torch

from _cli import dptrain, tiny_gpt_config
from dptrain.config import ConfigError, load_config
from dptrain.data.tokens import TokenWindows
from dptrain.tasks.corpus import stdlib_corpus
from dptrain.tasks.protocol import ProtocolError, protocol_eval_sums, protocol_loss
from test_cli_run import train_records

QUICK = ["--set", "log.progress=lines", "--set", "log.plots=false", "--set", "log.eval_batches=2"]


def losses(run_dir) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in train_records(run_dir)]


def write_tokens(directory, train: np.ndarray, val: np.ndarray, dtype=np.uint16):
    """A token directory as nanoGPT's prepare.py writes one: train.bin and val.bin, no meta.json."""
    directory.mkdir(parents=True, exist_ok=True)
    train.astype(dtype).tofile(directory / "train.bin")
    val.astype(dtype).tofile(directory / "val.bin")
    return directory


def corpus_tokens(directory, corpus_bytes: int = 100_000, val_fraction: float = 0.05):
    """The built-in task's corpus and split, as token files."""
    corpus = stdlib_corpus(corpus_bytes).numpy()
    split = int(len(corpus) * (1 - val_fraction))
    return write_tokens(directory, corpus[:split], corpus[split:])


def bpe_tokenizer(path, texts: list[str], vocab_size: int = 320):
    """A byte-level BPE tokenizer.json with an end-of-text token, trained here on ``texts``."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return tok


# ----------------------------------------------------------------------------- one process

def test_token_windows_sequential_and_random_are_functions_of_seed_epoch_and_index(tmp_path):
    data = np.arange(1000, dtype=np.uint16)
    write_tokens(tmp_path, data, data[:100])
    seq = TokenWindows(tmp_path / "train.bin", "uint16", 10)
    assert len(seq) == 99  # (1000 - 1) // 10 windows of 11 tokens
    x, y = seq[3]
    assert x.tolist() == list(range(30, 40)) and y.tolist() == list(range(31, 41)) and x.dtype == torch.int64
    assert isinstance(seq.data, np.memmap)  # mapped, not read
    assert pickle.loads(pickle.dumps(seq))._data is None  # a worker maps the file itself

    rnd = TokenWindows(tmp_path / "train.bin", "uint16", 10, "random", seed=7)
    again = TokenWindows(tmp_path / "train.bin", "uint16", 10, "random", seed=7)
    first = [rnd.offset(i) for i in range(len(rnd))]
    assert first == [again.offset(i) for i in range(len(again))]  # what resuming at a step relies on
    assert all(0 <= o <= 1000 - 11 for o in first) and len(set(first)) > 80
    assert rnd[5][0].tolist() == list(range(first[5], first[5] + 10))
    rnd.set_epoch(1)
    assert [rnd.offset(i) for i in range(len(rnd))] != first  # new windows each epoch
    with pytest.raises(IndexError):
        seq[len(seq)]


def test_the_loss_protocol_reads_a_loss_an_object_or_logits():
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 1])
    logits_model = torch.nn.Linear(3, 3)
    expected = torch.nn.functional.cross_entropy(logits_model(x), y)
    assert torch.allclose(protocol_loss(logits_model, (x, y)), expected)

    class Out:
        def __init__(self, loss, logits):
            self.loss, self.logits = loss, logits

    class HFStyle(torch.nn.Module):  # labels by keyword, returns .loss and .logits as transformers models do
        def forward(self, x, labels=None):
            logits = logits_model(x)
            return Out(torch.nn.functional.cross_entropy(logits, labels) * 2 if labels is not None else None, logits)

    assert torch.allclose(protocol_loss(HFStyle(), {"x": x, "labels": y}), 2 * expected)  # its own loss wins
    sums = protocol_eval_sums(HFStyle(), {"x": x, "labels": y})
    assert sums["count"] == 4 and sums["loss_sum"] == pytest.approx(4 * 2 * expected.item(), rel=1e-5)

    ignore = y.clone()
    ignore[0] = -100  # ignored, as in torch and transformers
    sums = protocol_eval_sums(logits_model, (x, ignore))
    assert sums["count"] == 3
    with pytest.raises(ProtocolError, match=r"do not line up with targets \(3,\)"):
        protocol_loss(logits_model, (x, y[:3]))
    with pytest.raises(ProtocolError, match="no targets"):
        protocol_loss(logits_model, x)


def test_a_config_that_needs_a_missing_extra_says_which_to_install(monkeypatch, tmp_path):
    from dptrain.data.tokenize import load_tokenizer
    from dptrain.models.hf import load_config as hf_config

    (tmp_path / "config.json").write_text("{}")
    for name in ("tokenizers", "transformers"):
        monkeypatch.setitem(__import__("sys").modules, name, None)  # import fails, as when not installed
    with pytest.raises(ConfigError, match=r"data.tokenizer .* needs the tokenizers package.*pip install -e \"\.\[hf\]\""):
        load_tokenizer(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"hf.path .* needs the transformers package.*\[hf\]"):
        hf_config(tmp_path)


def test_prepared_tokens_are_the_tokenizers_ids_with_end_of_text_between_documents(tmp_path):
    from dptrain.data.prepare import Recipe, prepare

    docs = ["def f(x):\n    return x + 1\n" * 40, "class A:\n    pass\n" * 40]
    for i, doc in enumerate(docs):
        (tmp_path / "text").mkdir(exist_ok=True)
        (tmp_path / "text" / f"{i}.py").write_text(doc)
    tok = bpe_tokenizer(tmp_path / "tokenizer.json", docs)
    report = prepare(Recipe("text", (str(tmp_path / "text"),), tmp_path / "out", str(tmp_path / "tokenizer.json"),
                            val_fraction=0.1), progress=False, log=lambda line: None)
    eot = tok.token_to_id("<|endoftext|>")
    expected = np.concatenate([np.asarray(tok.encode(d).ids + [eot]) for d in docs])
    got = np.concatenate([np.fromfile(tmp_path / "out" / split, dtype=np.uint16) for split in ("train.bin", "val.bin")])
    assert got.tolist() == expected.tolist()
    assert report.vocab_size == tok.get_vocab_size() and report.train_tokens + report.val_tokens == len(expected)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["vocab_size"] == tok.get_vocab_size() and meta["separator"] == eot and meta["dtype"] == "uint16"


# ----------------------------------------------------------------------------- bad input

@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    """One directory of broken data, one case per kind of bad input."""
    root = tmp_path_factory.mktemp("bad")
    ok = np.arange(2000) % 200
    write_tokens(root / "no_train", ok, ok).joinpath("train.bin").unlink()
    write_tokens(root / "empty", ok, ok[:0])
    write_tokens(root / "odd", ok, ok)
    with open(root / "odd" / "train.bin", "ab") as f:
        f.write(b"\0")
    write_tokens(root / "big_id", ok, np.append(ok, 300))
    write_tokens(root / "small", ok[:40], ok)
    (root / "rows.jsonl").write_text("".join(json.dumps({"body": "x" * 50, "id": i}) + "\n" for i in range(20)))
    (root / "no_config").mkdir()
    (root / "broken_tokenizer.json").write_text('{"not": "a tokenizer"}')
    (root / "text.txt").write_text("hello\n" * 1000)
    (root / "empty.txt").write_text("")
    return root


BAD = {
    "missing directory": (["data.source=tokens", "data.dir={root}/nowhere"], ["data.dir", "nowhere is not a directory"]),
    "missing file": (["data.source=tokens", "data.dir={root}/no_train"], ["no_train/train.bin is missing"]),
    "empty file": (["data.source=tokens", "data.dir={root}/empty"], ["empty/val.bin is empty"]),
    "size not a multiple": (["data.source=tokens", "data.dir={root}/odd"],
                            ["odd/train.bin has 4,001 bytes, not a whole number of uint16 tokens (2 bytes each)"]),
    "id >= vocabulary": (["data.source=tokens", "data.dir={root}/big_id", "gpt.vocab_size=256"],
                         ["big_id/val.bin holds token id 300", "vocabulary has 256 ids"]),
    "smaller than a batch": (["data.source=tokens", "data.dir={root}/small", "gpt.vocab_size=256"],
                             ["the training set has 2 samples", "per rank", "windows of 16 + 1 tokens from the 40"]),
    "missing column": (['data.source=hf', 'data.files=["{root}/rows.jsonl"]', "data.dir={root}/rows_tokens"],
                       ["data.text_column 'text' is not a column", "'body'", "'id'"]),
    "hf dir without config": (["data.source=tokens", "data.dir={root}/big_id", "hf.path={root}/no_config"],
                              ["no_config has no config.json"]),
    "factory not a Dataset": (["data.source=factory", "data.factory=_user_data:not_datasets"],
                              ["the training set is list, not a torch Dataset"]),
    "tokenizer does not load": (["data.source=text", 'data.text=["{root}/text.txt"]', "data.dir={root}/text_tokens",
                                 "data.tokenizer={root}/broken_tokenizer.json"],
                                ["broken_tokenizer.json does not load as a Hugging Face tokenizer.json"]),
    "missing text": (["data.source=text", 'data.text=["{root}/nothing.txt"]', "data.dir={root}/t2"],
                     ["nothing.txt does not exist"]),
    "empty text": (["data.source=text", 'data.text=["{root}/empty.txt"]', "data.dir={root}/t3"], ["empty.txt is empty"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_error_exit_2_before_any_worker_and_nothing_is_written(bad_inputs, tmp_path, case):
    if case in ("missing column", "hf dir without config", "tokenizer does not load"):
        pytest.importorskip("datasets" if case == "missing column" else
                            "transformers" if case.startswith("hf") else "tokenizers")
    settings, expected = BAD[case]
    before = sorted(p.name for p in bad_inputs.iterdir())
    args = [a for s in settings for a in ("--set", s.format(root=bad_inputs))]
    proc = dptrain("run", "--nproc", "2", "--config", str(tiny_gpt_config(tmp_path)), *args,
                   "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.count("error: ") == 1, proc.stderr
    for text in expected:
        assert text in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "rank" not in proc.stdout
    assert not (tmp_path / "run").exists()  # nothing written: no run directory,
    assert sorted(p.name for p in bad_inputs.iterdir()) == before  # no token directory, no staging left behind


# ----------------------------------------------------------------------------- the built-in GPT on user data

def test_builtin_gpt_on_token_files_of_the_builtin_corpus_gives_the_builtin_tasks_losses(tmp_path):
    """Same bytes, same sequential windows in the same shuffled order, same model: the same run, step for step."""
    config = str(tiny_gpt_config(tmp_path))
    short = ["--set", "train.steps=6", "--set", "checkpoint.every=0", "--set", "log.eval_every=6"]
    builtin = dptrain("run", "--nproc", "2", "--config", config, *short, "--run-dir", str(tmp_path / "builtin"),
                      cwd=tmp_path)
    assert builtin.returncode == 0, builtin.stderr
    corpus_tokens(tmp_path / "tokens")
    tokens = dptrain("run", "--nproc", "2", "--config", config, *short, "--set", "data.source=tokens",
                     "--set", f"data.dir={tmp_path / 'tokens'}", "--set", "gpt.vocab_size=256",
                     "--run-dir", str(tmp_path / "tokens_run"), cwd=tmp_path)
    assert tokens.returncode == 0, tokens.stderr
    assert losses(tmp_path / "builtin") == losses(tmp_path / "tokens_run")
    evals = [[r for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "eval"] for run in ("builtin", "tokens_run")]
    assert evals[0][0]["val_loss"] == pytest.approx(evals[1][0]["val_loss"], rel=1e-6)


def test_a_text_directory_through_prepare_data_and_a_run_that_prepares_it_itself(tmp_path):
    """prepare-data once (its report), then train on it; a run on text nobody prepared prepares it first."""
    text = tmp_path / "books"
    text.mkdir()
    corpus = bytes(stdlib_corpus(60_000).tolist()).decode("utf-8", errors="replace")
    for i in range(3):
        (text / f"part{i}.txt").write_text(corpus[i * 20_000:(i + 1) * 20_000])
    bpe_tokenizer(tmp_path / "tokenizer.json", [corpus], vocab_size=400)

    prep = dptrain("prepare-data", str(text), "--out", "data/books", "--tokenizer", "tokenizer.json", cwd=tmp_path)
    assert prep.returncode == 0, prep.stderr
    meta = json.loads((tmp_path / "data" / "books" / "meta.json").read_text())
    written = sum(p.stat().st_size for p in (tmp_path / "data" / "books").iterdir())
    assert f"{meta['train_tokens'] + meta['val_tokens']:,} tokens" in prep.stdout
    assert "vocabulary 400" in prep.stdout and f"{written:,} bytes" in prep.stdout, prep.stdout
    again = dptrain("prepare-data", str(text), "--out", "data/books", "--tokenizer", "tokenizer.json", cwd=tmp_path)
    assert again.returncode == 0 and "already prepared" in again.stdout

    common = ["run", "--nproc", "2", "--config", str(tiny_gpt_config(tmp_path)), "--set", "train.steps=16",
              "--set", "train.lr=0.01", "--set", "checkpoint.every=0", "--set", "data.source=text", "--set", f'data.text=["{text}"]',
              "--set", "data.tokenizer=tokenizer.json"]
    run = dptrain(*common, "--set", "data.dir=data/books", "--run-dir", "runs/a", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "preparing" not in run.stderr  # the directory holds this recipe already
    records = train_records(tmp_path / "runs" / "a")
    assert records[0]["loss"] == pytest.approx(math.log(400), rel=0.05)  # the vocabulary came from meta.json
    assert sum(r["loss"] for r in records[-3:]) / 3 < records[0]["loss"] - 0.5

    default = dptrain(*common, "--set", "train.steps=2", "--run-dir", "runs/b", cwd=tmp_path)  # data/<input's name>
    assert default.returncode == 0 and "preparing" not in default.stderr, default.stderr
    other = dptrain(*common, "--set", "train.steps=2", "--set", "data.dir=data/books2", "--run-dir", "runs/c",
                    cwd=tmp_path)
    assert other.returncode == 0, other.stderr
    assert "data/books2 is not prepared yet: preparing it (dptrain prepare-data" in other.stderr
    assert "prepared:" in other.stderr
    assert (tmp_path / "data" / "books2" / "train.bin").read_bytes() == \
        (tmp_path / "data" / "books" / "train.bin").read_bytes()


def test_a_jsonl_file_through_hf_datasets(tmp_path):
    pytest.importorskip("datasets")
    rows = [{"text": f"row {i}: " + "the quick brown fox jumps over the lazy dog. " * 3, "id": i} for i in range(300)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = dptrain("run", "--nproc", "2", "--config", str(tiny_gpt_config(tmp_path)), "--set", "train.steps=10",
                   "--set", "checkpoint.every=0", "--set", "data.source=hf", "--set", 'data.files=["rows.jsonl"]',
                   "--run-dir", "runs/rows", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "data" / "rows" / "meta.json").read_text())  # bytes: one token per byte
    assert meta["train_tokens"] + meta["val_tokens"] == sum(len(r["text"].encode()) for r in rows)
    records = train_records(tmp_path / "runs" / "rows")
    assert records[-1]["loss"] < records[0]["loss"] - 0.5


def test_the_users_datasets_collate_and_model_from_factories(tmp_path):
    proc = dptrain("run", "--nproc", "2", "--set", "data.source=factory", "--set", "data.factory=_user_data:clusters",
                   "--set", "task.model=_user_data:keyword_mlp", "--set", "train.steps=8", "--set", "train.lr=0.01",
                   "--set", "log.every=1", *QUICK, "--run-dir", "runs/mine", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "task _user_data" in proc.stdout  # runs/<the factory's module> by default
    records = train_records(tmp_path / "runs" / "mine")
    assert len(records) == 8 and records[-1]["loss"] < records[0]["loss"]
    evals = [r for r in map(json.loads, (tmp_path / "runs" / "mine" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "eval"]
    assert 0 <= evals[-1]["val_accuracy"] <= 1 and math.isfinite(evals[-1]["val_loss"])


# ----------------------------------------------------------------------------- Hugging Face models

@pytest.fixture(scope="module")
def hf_setup(tmp_path_factory):
    """A 2-layer GPT-2 config (vocabulary 256: bytes) and the built-in corpus as token files."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                            eos_token_id=0).save_pretrained(root / "gpt2-tiny")
    corpus_tokens(root / "tokens", corpus_bytes=60_000)
    return root


def hf_run(root, run_dir, *settings, steps=12, fault=None, hf_path=None):
    args = [a for s in settings for a in ("--set", s)]
    return dptrain("run", "--nproc", "2", "--set", "data.source=tokens", "--set", f"data.dir={root / 'tokens'}",
                   "--set", f"hf.path={hf_path or root / 'gpt2-tiny'}", "--set", f"train.steps={steps}",
                   "--set", "train.global_batch_size=8", "--set", "train.lr=1e-2", "--set", "train.warmup_steps=2",
                   "--set", "log.every=1", "--set", "checkpoint.every=0", "--set", "log.eval_every=0", *QUICK,
                   *args, "--run-dir", str(run_dir), cwd=root, env={"DPTRAIN_FAULT": fault} if fault else None)


@pytest.mark.timeout(300)
def test_a_hugging_face_gpt2_trains_with_ddp_and_zero3_and_fine_tunes_from_save_pretrained(hf_setup, tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from dptrain.models.hf import causal_lm
    from dptrain.strategies.options import zero_options

    ddp = hf_run(hf_setup, tmp_path / "ddp")
    assert ddp.returncode == 0, ddp.stderr
    zero3 = hf_run(hf_setup, tmp_path / "zero3", "distributed.strategy=zero3")
    assert zero3.returncode == 0, zero3.stderr
    a, b = train_records(tmp_path / "ddp"), train_records(tmp_path / "zero3")
    assert a[0]["loss"] == pytest.approx(math.log(256), rel=0.05)
    assert sum(r["loss"] for r in a[-3:]) / 3 < a[0]["loss"] - 1.0  # losses fall
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-5)  # the same training, sharded
    # ZeRO-3's units: the decoder layers (transformer.h), found by itself
    cfg = load_config(tmp_path / "zero3" / "config.toml")
    blocks = zero_options(cfg, causal_lm(cfg.hf.path, weights=False), nodes=1, stage=3)["unit_classes"]
    assert [c.__name__ for c in blocks] == ["GPT2Block"]

    # The run's model as a Hugging Face directory, the tied embedding and head one tensor
    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "zero3" / "hf")
    weights = load_file(tmp_path / "zero3" / "model.safetensors")
    assert trained.transformer.wte.weight.data_ptr() == trained.lm_head.weight.data_ptr()
    for name, tensor in trained.state_dict().items():
        if name in weights:
            assert torch.equal(tensor, weights[name]), name

    # Fine-tuning: a directory this test saves with save_pretrained, its weights loaded, not re-initialised
    trained.save_pretrained(tmp_path / "saved")
    tuned = hf_run(hf_setup, tmp_path / "tuned", steps=3, hf_path=tmp_path / "saved")
    assert tuned.returncode == 0, tuned.stderr
    scratch = hf_run(hf_setup, tmp_path / "scratch", "hf.from_scratch=true", steps=3, hf_path=tmp_path / "saved")
    assert scratch.returncode == 0, scratch.stderr
    first_tuned, first_scratch = train_records(tmp_path / "tuned")[0], train_records(tmp_path / "scratch")[0]
    assert first_tuned["loss"] < b[-1]["loss"] + 0.3 and first_tuned["loss"] < first_scratch["loss"] - 1.0
    assert first_scratch["loss"] == pytest.approx(a[0]["loss"], rel=1e-6)  # the config's fresh initialisation


@pytest.mark.timeout(300)
def test_a_hugging_face_model_resumes_after_a_kill_exactly_with_random_windows(hf_setup, tmp_path):
    """Dropout on (GPT-2's 0.1) and random windows: the resumed run draws the same windows and the same masks."""
    settings = ["data.sampling=random", "checkpoint.every=4"]
    straight = hf_run(hf_setup, tmp_path / "a", *settings, steps=8)
    assert straight.returncode == 0, straight.stderr
    killed = hf_run(hf_setup, tmp_path / "b", *settings, steps=8, fault="1:6:kill")
    assert killed.returncode == 1 and "SIGKILL" in killed.stderr
    resumed = hf_run(hf_setup, tmp_path / "b", *settings, steps=8)
    assert resumed.returncode == 0, resumed.stderr
    assert "step_00000004 at step 4" in resumed.stdout
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


STRATEGIES = {"zero1": ["distributed.strategy=zero1"], "zero2 int8": ["distributed.strategy=zero2", "compression.method=int8"],
              "powersgd": ["compression.method=powersgd"], "bf16": ["train.precision=bf16"],
              "ps": ["distributed.strategy=ps"], "gossip": ["distributed.strategy=gossip"]}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_trains_a_hugging_face_model(hf_setup, tmp_path, name):
    proc = hf_run(hf_setup, tmp_path / "run", *STRATEGIES[name], steps=4)
    assert proc.returncode == 0, proc.stderr
    records = train_records(tmp_path / "run")
    assert records and all(math.isfinite(r["loss"]) for r in records)
    assert (tmp_path / "run" / "hf" / "config.json").is_file()


def test_plan_for_a_hugging_face_config_on_token_files(hf_setup, tmp_path):
    from dptrain.models.hf import causal_lm

    proc = dptrain("plan", "--set", "data.source=tokens", "--set", f"data.dir={hf_setup / 'tokens'}",
                   "--set", f"hf.path={hf_setup / 'gpt2-tiny'}", "--world-sizes", "2", "--precisions", "fp32",
                   "--json", str(tmp_path / "plan.json"), cwd=hf_setup)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    rows = {r["strategy"]: r for r in plan["rows"]}
    assert set(rows) == {"ddp", "zero1", "zero2", "zero3"} and plan["notes"] == []  # the forward traced
    numel = sum(p.numel() for p in causal_lm(hf_setup / "gpt2-tiny", weights=False).parameters())  # tied: once
    assert rows["ddp"]["parameters_bytes"] == 4 * numel
    assert rows["zero3"]["parameters_bytes"] < rows["ddp"]["parameters_bytes"]  # sharded
    assert rows["ddp"]["activation_bytes"] > 0


def test_directories_and_globs_skip_empty_files_but_a_named_empty_file_is_an_error(tmp_path):
    from dptrain.data.prepare import expand_inputs

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text("x = 1\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    assert expand_inputs("text", [str(tmp_path / "pkg")], "data.text") == [tmp_path / "pkg" / "mod.py"]
    assert expand_inputs("text", [str(tmp_path / "pkg" / "*.py")], "data.text") == [tmp_path / "pkg" / "mod.py"]
    with pytest.raises(ConfigError, match=r"__init__.py is empty"):
        expand_inputs("text", [str(tmp_path / "pkg" / "__init__.py")], "data.text")
    with pytest.raises(ConfigError, match=r"the directory .*empty holds only empty files"):
        expand_inputs("text", [str(tmp_path / "empty")], "data.text")
    with pytest.raises(ConfigError, match=r"'.*\*.md' matches no file"):
        expand_inputs("text", [str(tmp_path / "*.md")], "data.text")


def test_jsonl_csv_parquet_and_arrow_give_the_same_tokens(tmp_path):
    datasets = pytest.importorskip("datasets")
    from dptrain.data.prepare import Recipe, prepare

    rows = [{"id": i, "body": f"document {i}: " + "lorem ipsum " * (i % 7 + 1)} for i in range(50)]
    table = datasets.Dataset.from_list(rows)
    table.to_json(tmp_path / "rows.jsonl")
    table.to_csv(tmp_path / "rows.csv", index=False)
    table.to_parquet(tmp_path / "rows.parquet")
    table.save_to_disk(tmp_path / "saved")  # arrow files, as datasets keeps them
    (arrow,) = (tmp_path / "saved").glob("*.arrow")
    arrow.rename(tmp_path / "rows.arrow")
    tokens = {}
    for name in ("rows.jsonl", "rows.csv", "rows.parquet", "rows.arrow"):
        prepare(Recipe("hf", (str(tmp_path / name),), tmp_path / name.replace(".", "_"), text_column="body"),
                progress=False, log=lambda line: None)
        tokens[name] = b"".join((tmp_path / name.replace(".", "_") / split).read_bytes()
                                for split in ("train.bin", "val.bin"))
    expected = np.frombuffer("".join(r["body"] for r in rows).encode(), dtype=np.uint8).astype(np.uint16).tobytes()
    assert tokens["rows.jsonl"] == tokens["rows.csv"] == tokens["rows.parquet"] == tokens["rows.arrow"] == expected

"""``log.backends``: each backend read back by its own library and compared with what it was given (a few fake
records, fast), one ``dptrain run`` on the tiny GPT with all five compared with its metrics.jsonl, and the
pre-launch refusal of an unknown backend or a missing library (exit 2, nothing written).

W&B runs offline only (the backend passes ``mode="offline"``); the environment below also keeps it and MLflow
from sending telemetry, sampling the machine, or writing outside the test's directories.
"""

import csv
import json
import re
import struct
import sys
import time
from pathlib import Path

import pytest

from _cli import dptrain, tiny_gpt_config
from dptrain.config import RunConfig, identity
from dptrain.runner.log_backends import (
    CSVBackend,
    MLflowBackend,
    TensorBoardBackend,
    WandbBackend,
    check_backends,
    open_backends,
    scalars,
    tensorboard_tag,
)

ALL = ["jsonl", "tensorboard", "csv", "wandb", "mlflow"]
DOCS = Path(__file__).resolve().parents[1] / "docs"

RECORDS = [  # what metrics.jsonl holds: train records (per-rank lists among them), then an evaluation
    {"kind": "train", "step": 1, "loss": 5.5, "lr": 1e-3, "peak_rss_mb": [400.0, 410.0], "peak_tensor_mb": [None, None],
     "time": 1.7e9},
    {"kind": "train", "step": 2, "loss": 5.25, "lr": 2e-3, "peak_rss_mb": [401.0, 411.0], "peak_tensor_mb": [1.5, 1.5],
     "time": 1.7e9 + 1},
    {"kind": "eval", "step": 2, "val_loss": 5.125, "time": 1.7e9 + 2},
    {"kind": "train", "step": 3, "loss": 5.0, "lr": 3e-3, "peak_rss_mb": [402.0, 412.0], "peak_tensor_mb": [1.5, 1.5],
     "time": 1.7e9 + 3},
]


@pytest.fixture(scope="module", autouse=True)
def offline_env(tmp_path_factory):
    """W&B and MLflow kept local and quiet: no network, no telemetry, no system sampling, no files in $HOME."""
    home = tmp_path_factory.mktemp("wandb_home")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_X_DISABLE_STATS": "true",
           "WANDB_X_DISABLE_META": "true", "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
           "WANDB_ERROR_REPORTING": "false", "WANDB_INIT_TIMEOUT": "60", "WANDB_CONFIG_DIR": str(home / "config"),
           "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data"),
           "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        yield env


def logged(records, key):
    """(step, value) of ``key`` in the records that have it."""
    return [(r["step"], r[key]) for r in records if r.get(key) is not None]


# ---- reading back what each library wrote ----

def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()  # purge_orphaned_data (the default) applies a resumed writer's purge_step
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(offline_dir: Path):
    """The records of an offline run's ``run-<id>.wandb``: W&B's transaction log, a LevelDB-style log of
    ``wandb.proto.wandb_internal_pb2.Record`` messages (what ``wandb sync`` uploads). W&B ships no public reader
    (its Python one went with the move to wandb-core), so the framing is read here: a 7-byte header, then 32 KiB
    blocks of chunks, each a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and data."""
    from wandb.proto import wandb_internal_pb2

    (path,) = offline_dir.glob("run-*.wandb")
    raw = path.read_bytes()
    assert raw[:4] == b":W&B", f"{path}: not a W&B transaction log (header {raw[:7]!r})"
    pos, block, data = 7, 32768, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if pos + 7 + length > len(raw):  # a chunk still being written
            return
        data += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            data = b""
            yield record


def finished_wandb_records(offline_dir: Path, timeout_s: float = 30.0) -> list:
    """The records of an offline run once its ``exit`` record is on disk: ``run.finish()`` returns when wandb-core
    has handled the exit, and its writer reaches the file a moment later (here, now and then, after the test
    had read a log that ended early)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = list(wandb_records(offline_dir))
        if records and records[-1].WhichOneof("record_type") == "exit" or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def wandb_history(offline_dir: Path) -> tuple[list[dict], dict]:
    """The history rows (``_step`` and the values) and the final summary of an offline W&B run."""
    rows, summary = [], {}
    for record in finished_wandb_records(offline_dir):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        elif kind == "summary":
            summary.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.summary.update})
    return rows, summary


def mlflow_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


# ---- the pieces, with fake records ----

def test_scalars_split_per_rank_lists_and_leave_out_missing_values():
    assert scalars(RECORDS[0]) == {"loss": 5.5, "lr": 1e-3, "peak_rss_mb/rank0": 400.0, "peak_rss_mb/rank1": 410.0}
    assert scalars(RECORDS[2]) == {"val_loss": 5.125}


def test_check_backends_names_the_fix(monkeypatch):
    check_backends(ALL)  # the test extra installs all three libraries
    with pytest.raises(ValueError, match=r"unknown backend\(s\) \['tensorbord'\] \(did you mean \['tensorboard'\]"):
        check_backends(["jsonl", "tensorbord"])
    check_backends(["tensorboard", "csv"])  # jsonl need not be listed: metrics.jsonl is always written
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed: find_spec finds nothing
    with pytest.raises(ValueError, match=r"need mlflow, not installed here: pip install mlflow"):
        check_backends(["jsonl", "mlflow"])


def test_jsonl_is_written_whether_listed_or_not(tmp_path):
    opened = open_backends(["csv"], tmp_path, 0, run_name="run", config={}, wandb_project="p", mlflow_uri="",
                           mlflow_experiment="e")
    opened.log(RECORDS[0], 1)
    opened.close()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [RECORDS[0]]
    assert (tmp_path / "metrics.csv").is_file() and opened.where() == [f"CSV: {tmp_path / 'metrics.csv'}"]


def test_log_keys_are_not_part_of_the_checkpoint_identity():
    cfg = RunConfig()
    changed = RunConfig()
    changed.log.backends, changed.log.wandb_project, changed.log.mlflow_uri = ALL, "other", "sqlite:///x.db"
    assert identity(changed) == identity(cfg)


def test_csv_widens_its_header_once_and_drops_replayed_rows_on_resume(tmp_path):
    path = tmp_path / "metrics.csv"
    backend = CSVBackend(path, start_step=0)
    for r in RECORDS:
        backend.log(r, r["step"])
    backend.close()
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames[:3] == ["kind", "step", "loss"] and "val_loss" in reader.fieldnames
    assert [(row["kind"], int(row["step"])) for row in rows] == [(r["kind"], r["step"]) for r in RECORDS]
    assert [float(row["loss"]) for row in rows if row["loss"]] == [5.5, 5.25, 5.0]
    assert rows[2]["val_loss"] == "5.125" and rows[0]["val_loss"] == "" and rows[2]["loss"] == ""
    # a per-rank list is a column per rank, as a spreadsheet or pandas wants it
    assert "peak_rss_mb" not in reader.fieldnames
    assert (rows[1]["peak_rss_mb/rank0"], rows[1]["peak_rss_mb/rank1"]) == ("401.0", "411.0")
    assert (rows[0]["peak_tensor_mb/rank0"], rows[1]["peak_tensor_mb/rank1"]) == ("", "1.5")

    resumed = CSVBackend(path, start_step=1)  # a crash after step 3, resumed from the step-1 checkpoint
    resumed.log({**RECORDS[1], "loss": 5.3}, 2)
    resumed.close()
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(int(row["step"]), float(row["loss"])) for row in rows] == [(1, 5.5), (2, 5.3)]


def test_tensorboard_scalars_by_tag_and_step_and_purged_on_resume(tmp_path):
    backend = TensorBoardBackend(tmp_path / "tb", start_step=0)
    for r in RECORDS:
        backend.log(r, r["step"])
    backend.close()
    tags = tensorboard_scalars(tmp_path / "tb")
    # grouped in TensorBoard's sections: train/, eval/, comm/, memory/
    assert {tag.split("/")[0] for tag in tags} == {"train", "eval", "memory"}
    assert tags["train/loss"] == logged(RECORDS, "loss") and tags["eval/val_loss"] == [(2, 5.125)]
    assert tags["memory/peak_rss_mb/rank1"] == [(1, 410.0), (2, 411.0), (3, 412.0)]
    assert "memory/peak_tensor_mb/rank0" in tags

    resumed = TensorBoardBackend(tmp_path / "tb", start_step=1)
    resumed.log({**RECORDS[1], "loss": 5.3}, 2)
    resumed.close()
    # step 3 of the crashed session is hidden; TensorBoard stores float32
    assert tensorboard_scalars(tmp_path / "tb")["train/loss"] == [(1, 5.5), (2, pytest.approx(5.3))]


def test_tensorboard_sections_by_what_a_value_measures():
    assert tensorboard_tag("exposed_comm_ms", "train") == "comm/exposed_comm_ms"
    assert tensorboard_tag("comm_sent_bytes_per_step", "train") == "comm/comm_sent_bytes_per_step"
    assert tensorboard_tag("peak_tensor_mb/rank1", "train") == "memory/peak_tensor_mb/rank1"
    assert tensorboard_tag("compute_ms_per_rank/rank0", "train") == "train/compute_ms_per_rank/rank0"
    assert tensorboard_tag("val_accuracy", "eval") == "eval/val_accuracy"


def test_wandb_offline_history_summary_and_resumed_id(tmp_path):
    config = {"train": {"lr": 0.002}}
    backend = WandbBackend(tmp_path, start_step=0, project="dptrain-tests", name="fake", config=config)
    for r in RECORDS:
        backend.log(r, r["step"])
    backend.close()
    (first,) = (tmp_path / "wandb").glob("offline-run-*")
    rows, summary = wandb_history(first)
    assert [(row["_step"], row["loss"]) for row in rows] == logged(RECORDS, "loss")
    assert [(row["_step"], row["val_loss"]) for row in rows if "val_loss" in row] == [(2, 5.125)]
    assert summary["loss"] == 5.0 and summary["val_loss"] == 5.125 and summary["peak_rss_mb/rank0"] == 402.0
    run_id = (tmp_path / "wandb" / "dptrain-run-id").read_text()
    assert first.name.endswith(run_id)

    resumed = WandbBackend(tmp_path, start_step=1, project="dptrain-tests", name="fake", config=config)
    resumed.log(RECORDS[1], 2)
    resumed.close()
    (second,) = set((tmp_path / "wandb").glob("offline-run-*")) - {first}
    records = finished_wandb_records(second)
    assert [rec.run.run_id for rec in records if rec.WhichOneof("record_type") == "run"] == [run_id]
    assert [row["_step"] for row in wandb_history(second)[0]] == [2]  # the resumed session's, from the checkpoint


def test_mlflow_history_params_and_resumed_run(tmp_path, monkeypatch):
    # the file store (fast to create; MLflow 3 wants this opt-out for it); the end-to-end run uses the SQLite default
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    config = {"train": {"lr": 0.002, "betas": [0.9, 0.99]}, "run_dir": str(tmp_path)}
    backend = MLflowBackend(uri, "dptrain-tests", "fake", tmp_path, start_step=0, config=config)
    for r in RECORDS:
        backend.log(r, r["step"])
    backend.close()
    assert mlflow_history(uri, backend.run_id, "loss") == logged(RECORDS, "loss")
    assert mlflow_history(uri, backend.run_id, "val_loss") == [(2, 5.125)]
    from mlflow.tracking import MlflowClient

    run = MlflowClient(uri).get_run(backend.run_id)
    assert run.data.params == {"train.lr": "0.002", "train.betas": "[0.9, 0.99]", "run_dir": str(tmp_path)}
    assert run.info.status == "FINISHED"

    resumed = MLflowBackend(uri, "dptrain-tests", "fake", tmp_path, start_step=1, config={**config, "new": 1})
    assert resumed.run_id == backend.run_id
    resumed.log({**RECORDS[1], "loss": 5.3}, 2)
    resumed.close()
    assert (2, 5.3) in mlflow_history(uri, backend.run_id, "loss")  # MLflow keeps both points of step 2
    assert MlflowClient(uri).get_run(backend.run_id).data.params["new"] == "1"


# ---- the real CLI ----

@pytest.fixture(scope="module")
def run_all_backends(tmp_path_factory, offline_env):
    """One run with every backend: 2 ranks, 3 steps, an evaluation at the last; jsonl not listed (it is implied)."""
    tmp = tmp_path_factory.mktemp("all_backends")
    run_dir = tmp / "run"
    listed = [name for name in ALL if name != "jsonl"]
    proc = dptrain("run", "--nproc", "2", "--config", str(tiny_gpt_config(tmp)), "--run-dir", str(run_dir),
                   "--set", "train.steps=3", "--set", "log.trace_steps=0", "--set", f"log.backends={json.dumps(listed)}",
                   "--set", "log.wandb_project=dptrain-tests", cwd=tmp, env=offline_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, records, proc


@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")  # MLflow's SQLAlchemy
def test_run_with_every_backend_matches_metrics_jsonl(run_all_backends):
    run_dir, records, proc = run_all_backends
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3] and logged(records, "val_loss")[0][0] == 3
    for label in ("TensorBoard", "CSV", "W&B", "MLflow"):
        assert f"metrics also go to {label}: " in proc.stdout
    assert "wandb sync " in proc.stdout

    # TensorBoard: one event file (rank 0's), every value by tag and step (stored as float32)
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    tags = tensorboard_scalars(run_dir / "tensorboard")
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("tokens_per_s", "train/tokens_per_s"),
                     ("val_loss", "eval/val_loss"), ("exposed_comm_ms", "comm/exposed_comm_ms"),
                     ("peak_rss_mb/rank1", "memory/peak_rss_mb/rank1")):
        expected = logged(records, key) if "/" not in key else [(r["step"], r["peak_rss_mb"][1]) for r in train]
        assert [s for s, _ in tags[tag]] == [s for s, _ in expected]
        assert [v for _, v in tags[tag]] == pytest.approx([v for _, v in expected], rel=1e-6)

    # CSV: the same records in the same order, values exact
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(row["kind"], int(row["step"])) for row in rows] == [(r["kind"], r["step"]) for r in records]
    for row, r in zip(rows, records, strict=True):
        for key in ("loss", "tokens_per_s", "val_loss"):
            assert (float(row[key]) if row[key] else None) == r.get(key)
        for i, value in enumerate(r.get("peak_rss_mb", [])):
            assert float(row[f"peak_rss_mb/rank{i}"]) == value

    # W&B: one offline run (rank 0's), its history and summary, the run's config
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    history, summary = wandb_history(offline)
    assert [(row["_step"], row["loss"]) for row in history] == logged(records, "loss")
    assert summary["loss"] == train[-1]["loss"] and summary["val_loss"] == logged(records, "val_loss")[-1][1]
    (run,) = [rec.run for rec in finished_wandb_records(offline) if rec.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["train"]["steps"] == 3 and run.project == "dptrain-tests" and run.display_name == "run"

    # MLflow: the default SQLite store in the run directory, one run, its metrics and params
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{run_dir}/mlflow.db"
    client = MlflowClient(uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("dptrain").experiment_id])
    assert mlflow_history(uri, mlrun.info.run_id, "loss") == logged(records, "loss")
    assert mlflow_history(uri, mlrun.info.run_id, "val_loss") == logged(records, "val_loss")
    assert mlrun.data.params["train.steps"] == "3" and mlrun.info.run_name == "run"


def test_every_field_of_a_record_is_in_docs_run_md_metrics_table(run_all_backends):
    _, records, _ = run_all_backends
    section = (DOCS / "run.md").read_text().split("### Metrics", 1)[1].split("\n#", 1)[0]
    documented = {name for cell in re.findall(r"^\| ([^|]+) \|", section, re.MULTILINE)
                  for name in re.findall(r"`([a-z_]+)`", cell)}
    fields = {key for r in records for key in r}
    assert fields - documented == set()


def test_unknown_backend_is_refused_before_launch(tmp_path):
    run_dir = tmp_path / "run"
    proc = dptrain("run", "--config", str(tiny_gpt_config(tmp_path)), "--run-dir", str(run_dir),
                   "--set", 'log.backends=["jsonl", "tensorbord"]', cwd=tmp_path)
    assert proc.returncode == 2
    assert "log.backends: unknown backend(s) ['tensorbord'] (did you mean ['tensorboard']?)" in proc.stderr
    assert not run_dir.exists()


def test_missing_library_is_refused_before_launch(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed (the check runs in this process)
    run_dir = tmp_path / "run"
    proc = dptrain("run", "--config", str(tiny_gpt_config(tmp_path)), "--run-dir", str(run_dir),
                   "--set", 'log.backends=["jsonl", "csv", "wandb"]', cwd=tmp_path)
    assert proc.returncode == 2
    assert "need wandb, not installed here: pip install wandb" in proc.stderr
    assert not run_dir.exists()

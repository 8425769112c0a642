"""Where rank 0's metrics records go: ``metrics.jsonl`` always, and TensorBoard, CSV, Weights & Biases or MLflow
when ``log.backends`` names them, each written by its own library.

``metrics.jsonl`` is written whether ``log.backends`` lists it or not (the summary, the plots, report.html and
resumption read it). Every backend gets the records ``metrics.jsonl`` gets (``kind`` train or eval, a ``step``),
at the same moments (every ``log.every`` steps and at each evaluation), on rank 0 only, as the console. Values
keep their metrics.jsonl names (``loss``, ``val_loss``, ``tokens_per_s``); a per-rank list such as
``peak_rss_mb`` becomes ``peak_rss_mb/rank0``, ``peak_rss_mb/rank1``, ... (a CSV column each, or a scalar each
where the library takes scalars only). TensorBoard's tags are grouped into sections, ``train/``, ``eval/``,
``comm/`` and ``memory/`` (:func:`tensorboard_tag`). Logging costs a record's worth of small writes, or a queue
put (TensorBoard's writer thread, W&B's service process), per logged step.

A resumed run continues each backend from the checkpoint's step, as ``metrics.jsonl`` (``truncate_metrics``):
CSV drops its rows after that step; TensorBoard's ``purge_step`` hides the events an earlier session wrote after
it; W&B and MLflow continue the same run (see their classes for what they keep of the replayed steps).

A backend whose library is not installed is refused before launch (:func:`check_backends`, from
``validate_run``); the libraries are imported only by the backends that use them.
"""

from __future__ import annotations

import csv
import difflib
import hashlib
import importlib.util
import io
import json
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

from dptrain.config.loader import to_dict
from dptrain.utils.atomic import write_text_atomic
from dptrain.utils.files import open_file

__all__ = ["BACKENDS", "check_backends", "scalars", "tensorboard_tag", "csv_row", "LogBackends", "open_backends",
           "backends_from_config",
           "JsonlBackend", "TensorBoardBackend", "CSVBackend", "WandbBackend", "MLflowBackend"]

BACKENDS = ("jsonl", "tensorboard", "csv", "wandb", "mlflow")
# the module each library backend imports, and the package that provides it
_NEEDS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
_NOT_SCALARS = ("kind", "step", "time")


class Backend(Protocol):
    label: str  # what it is called in the run's log
    where: str  # where it writes, and how to look at it

    def log(self, record: dict, step: int) -> None: ...
    def close(self) -> None: ...


def check_backends(names: list) -> None:
    """Refuse, with a ValueError that names the fix, unknown backends and backends whose library is not
    installed (looked up, not imported: the check is cheap and has no side effects). ``jsonl`` may be left
    out: ``metrics.jsonl`` is always written (:func:`open_backends`)."""
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        close = [m for n in unknown for m in difflib.get_close_matches(str(n), BACKENDS, n=1)]
        raise ValueError(f"unknown backend(s) {unknown}" + (f" (did you mean {close}?)" if close else "") +
                         f"; choose from {', '.join(BACKENDS)}")
    missing = [package for name, (module, package) in _NEEDS.items()
               if name in names and importlib.util.find_spec(module) is None]
    if missing:
        raise ValueError(f"{names} need {', '.join(missing)}, not installed here: pip install {' '.join(missing)} "
                         "(or pip install 'dptrain[logging]' for all three)")


def scalars(record: dict) -> dict[str, float]:
    """A record's numbers by name, as TensorBoard, W&B and MLflow take them: a per-rank list becomes
    ``name/rank<i>``; ``kind``, ``step``, ``time`` and missing values (None) are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in _NOT_SCALARS:
            continue
        if isinstance(value, list):
            out.update({f"{key}/rank{i}": float(v) for i, v in enumerate(value) if isinstance(v, (int, float))})
        elif isinstance(value, (int, float)):
            out[key] = float(value)
    return out


# TensorBoard's sections: a value's tag is "<section>/<name>" (TensorBoard groups the scalars by the part before
# the first "/"). Evaluation records go to eval/; a train record's values by what they measure.
_COMM = ("comm_bytes_per_step", "comm_compressed_bytes_per_step", "comm_sent_bytes_per_step", "comm_busy_ms",
         "exposed_comm_ms", "tail_comm_ms", "overlap_pct", "gossip_mix_ms", "consensus_distance")
_MEMORY = ("peak_rss_mb", "peak_tensor_mb")


def tensorboard_tag(name: str, kind: str) -> str:
    """``name`` (a :func:`scalars` name, ``peak_rss_mb/rank0`` included) in its section: ``eval/val_loss``,
    ``comm/exposed_comm_ms``, ``memory/peak_rss_mb/rank0``, ``train/loss``."""
    base = name.split("/")[0]
    section = "eval" if kind == "eval" else "comm" if base in _COMM else "memory" if base in _MEMORY else "train"
    return f"{section}/{name}"


def csv_row(record: dict) -> dict[str, Any]:
    """A record as CSV cells: a per-rank list as one column per rank (``peak_rss_mb/rank0``, ...), None empty, a
    dict as JSON text, the rest as it is."""
    row: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, list):
            row.update({f"{key}/rank{i}": _cell(v) for i, v in enumerate(value)})
        else:
            row[key] = _cell(value)
    return row


class JsonlBackend:
    """``metrics.jsonl``: each record as one JSON line, line-buffered (a crash loses at most the line being written).
    The run's own record: summary.json, the plots, report.html and resumption read it."""

    label = "metrics.jsonl"

    def __init__(self, path: Path):
        self.where = f"{path}"
        self._file = open_file(path, "a")  # line-buffered, never through a link

    def log(self, record: dict, step: int) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardBackend:
    """TensorBoard event files in ``log_dir``, by torch's ``SummaryWriter``: one scalar per value at the record's
    step and wall time, tagged in its section (:func:`tensorboard_tag`). A resumed run passes ``purge_step``: TensorBoard then hides the events an earlier session
    wrote after the checkpoint (they stay in its event file)."""

    label = "TensorBoard"

    def __init__(self, log_dir: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.where = f"{log_dir} (tensorboard --logdir {log_dir})"
        self._writer = SummaryWriter(str(log_dir), purge_step=start_step + 1 if start_step else None)

    def log(self, record: dict, step: int) -> None:
        kind = record.get("kind", "train")
        for name, value in scalars(record).items():
            self._writer.add_scalar(tensorboard_tag(name, kind), value, global_step=step, walltime=record.get("time"))

    def close(self) -> None:
        self._writer.close()


class CSVBackend:
    """``metrics.csv``: one row per record, train and eval alike (column ``kind`` tells them apart).

    The columns are the keys seen so far, in first-seen order. A record that brings new keys (the first
    evaluation's ``val_loss``) rewrites the file once with the wider header, so the file always has one valid
    header; earlier rows get empty cells. A per-rank list is a column per rank (:func:`csv_row`), None is empty.
    A resumed run first drops the rows after the checkpoint's step.
    """

    label = "CSV"

    def __init__(self, path: Path, start_step: int):
        self.path, self.where = path, f"{path}"
        self.columns: list[str] = []
        if path.exists():
            with open_file(path, "r", newline="") as f:
                reader = csv.DictReader(f)
                rows = [row for row in reader if int(row["step"]) <= start_step]
                self.columns = list(reader.fieldnames or [])
            self._rewrite(rows)
        self._file = open_file(path, "a", newline="")  # line-buffered, never through a link

    def log(self, record: dict, step: int) -> None:
        row = csv_row(record)
        new = [key for key in row if key not in self.columns]
        if new:  # rare: the first record, the first evaluation
            self._file.close()
            with open_file(self.path, "r", newline="") as f:
                rows = list(csv.DictReader(f)) if self.columns else []
            self.columns += new
            self._rewrite(rows)
            self._file = open_file(self.path, "a", newline="")
        csv.DictWriter(self._file, self.columns, lineterminator="\n").writerow(row)

    def close(self) -> None:
        self._file.close()

    def _rewrite(self, rows: list[dict]) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, self.columns, restval="", lineterminator="\n")
        if self.columns:
            writer.writeheader()
        writer.writerows(rows)
        write_text_atomic(self.path, text.getvalue())


def _cell(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, (list, dict)) else "" if value is None else value


class WandbBackend:
    """A Weights & Biases run, offline (no server is contacted): ``<run_dir>/wandb/offline-run-<time>-<id>``, to
    upload later with ``wandb sync <that directory>``.

    Its id is kept in ``<run_dir>/wandb/dptrain-run-id``, so a resumed session writes another offline run with the
    same id (``resume="allow"``), starting at the checkpoint's step + 1; ``wandb sync`` uploads them, oldest first,
    into one W&B run. W&B wants increasing steps: how the server treats the steps a crashed session logged after
    the checkpoint is W&B's choice (metrics.jsonl holds the resumed values). dptrain's console is not captured.
    """

    label = "W&B"

    def __init__(self, run_dir: Path, start_step: int, project: str, name: str, config: dict):
        import wandb

        id_file = run_dir / "wandb" / "dptrain-run-id"
        run_id = id_file.read_text().strip() if start_step and id_file.exists() else uuid.uuid4().hex[:12]
        id_file.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(id_file, run_id)
        self._run = wandb.init(mode="offline", dir=str(run_dir), project=project, name=name, id=run_id,
                               resume="allow", config=config, settings=wandb.Settings(console="off", silent=True))
        offline_dir = Path(self._run.dir).parent  # run.dir is the run's files/ folder
        self.where = f"{offline_dir} (offline; upload with: wandb sync {offline_dir})"

    def log(self, record: dict, step: int) -> None:
        self._run.log(scalars(record), step=step)

    def close(self) -> None:
        self._run.finish()


class MLflowBackend:
    """An MLflow run at ``tracking_uri``, in experiment ``experiment``, named ``name``; params are the config,
    flattened to dotted keys. Through an explicit ``MlflowClient``: ``mlflow.start_run`` and ``mlflow.log_metrics``
    keep the active run and the tracking URI in process globals, which would leak into the user's own code.

    A resumed session continues the run tagged with this run directory (``dptrain.run_id``). MLflow keeps every
    point it was given: steps a crashed session logged after the checkpoint appear twice, the later point the
    resumed run's. Params are immutable in MLflow: those the run has keep their first values (config.toml holds
    the current ones), new ones are added.
    """

    label = "MLflow"

    def __init__(self, tracking_uri: str, experiment: str, name: str, run_dir: Path, start_step: int, config: dict):
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient(tracking_uri)
        self.run_id = _mlflow_run(client, experiment, name, run_dir, resume=start_step > 0)
        have = client.get_run(self.run_id).data.params
        params = [Param(k, v[:500]) for k, v in _flatten(config).items() if k not in have]  # 500: older servers' cap
        client.log_batch(self.run_id, params=params)
        self.where = f"run {self.run_id} at {tracking_uri} (mlflow ui --backend-store-uri {tracking_uri})"
        self._metric = Metric  # imported here: mlflow is optional
        self._pending = None  # the batch in flight, waited for before the next and at close

    def log(self, record: dict, step: int) -> None:
        ms = int(1000 * record.get("time", time.time()))
        metrics = [self._metric(k, v, ms, step) for k, v in scalars(record).items()]
        # Queued for MLflow's writer, one batch in flight: a synchronous batch into SQLite costs ~20 ms, a step's
        # worth, but MLflow writes queued batches on a pool of threads, and two at once race in a file store
        # (both create a new metric's directory: "[Errno 17] File exists").
        self._wait()
        self._pending = self._client.log_batch(self.run_id, metrics=metrics, synchronous=False)

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def close(self) -> None:
        self._wait()
        self._client.set_terminated(self.run_id)


def _mlflow_run(client, experiment: str, name: str, run_dir: Path, resume: bool) -> str:
    """The id of the MLflow run of ``run_dir``: the newest one tagged with it when resuming, else a new one."""
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(
        experiment, artifact_location=str(run_dir / "mlartifacts"))  # not ./mlruns in the working directory
    tag = hashlib.sha1(str(run_dir).encode()).hexdigest()[:16]  # a path may hold quotes; the filter may not
    previous = client.search_runs([experiment_id], filter_string=f"tags.`dptrain.run_id` = '{tag}'",
                                  order_by=["attributes.start_time DESC"], max_results=1) if resume else []
    if previous:
        client.update_run(previous[0].info.run_id, status="RUNNING")
        return previous[0].info.run_id
    return client.create_run(experiment_id, run_name=name, tags={"dptrain.run_id": tag}).info.run_id


def _flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """``{"train": {"lr": 0.002}}`` as ``{"train.lr": "0.002"}``; lists and a field's dicts as JSON text."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict) and not prefix:  # a section
            flat.update(_flatten(value, f"{key}."))
        else:
            flat[prefix + key] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return flat


class LogBackends:
    """The configured backends behind one ``log`` and ``close``; rank 0 holds one, the other ranks none."""

    def __init__(self, backends: list[Backend]):
        self.backends = backends

    def log(self, record: dict, step: int) -> None:
        for backend in self.backends:
            backend.log(record, step)

    def close(self) -> None:
        """Close every backend, even when one fails (the first failure is raised after)."""
        errors = []
        for backend in self.backends:
            try:
                backend.close()
            except Exception as e:  # noqa: BLE001 - the others still need closing
                errors.append(e)
        if errors:
            raise errors[0]

    def where(self) -> list[str]:
        """Where each backend beyond metrics.jsonl writes, and how to look at it."""
        return [f"{b.label}: {b.where}" for b in self.backends[1:]]


def open_backends(names: list[str], run_dir: Path, start_step: int, *, run_name: str, config: dict,
                  wandb_project: str, mlflow_uri: str, mlflow_experiment: str) -> LogBackends:
    """Open ``names`` (checked by :func:`check_backends`) for a run in ``run_dir`` that starts after ``start_step``;
    ``metrics.jsonl`` first. An empty ``mlflow_uri`` is ``sqlite:///<run_dir>/mlflow.db`` (MLflow 3 refuses a
    new file store ``file://...`` unless ``MLFLOW_ALLOW_FILE_STORE=true`` is set)."""
    makers = {
        "tensorboard": lambda: TensorBoardBackend(run_dir / "tensorboard", start_step),
        "csv": lambda: CSVBackend(run_dir / "metrics.csv", start_step),
        "wandb": lambda: WandbBackend(run_dir, start_step, wandb_project, run_name, config),
        "mlflow": lambda: MLflowBackend(mlflow_uri or f"sqlite:///{run_dir}/mlflow.db", mlflow_experiment, run_name,
                                        run_dir, start_step, config),
    }
    opened = LogBackends([JsonlBackend(run_dir / "metrics.jsonl")])
    try:
        for name in dict.fromkeys(names):  # in order, once each
            if name != "jsonl":
                opened.backends.append(makers[name]())
    except BaseException:
        opened.close()
        raise
    return opened


def backends_from_config(cfg, run_dir: Path, start_step: int) -> LogBackends:
    """The trainer's side of :func:`open_backends`: ``[log]`` unpacked; the run is named after its directory."""
    log = cfg.log
    return open_backends(log.backends, run_dir, start_step, run_name=run_dir.name, config=to_dict(cfg),
                         wandb_project=log.wandb_project, mlflow_uri=log.mlflow_uri,
                         mlflow_experiment=log.mlflow_experiment)

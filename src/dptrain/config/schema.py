"""What a run is made of: nested dataclasses, one per section of a run's TOML file.

Every field has a default and a help string (``dptrain run --show-config`` prints them).
Unknown keys are errors (see ``loader.py``), so a mistyped key never silently falls back
to its default. The library itself never reads these objects: the trainer unpacks them
into explicit arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from dptrain.comm.collectives import ALGORITHMS
from dptrain.config.compression_section import CompressionConfig
from dptrain.config.errors import ConfigError
from dptrain.config.fields import at_least, opt
from dptrain.config.strategy_sections import DiLoCoConfig, GossipConfig, LocalSGDConfig, PSConfig, ZeROConfig


@dataclass
class TaskConfig:
    name: str = opt("chargpt", "built-in task: a byte-level GPT on the Python standard library's "
                    "source (chargpt) or a small classifier on synthetic data (classifier)",
                    choices=("chargpt", "classifier"))
    model: str = opt("", "your own model instead of the task's: 'package.module:factory'; the factory "
                     "gets model_args as keyword arguments and must accept the task's batches (docs/your-data.md: "
                     "what a model may return)")
    model_args: dict = opt({}, "keyword arguments for the model factory")


@dataclass
class DataConfig:
    source: str = opt("task", "where the training data comes from: the task's own (task), token files train.bin and "
                      "val.bin (tokens), UTF-8 text files tokenized into token files (text), local files read by "
                      "Hugging Face datasets and tokenized into token files (hf), or your own Python (factory); "
                      "docs/your-data.md", choices=("task", "tokens", "text", "hf", "factory"))
    dir: str = opt("", "tokens: the directory holding train.bin and val.bin; text and hf: where they are prepared "
                   "(default data/<name of the first input>)")
    dtype: str = opt("auto", "token files' integer type: uint16, uint32, or auto (the directory's meta.json, else "
                     "uint16 as nanoGPT writes them)", choices=("auto", "uint16", "uint32"))
    sampling: str = opt("sequential", "token data: sequential (non-overlapping windows of block_size + 1 tokens, "
                        "shuffled each epoch: every token once an epoch, as the built-in task) or random (a window "
                        "at a random offset for every sample, as nanoGPT)", choices=("sequential", "random"))
    block_size: int = opt(0, "token data: tokens a sample feeds the model; 0: gpt.block_size for the built-in GPT, "
                          "the config's context length (at most 1024) for a Hugging Face model")
    text: list = opt([], "text: files, directories (their files, recursively) or globs of UTF-8 text")
    files: list = opt([], "hf: local data files for Hugging Face datasets (.jsonl or .json, .parquet, .csv, .arrow)")
    text_column: str = opt("text", "hf: the column that holds the text")
    val_files: list = opt([], "text and hf: files held out for validation; empty: the last val_fraction of the "
                          "tokens")
    val_fraction: float = opt(0.05, "text and hf without val_files: the tail of the token stream held out for "
                              "validation")
    tokenizer: str = opt("bytes", "text and hf: bytes (one token per byte, vocabulary 256) or the path of a Hugging "
                         "Face tokenizer.json (nothing is downloaded)")
    factory: str = opt("", "factory: 'package.module:make_datasets', returning the train and validation torch "
                       "Datasets (and optionally a collate function third)")
    factory_args: dict = opt({}, "factory: keyword arguments for the data factory")
    allow_changed: bool = opt(False, "resume a checkpoint on data files that changed since it was written (token "
                              "counts or sampled contents differ; a resumed run is otherwise refused, naming what "
                              "changed; docs/your-data.md)")


@dataclass
class HFConfig:
    path: str = opt("", "a Hugging Face transformers model directory on this machine (config.json, and weights to "
                    "fine-tune): its causal language model is trained instead of the built-in GPT; the hub is "
                    "never contacted")
    from_scratch: bool = opt(False, "train the directory's architecture from a fresh initialisation, even if the "
                             "directory holds weights")


@dataclass
class GPTConfig:
    n_layer: int = opt(4, "transformer blocks")
    n_head: int = opt(4, "attention heads per block")
    n_embd: int = opt(192, "embedding width")
    block_size: int = opt(64, "context length in tokens; also the length of a training sample")
    vocab_size: int = opt(0, "vocabulary size; 0: the data's (256 for the built-in task and for bytes, the token "
                          "directory's meta.json otherwise)")
    dropout: float = opt(0.0, "dropout probability")
    corpus_bytes: int = opt(2_000_000, "bytes of standard-library source to train on")
    val_fraction: float = opt(0.05, "tail of the corpus held out for validation")


@dataclass
class ClassifierConfig:
    features: int = opt(16, "input dimension")
    classes: int = opt(8, "number of classes (Gaussian clusters)")
    hidden: int = opt(64, "hidden width of the MLP")
    depth: int = opt(2, "hidden layers")
    samples: int = opt(8192, "training samples (validation gets a quarter as many)")
    noise: float = opt(1.0, "cluster standard deviation; larger is harder")


# train.lr where the config does not set it, by train.optimizer (the scales docs/optim.md measured).
DEFAULT_LR = {"adamw": 2e-3, "adam": 2e-3, "onebit_adam": 2e-3, "sgd": 2e-3, "lamb": 2e-2, "lars": 2.0}


def _lr_defaults() -> str:
    """DEFAULT_LR in words, for train.lr's help: "adamw, adam, onebit_adam, sgd 0.002; lamb 0.02; lars 2"."""
    by_rate: dict[float, list[str]] = {}
    for name, lr in DEFAULT_LR.items():
        by_rate.setdefault(lr, []).append(name)
    return "; ".join(f"{', '.join(names)} {lr:g}" for lr, names in by_rate.items())


@dataclass
class TrainConfig:
    steps: int = opt(300, "optimizer steps to train for")
    global_batch_size: int | None = opt(None, "samples per optimizer step over all ranks; of global, micro and "
                                        "accumulation give any two (32 global if none is given)")
    micro_batch_size: int | None = opt(None, "samples per rank per forward/backward")
    grad_accum_steps: int | None = opt(None, "micro-steps per optimizer step (gradients synced on the last)")
    optimizer: str = opt("adamw", "optimizer: adamw, adam, sgd, the layer-wise lars and lamb, or onebit_adam (1-bit "
                         "Adam: AdamW, then its momentum averaged in 1 bit per element, strategy ddp; "
                         "docs/compression.md) (dptrain.optim)",
                         choices=("adamw", "adam", "sgd", "lars", "lamb", "onebit_adam"))
    onebit_freeze_step: int = opt(0, "optimizer onebit_adam: steps of uncompressed AdamW before the second moment is "
                                  "frozen and the momentum is averaged in 1 bit per element (0: once the second "
                                  "moment settles, not before train.warmup_steps; docs/compression.md)")
    lr: float | None = opt(None, "peak learning rate at base_batch_size, before the scaling rule; none: the "
                           f"optimizer's default ({_lr_defaults()}: the layer-wise lamb and lars scale each "
                           "layer's step by its trust ratio, so their rates are other numbers; docs/optim.md)")
    lr_scaling: str = opt("none", "how the peak LR follows the global batch: none, linear (lr x global/base) "
                          "or sqrt (lr x sqrt(global/base))", choices=("none", "linear", "sqrt"))
    base_batch_size: int = opt(32, "the global batch size lr is given for")
    warmup_steps: int = opt(30, "linear warmup from 0 to the peak LR")
    min_lr_ratio: float = opt(0.1, "cosine decay ends at peak x this, at the last step")
    weight_decay: float = opt(0.1, "decoupled weight decay (adamw) or L2 (sgd), on matrices only")
    betas: list = opt([0.9, 0.99], "Adam betas")
    momentum: float = opt(0.9, "SGD momentum")
    grad_clip: float = opt(1.0, "clip gradients to this global L2 norm; 0 disables (the norm is still logged)")
    max_skipped_steps: int = opt(20, "consecutive steps skipped for non-finite gradients that end the run with "
                                 "exit 1 (0: never)")
    precision: str = opt("fp32", "fp32, bf16 (autocast on CPU and GPU) or fp16 (autocast with a loss "
                         "scaler, GPU only)", choices=("fp32", "bf16", "fp16"))
    seed: int = opt(0, "seed for initialisation and data order")

    def __post_init__(self):
        # A config that does not set train.lr gets its optimizer's default: AdamW's 2e-3 would leave LAMB and LARS
        # far from their scale (docs/optim.md, "In dptrain run"). Resolved here, once, so that the resolved
        # config (config.toml, the checkpoint's identity) holds the rate the run used.
        if self.lr is None:
            self.lr = DEFAULT_LR.get(self.optimizer, DEFAULT_LR["adamw"])

    def check(self) -> None:
        """This section's own values (the rules across sections: dptrain.strategies.requirements)."""
        at_least("train", self, {"steps": 1, "base_batch_size": 1, "warmup_steps": 0, "grad_clip": 0.0,
                                  "weight_decay": 0.0, "momentum": 0.0})
        if not self.lr > 0:  # the loader refuses nan and inf already
            raise ConfigError(f"train.lr must be a positive learning rate, got {self.lr}; e.g. --set train.lr=3e-4")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio must be within [0, 1], got {self.min_lr_ratio}")
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
            raise ConfigError(f"train.betas must be two numbers in [0, 1), got {self.betas}")
        if self.optimizer == "onebit_adam" and self.onebit_freeze_step < 0:
            raise ConfigError(f"train.onebit_freeze_step {self.onebit_freeze_step}: 1-bit Adam needs at least one "
                              "uncompressed step to estimate the second moment it freezes; set 0 (freeze when it "
                              "settles) or a step >= 1")


@dataclass
class DistributedConfig:
    strategy: str = opt("ddp", "data-parallel strategy, one of the registered ones (`dptrain run --config-reference` "
                        "lists them with what each is; docs/architecture.md): replicated (ddp), ZeRO stage 1, 2 or 3 "
                        "(zero1-3; [zero]), a parameter server (ps; [ps]), gossip ([gossip]), local SGD (localsgd; "
                        "[localsgd]) or DiLoCo (diloco; [diloco]); `dptrain run --strategy NAME` sets it")
    backend: str = opt("auto", "process-group backend: nccl on CUDA, gloo on CPU (auto)",
                       choices=("auto", "gloo", "nccl"))
    timeout_s: float = opt(300.0, "collective timeout: a rank stuck this long fails the job")
    roll_call_s: float = opt(3.0, "after a collective fails, how long each surviving rank waits for the others to "
                             "report theirs; the ranks that report nothing (hung or dead) are named "
                             "(docs/reliability.md)")
    check_collectives: str = opt("first", "compare each gradient bucket's all-reduce (op, dtype, shape, comm hook; "
                                 "with ZeRO each unit's all-gather and reduce-scatter) across ranks through the "
                                 "job's store before calling it: on its first use (first), on every use (every: "
                                 "names a rank that takes another path mid-run, at store round trips per call), "
                                 "or off (docs/reliability.md)",
                                 choices=("off", "first", "every"))

    def check(self) -> None:
        """This section's own values (what the strategy asks of the world: dptrain.strategies.requirements)."""
        at_least("distributed", self, {"timeout_s": 1.0, "roll_call_s": 0.0})


@dataclass
class DDPConfig:
    bucket_cap_mb: float | None = opt(None, "gradient bucket size in MiB (default 25 with a 1 MiB first bucket)")
    last_bucket_cap_mb: float | None = opt(None, "ddp: give the gradients ready last a bucket of about this many MiB "
                                                 "of their own, so the all-reduce nothing overlaps is small "
                                                 "(default: none, torch's layout)")
    optimizer_in_backward: bool = opt(False, "ddp: step each bucket's parameters as soon as its all-reduce completes, "
                                             "overlapping the later buckets' (needs train.grad_clip = 0, one "
                                             "micro-step per step and no fp16 scaler; docs/ddp.md)")
    gradient_as_bucket_view: bool = opt(False, "make .grad views into the communication buckets")
    find_unused_parameters: bool = opt(False, "allow parameters (DDP) or units (ZeRO) that get no gradient on "
                                              "some steps or ranks")
    static_graph: bool = opt(False, "the set of used parameters never changes")
    algorithm: str = opt("native", "all-reduce algorithm for gradient buckets: the backend's (native) or "
                         "dptrain's own ring, tree, naive, hierarchical (docs/collectives.md)",
                         choices=ALGORITHMS)
    ranks_per_node: int = opt(0, "ranks per node for the hierarchical algorithm; 0 uses the local world size")

    def check(self) -> None:
        """This section's own values (what the strategy and the other sections ask: dptrain.strategies.requirements)."""
        for name in ("bucket_cap_mb", "last_bucket_cap_mb"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"ddp.{name} must be a positive size in MiB, got {value}; leave it unset for the "
                                  "default")


@dataclass
class StragglerConfig:
    rank: int = opt(-1, "inject a straggler for experiments: this rank computes factor times slower (it sleeps "
                    "after each forward); -1: none")
    factor: float = opt(2.0, "how many times slower the straggler is, >= 1")

    def check(self) -> None:
        """This section's own values (the rank against the world: the run's validation)."""
        if self.factor < 1.0:
            raise ConfigError(f"straggler.factor must be at least 1 (how many times slower), got {self.factor}")


@dataclass
class BalanceConfig:
    dynamic_batching: bool = opt(False, "strategy ddp: give each rank a share of the global batch proportional to "
                                 "its measured speed (same samples, exact weighting; docs/async.md)")
    every: int = opt(5, "dynamic batching: rebalance every this many steps (one small all-gather)")
    smoothing: float = opt(0.5, "dynamic batching: weight of the past in the moving average of seconds per sample, "
                           "in [0, 1)")

    def check(self) -> None:
        """This section's own values (whether the strategy can: dptrain.strategies.requirements)."""
        if not self.dynamic_batching:
            return
        if self.every < 1:
            raise ConfigError(f"balance.every must be at least 1, got {self.every}")
        if not 0.0 <= self.smoothing < 1.0:
            raise ConfigError(f"balance.smoothing must be in [0, 1), got {self.smoothing}")


@dataclass
class DivergenceConfig:
    every: int = opt(0, "every this many steps, compare a checksum of every parameter, buffer and optimizer-state "
                        "tensor across ranks (strategies ddp, zero1, zero2); 0: off")
    repair: bool = opt(False, "on a mismatch, copy a healthy rank's state to the others and go on, instead of "
                              "stopping with an error")

    def check(self) -> None:
        """This section's own values (whether the strategy keeps replicas: dptrain.strategies.requirements)."""
        if self.every < 0:
            raise ConfigError(f"divergence.every must be >= 0 (0: off), got {self.every}")


@dataclass
class LiveConfig:
    enabled: bool = opt(False, "live recovery: survivors go on without a restart (a quorum each step, a commit vote, "
                        "a restarted worker healed from a peer; under local SGD and DiLoCo only where the replicas "
                        "meet; docs/reliability.md, \"Live recovery\")")
    heartbeat_timeout_s: float = opt(5.0, "live recovery: a worker whose heartbeat has not moved for this long is "
                                     "dropped from the next quorum; also the timeout of a round's collectives")
    join_timeout_s: float = opt(30.0, "live recovery: how long a round waits for a worker that beats but does not "
                                "arrive (a stall, a hang) before it closes without it")
    start_timeout_s: float = opt(120.0, "live recovery: how long the first round waits for every worker to start")
    min_workers: int = opt(1, "live recovery: the fewest workers a step may run with")
    on_too_few: str = opt("stop", "live recovery: below min_workers, stop with an error naming the missing workers, "
                          "or wait for them (up to wait_timeout_s)", choices=("stop", "wait"))
    wait_timeout_s: float = opt(600.0, "live recovery: how long on_too_few = \"wait\" waits")
    global_batch: str = opt("shrink", "live recovery: a step with k of N workers takes k/N of the global batch "
                            "(shrink), or the whole global batch, each of the k more micro-steps (constant: the same "
                            "optimizer step as with N, k/N of the throughput)", choices=("shrink", "constant"))
    lr_scaling: str = opt("none", "live recovery with global_batch = \"shrink\": \"linear\" scales a step's "
                          "learning rate by k/N, \"none\" keeps it", choices=("none", "linear"))
    check_every: int = opt(0, "live recovery: every this many steps each worker records a hash of its whole state in "
                           "logs/live<r>.jsonl (survivors' hashes are equal); 0: only a heal is hashed")
    max_restarts: int = opt(100, "live recovery under dptrain run --nproc: how many times the launcher restarts "
                            "each worker that fails")

    def check(self) -> None:
        """This section's own values (what the strategy and the rest must be: dptrain.strategies.requirements)."""
        if not self.enabled:
            return
        at_least("live", self, {"heartbeat_timeout_s": 0.2, "join_timeout_s": 0.0, "start_timeout_s": 1.0,
                                 "min_workers": 1, "wait_timeout_s": 0.0, "max_restarts": 0,
                                 "check_every": 0})
        if self.global_batch == "constant" and self.lr_scaling != "none":
            raise ConfigError(f"live.global_batch = \"constant\" keeps the global batch with k of N workers, so "
                              f"there is nothing to scale the learning rate for: live.lr_scaling = "
                              f"{self.lr_scaling!r} is for global_batch = \"shrink\"; set one of the two back")


@dataclass
class CheckpointConfig:
    every: int = opt(100, "save a checkpoint every this many steps (and at the end); 0 saves only at the end")
    keep_last: int = opt(2, "checkpoints kept; older ones are deleted after a newer one is complete")
    resume: bool = opt(True, "resume from the latest checkpoint in the run directory")

    def check(self) -> None:
        """This section's own values."""
        at_least("checkpoint", self, {"every": 0, "keep_last": 1})


@dataclass
class LogConfig:
    every: int = opt(10, "log metrics every this many steps")
    eval_every: int = opt(100, "evaluate on the validation split every this many steps; 0 only at the end")
    eval_batches: int = opt(8, "validation batches per evaluation (per rank)")
    trace_start: int = opt(5, "first step recorded in the Chrome trace (after warm-up)")
    trace_steps: int = opt(3, "steps recorded in the Chrome trace; 0 disables it")
    progress: str = opt("auto", "progress bar (bar), log lines (lines), or bar when a terminal (auto)",
                        choices=("auto", "bar", "lines"))
    plots: bool = opt(True, "write loss and throughput plots (PNG) and report.html (interactive) at the end")
    report_js: str = opt("inline", "where report.html gets plotly.js: inline (in the page, about 4.6 MB, opens "
                         "offline), cdn (a script tag to cdn.plot.ly at the version dptrain's plotly ships; needs a "
                         "network), shared (one copy in the run directory's parent folder, written once, referred "
                         "to relatively: move the folder whole)", choices=("inline", "cdn", "shared"))
    backends: list = opt(["jsonl"], "where rank 0's metrics records go, a list of: jsonl (metrics.jsonl, always "
                         "written, listed or not: the summary, plots and resumption read it), tensorboard (the run "
                         "directory's "
                         "tensorboard/), csv (its metrics.csv), wandb (an offline W&B run in its wandb/, uploaded "
                         "later with wandb sync), mlflow (an MLflow run at mlflow_uri); pip install "
                         "'dptrain[logging]' installs their libraries (docs/run.md, Logging backends)")
    wandb_project: str = opt("dptrain", "backend wandb: the W&B project of the run (named after the run directory)")
    mlflow_uri: str = opt("", "backend mlflow: the tracking URI; empty: an SQLite store, mlflow.db in the run "
                          "directory")
    mlflow_experiment: str = opt("dptrain", "backend mlflow: the experiment of the run (named after the run "
                                 "directory)")

    def check(self) -> None:
        """This section's own values (the backends' libraries: the run's validation)."""
        at_least("log", self, {"every": 1, "eval_every": 0, "eval_batches": 1, "trace_start": 1, "trace_steps": 0})


@dataclass
class RunConfig:
    run_dir: str = opt("", "where the run writes everything; default runs/<task>")
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    hf: HFConfig = field(default_factory=HFConfig)
    gpt: GPTConfig = field(default_factory=GPTConfig)
    classifier: ClassifierConfig = field(default_factory=ClassifierConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    zero: ZeROConfig = field(default_factory=ZeROConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    gossip: GossipConfig = field(default_factory=GossipConfig)
    localsgd: LocalSGDConfig = field(default_factory=LocalSGDConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    live: LiveConfig = field(default_factory=LiveConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def check(self) -> None:
        """Every section's own values, each by its ``check()``, whichever strategy runs: a strategy's section refuses
        a value no run could use ([diloco] period 0) before launch; what it asks of the world and the model is its
        registry entry's ``check``."""
        for section in fields(self):
            check = getattr(getattr(self, section.name), "check", None)
            if check is not None:
                check()


# Fields that do not change what a step computes: changing them between a run and its
# resumption is allowed. Everything else is part of the run's identity (checkpoint.py).
NOT_IDENTITY = {"run_dir", "train.steps", "train.micro_batch_size", "train.grad_accum_steps", "data.allow_changed",
                "train.max_skipped_steps",
                "distributed", "ddp", "compression", "zero", "ps", "gossip", "localsgd", "diloco", "straggler", "balance", "divergence",
                "live", "checkpoint", "log"}


# Fields added after checkpoints were written: left out of the identity while they hold their
# default, so a checkpoint written before they existed still resumes (and one that sets them
# differently does not).
ADDED_LATER = ("data.", "hf.", "gpt.vocab_size", "train.onebit_freeze_step")


def section_fields(cls: type) -> dict[str, Any]:
    return {f.name: f for f in fields(cls)}


def reference_markdown() -> str:
    """Every config field with its default and meaning, as the tables in docs/run.md."""
    import json

    out = ["**top level**", "", "| key | default | meaning |", "|---|---|---|"]
    for section in fields(RunConfig):
        cls = section.default_factory if callable(section.default_factory) else None
        if cls is None:
            out.append(f"| `{section.name}` | `{json.dumps(section.default)}` | {section.metadata['help']}. |")
            continue
        out += ["", f"**[{section.name}]**", "", "| key | default | meaning |", "|---|---|---|"]
        for f in fields(cls):
            default = f.default_factory() if callable(f.default_factory) else f.default
            shown = "none" if default is None else json.dumps(default)
            allowed = f.metadata.get("choices")
            choices_text = f" One of: {', '.join(allowed)}." if allowed else ""
            out.append(f"| `{f.name}` | `{shown}` | {f.metadata['help']}.{choices_text} |")
    return "\n".join(out).replace("..", ".")

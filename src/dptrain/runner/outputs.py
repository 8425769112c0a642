"""What every strategy's run ends with: validation over the held-out split, and the weights file."""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from dptrain.data.sampler import DistributedSampler
from dptrain.tasks.base import collate
from dptrain.utils.weights_file import save_state_file

__all__ = ["evaluate", "val_sums", "val_metrics", "save_weights", "save_hf_model"]


def evaluate(engine, task, num_batches: int, progress: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Collective: validation metrics over ``num_batches`` micro-batches per rank, summed over all ranks.
    ``progress`` is called after each batch (the heartbeat's mark: a long evaluation is not a hang).

    ``engine``: an :class:`~dptrain.api.engine.Engine`. Its wrapper's ``evaluating()`` runs the forward: the
    bare module where the replicas hold it whole (no gradient sync or buffer broadcast needed), the wrapper itself
    where it holds shards (ZeRO gathers each unit, and under no_grad frees it again), the module with DiLoCo's
    global weights swapped in between its outer steps.
    """
    with engine.model.evaluating() as model:
        sums = val_sums(model, task, engine.plan.micro_batch_size, num_batches, dist.get_world_size(),
                        dist.get_rank(), engine.to_device, engine.autocast, progress)
    keys = sorted(sums)
    totals = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=engine.device)
    dist.all_reduce(totals)
    return val_metrics(dict(zip(keys, totals.tolist(), strict=True)))


@torch.no_grad()
def val_sums(model: torch.nn.Module, task, micro_batch: int, num_batches: int, replicas: int = 1, rank: int = 0,
             to_device: Callable = lambda b: b, autocast: Callable = contextlib.nullcontext,
             progress: Callable[[], None] = lambda: None) -> dict[str, float]:
    """``task.eval_sums`` over this rank's first ``num_batches`` micro-batches of the unshuffled validation split.

    Rank ``r`` of ``replicas`` takes positions ``r, r + replicas, ...``, so the ranks together
    cover the same samples as one rank taking ``num_batches x replicas`` micro-batches.
    """
    was_training = model.training
    model.eval()
    sampler = DistributedSampler(task.val_set, num_replicas=replicas, rank=rank, shuffle=False, drop_last=True)
    loader = DataLoader(task.val_set, batch_size=micro_batch, sampler=sampler, collate_fn=collate(task),
                        generator=torch.Generator())  # leaves the global RNG (dropout) untouched
    sums: dict[str, float] = {}
    for batch in itertools.islice(loader, num_batches):  # the first num_batches
        with autocast():
            for key, value in task.eval_sums(model, to_device(batch)).items():
                sums[key] = sums.get(key, 0.0) + float(value)
        progress()
    model.train(was_training)
    return sums


def val_metrics(sums: dict[str, float]) -> dict[str, float]:
    """``val_loss`` (and ``val_accuracy`` when the task counts correct answers) from summed counts."""
    count = sums.get("count", 0.0) or float("nan")
    result = {"val_loss": sums.get("loss_sum", float("nan")) / count}
    if "correct" in sums:
        result["val_accuracy"] = sums["correct"] / count
    return result


def save_weights(module: torch.nn.Module, path: Path) -> None:
    """``module.state_dict()`` as safetensors at ``path``, atomically, readable by everyone.

    Every key of the state dict, a tied parameter under each of its names
    (:mod:`dptrain.utils.weights_file`, the rule every strategy and ``dptrain consolidate``
    follow), so ``module.load_state_dict(load_file(path))`` loads it strictly. Parameters
    that are views of one flat buffer (gossip, parameter-server workers) are copied out
    of it as they are written.
    """
    save_state_file(module.state_dict(), path)


def save_hf_model(cfg, run_dir: Path, log) -> None:
    """With ``hf.path``: the trained weights as a Hugging Face directory, ``<run_dir>/hf`` (rank 0, after the weights).

    ``AutoModelForCausalLM.from_pretrained(run_dir / "hf")`` loads it; the tokenizer.json the
    data was prepared with (``data.tokenizer``, or the one a token directory's meta.json names)
    travels with it. What the export warns of (a bos or eos id outside the vocabulary) goes to the log.
    """
    if not cfg.hf.path:
        return
    from dptrain.models.hf import ExportWarning, save_pretrained_from

    tokenizer = cfg.data.tokenizer if cfg.data.source in ("text", "hf") else None
    if cfg.data.source == "tokens":  # prepared by dptrain: its meta.json names the tokenizer
        from dptrain.data.tokens import read_meta

        made_with = read_meta(Path(cfg.data.dir)).get("recipe", {}).get("tokenizer", {})
        if made_with.get("kind") == "tokenizer.json" and Path(made_with.get("path", "")).is_file():
            tokenizer = made_with["path"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        out = save_pretrained_from(run_dir / "model.safetensors", cfg.hf.path, run_dir / "hf", tokenizer)
    for warning in caught:
        if issubclass(warning.category, ExportWarning):
            log.info(f"warning: {warning.message}")
        else:  # not ours: as it would have been shown
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    log.info(f"Hugging Face model: {out} (AutoModelForCausalLM.from_pretrained loads it)")

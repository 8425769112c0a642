"""dptrain.prepare(): an Accelerate-style loop against one process on the global batch, checked after every step."""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, TensorDataset

from dptrain import prepare
from dptrain.api.prepare import AccumulationState, PreparedLoader, shard_loader
from dptrain.testing import run_on_ranks

SAMPLES, MICRO, ACCUM, EPOCHS, CLIP = 30, 3, 3, 2, 0.5  # a rank's pass: 30/N samples, 10/N micro-batches


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def _dataset():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(SAMPLES, 5, generator=g), torch.randint(0, 3, (SAMPLES,), generator=g),
                         torch.arange(SAMPLES))


def _optimizer(model):  # two param groups: weight decay on the matrices only
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
                             lr=0.05)


def _scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def _params(model):
    """Every parameter, full, by name (under ZeRO gathered from the shards; all ranks take part)."""
    if hasattr(model.wrapper, "gathered_state"):
        return model.wrapper.gathered_state()
    return {name: p.detach().clone() for name, p in model.unwrap().named_parameters()}


def _prepared_run(rank, world_size, strategy):
    model = _model()
    optimizer = _optimizer(model)
    scheduler = _scheduler(optimizer)
    train = DataLoader(_dataset(), batch_size=MICRO, shuffle=True)
    val = DataLoader(_dataset(), batch_size=4)
    # any order, a loader for evaluation too
    train, scheduler, model, val, optimizer = prepare(train, scheduler, model, val, optimizer, strategy=strategy,
                                                      grad_accum_steps=ACCUM, grad_clip=CLIP)
    steps, window, passes, synced, evals = [], [], [], [], 0
    comm = model.wrapper.last_step_comm
    for _ in range(EPOCHS):
        passes.append([])
        for x, y, index in train:
            F.cross_entropy(model(x), y).backward()
            synced.append(model.wrapper.last_step_comm is not comm)  # reduced in this backward?
            comm = model.wrapper.last_step_comm
            window.append(index.tolist())
            passes[-1] += index.tolist()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if optimizer.accumulation.sync_gradients:
                steps.append((window, _params(model), optimizer.grad_norm, scheduler.get_last_lr()))
                window = []
        with torch.no_grad():  # evaluation forwards are not micro-steps
            for x, _, _ in val:
                model(x)
                evals += 1
    return steps, passes, synced, evals, scheduler.last_epoch, optimizer.steps


def _reference(windows, world_size):
    """One process: step s on the samples every rank saw in window s, all at once; the scheduler stepped once
    per process (prepare()'s default, Accelerate's rule)."""
    x, y, _ = _dataset().tensors
    model = _model()
    optimizer = _optimizer(model)
    scheduler = _scheduler(optimizer)
    out = []
    for window in windows:
        batch = torch.tensor([i for micro_batch in window for i in micro_batch])
        F.cross_entropy(model(x[batch]), y[batch]).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        optimizer.step()
        for _ in range(world_size):
            scheduler.step()
        optimizer.zero_grad()
        out.append(({n: p.detach().clone() for n, p in model.named_parameters()}, norm, scheduler.get_last_lr()))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size, strategy", [(1, "ddp"), (2, "ddp"), (2, "zero2"), (2, "zero3")])
def test_prepared_loop_matches_one_process_on_the_global_batch(world_size, strategy):
    results = run_on_ranks(_prepared_run, world_size, strategy)
    micro_per_pass = SAMPLES // world_size // MICRO
    windows_per_pass = -(-micro_per_pass // ACCUM)  # the pass's last window is shorter: 10 = 3+3+3+1, 5 = 3+2
    step_windows = [[w for rank_steps, _, _, _, _, _ in results for w in rank_steps[s][0]]
                    for s in range(EPOCHS * windows_per_pass)]
    expected = _reference(step_windows, world_size)
    for steps, _passes, synced, evals, scheduler_steps, optimizer_steps in results:
        assert len(steps) == len(expected) == optimizer_steps == EPOCHS * windows_per_pass
        assert scheduler_steps == world_size * optimizer_steps
        for (_, params, norm, lr), (want, want_norm, want_lr) in zip(steps, expected, strict=True):
            assert params.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(params[name], want[name], rtol=1e-5, atol=1e-6)
            assert norm == pytest.approx(want_norm, rel=1e-5) and lr == pytest.approx(want_lr)
        # the all-reduce ran on the window's last backward only
        sizes = [len(window) for window, _, _, _ in steps]
        assert synced == [k == size - 1 for size in sizes for k in range(size)]
        assert sizes[:windows_per_pass] == [ACCUM] * (micro_per_pass // ACCUM) + [micro_per_pass % ACCUM] * (
            micro_per_pass % ACCUM > 0)
        assert evals == EPOCHS * -(-SAMPLES // world_size // 4)
    for epoch in range(EPOCHS):  # each pass: every sample once, on one rank
        assert sorted(i for _, passes, *_ in results for i in passes[epoch]) == list(range(SAMPLES))
    assert results[0][1][0] != results[0][1][1]  # reshuffled


def _precision_run(rank, world_size, strategy):
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(x.dtype)
            return x

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), Probe(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = prepare(model, optimizer, strategy=strategy, precision="bf16")
    out = model(torch.randn(4, 5))
    out.sum().backward()
    optimizer.step()
    return seen, out.dtype, {p.dtype for p in optimizer.param_groups[0]["params"]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_bf16_computes_in_bf16_and_keeps_fp32_weights_and_outputs(strategy):
    [(seen, out_dtype, param_dtypes)] = run_on_ranks(_precision_run, 1, strategy)
    assert seen == [torch.bfloat16] and out_dtype == torch.float32 and param_dtypes == {torch.float32}


def _nonfinite_run(rank, world_size):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, scheduler = prepare(model, optimizer, _scheduler(optimizer), grad_accum_steps=2)
    params = []
    for micro_step in range(6):
        x = torch.randn(2, 5)
        if rank == 1 and micro_step == 2:
            x[0, 0] = float("inf")  # one rank's bad sample poisons the second window's reduced gradient everywhere
        model(x).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if optimizer.accumulation.sync_gradients:
            params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return optimizer.steps, optimizer.skipped_steps, scheduler.last_epoch, torch.equal(params[0], params[1])


@pytest.mark.timeout(60)
def test_a_non_finite_window_skips_the_step_and_the_scheduler_on_every_rank():
    # 3 windows, one skipped: 2 optimizer steps, each stepping the scheduler once per process
    assert run_on_ranks(_nonfinite_run, 2) == [(2, 1, 4, True)] * 2


# ------------------------------------------------- the LR schedule over a sharded loader (issue 46, item 4)

LR, SCHEDULE_EPOCHS = 3e-3, 3


def _cosine_runs(rank, world_size, cases):
    """Per case (samples, accum, how T_max was counted, scheduler_steps): a single-process script's cosine, T_max
    built before prepare(): (lr after each epoch, warnings, lr after each epoch resumed from the first's end)."""
    return [_cosine_run(*case) for case in cases]


def _cosine_run(samples, accum, t_max_from, scheduler_steps):
    import warnings

    from dptrain import scheduler_steps_per_epoch

    def build():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        loader = DataLoader(TensorDataset(torch.randn(samples, 5), torch.randint(0, 3, (samples,))), batch_size=4,
                            shuffle=True)
        per_epoch = {"one process": -(-len(loader) // accum),  # what a single-process script writes
                     "helper": scheduler_steps_per_epoch(loader, grad_accum_steps=accum,
                                                         scheduler_steps=scheduler_steps)}[t_max_from]
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=SCHEDULE_EPOCHS * per_epoch)
        return prepare(model, optimizer, loader, scheduler, grad_accum_steps=accum, scheduler_steps=scheduler_steps)

    def train(model, optimizer, loader, scheduler, epochs):
        lrs = []
        for _ in range(epochs):
            for x, y in loader:
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            lrs.append(scheduler.get_last_lr()[0])
        return lrs

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optimizer, loader, scheduler = build()
        lrs = train(model, optimizer, loader, scheduler, 1)
        saved = (model.unwrap().state_dict(), optimizer.state_dict(), scheduler.state_dict(), loader.epoch)
        lrs += train(model, optimizer, loader, scheduler, SCHEDULE_EPOCHS - 1)
        messages = [str(w.message) for w in caught]
        model, optimizer, loader, scheduler = build()  # resumed from the checkpoint after the first epoch
        model.unwrap().load_state_dict(saved[0])
        optimizer.load_state_dict(saved[1])  # the cosine's closed form is chained on the optimizer's lr
        scheduler.load_state_dict(saved[2])
        loader.set_epoch(saved[3])
        resumed = train(model, optimizer, loader, scheduler, SCHEDULE_EPOCHS - 1)
    return lrs, messages, resumed


@pytest.mark.timeout(60)
def test_a_schedule_built_for_one_process_before_prepare_ends_where_it_meant_to():
    # CosineAnnealingLR(T_max=epochs * len(loader) / accum) over the unsharded loader: stepped once per optimizer
    # step over the shards it ended half-way (lr 1.5e-3 of 3e-3 at world 2); once per process it ends at 0, with
    # and without accumulation, and resumed from a checkpoint after the first epoch
    cases = [(64, 1, "one process", "per_process"), (64, 2, "one process", "per_process")]
    for per_rank in run_on_ranks(_cosine_runs, 2, cases):
        for case, (lrs, caught, resumed) in zip(cases, per_rank, strict=True):
            assert lrs[-1] == pytest.approx(0.0, abs=1e-12) and lrs[0] == pytest.approx(LR * 0.75), (case, lrs)
            assert resumed == pytest.approx(lrs[1:], abs=1e-12) and caught == [], case


@pytest.mark.timeout(60)
def test_shards_padded_to_equal_length_take_more_steps_the_helper_counts_them_and_a_late_end_warns():
    # 26 samples, batch 4: one process takes 7 batches an epoch; 2 ranks take 13 samples each, 4 batches
    # (8 scheduler steps), so T_max = 3 x 7 is passed before the end, and says so
    cases = [(26, 1, "one process", "per_process"), (26, 1, "helper", "per_process"), (26, 1, "helper", "per_step")]
    [naive, *helped], _ = run_on_ranks(_cosine_runs, 2, cases)
    lrs, caught, _ = naive
    assert lrs[-1] > 0 and len(caught) == 1
    assert "CosineAnnealingLR was stepped past the end of its schedule (T_max=21; stepped 22 times)" in caught[0]
    assert "scheduler_steps_per_epoch" in caught[0] and "scheduler_steps='per_step'" in caught[0]
    for case, (lrs, caught, resumed) in zip(cases[1:], helped, strict=True):
        assert lrs[-1] == pytest.approx(0.0, abs=1e-12) and caught == [], (case, lrs, caught)
        assert resumed == pytest.approx(lrs[1:], abs=1e-12)


def test_the_steps_per_epoch_before_prepare_count_the_padded_shard_in_windows():
    from dptrain import scheduler_steps_per_epoch

    loader = DataLoader(TensorDataset(torch.arange(26)), batch_size=4, shuffle=True)
    count = {(world, accum, rule): scheduler_steps_per_epoch(loader, grad_accum_steps=accum, world_size=world,
                                                             scheduler_steps=rule)
             for world in (1, 2, 3) for accum in (1, 3) for rule in ("per_process", "per_step")}
    # shards of 26, 13 and 9 samples: 7, 4 and 3 batches of 4; windows of 3: 3, 2 and 1
    assert count == {(1, 1, "per_process"): 7, (1, 1, "per_step"): 7, (1, 3, "per_process"): 3,
                     (1, 3, "per_step"): 3, (2, 1, "per_process"): 8, (2, 1, "per_step"): 4,
                     (2, 3, "per_process"): 4, (2, 3, "per_step"): 2, (3, 1, "per_process"): 9,
                     (3, 1, "per_step"): 3, (3, 3, "per_process"): 3, (3, 3, "per_step"): 1}
    dropping = DataLoader(TensorDataset(torch.arange(26)), batch_size=4, drop_last=True)
    assert scheduler_steps_per_epoch(dropping, world_size=2) == 2 * 3  # 13 samples: 3 whole batches
    with pytest.raises(ValueError, match="scheduler_steps must be 'per_process'.*got 'per_rank'"):
        scheduler_steps_per_epoch(loader, world_size=2, scheduler_steps="per_rank")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_distributed.*or pass world_size="):
            scheduler_steps_per_epoch(loader)


def test_one_cycle_stops_at_its_last_step_and_a_plateau_scheduler_steps_once_per_call():
    import warnings

    from dptrain.api.scheduler import PreparedScheduler

    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    cycle = PreparedScheduler(torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=5), None,
                              AccumulationState(1), per_step=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):  # 8 steps asked for: OneCycleLR raises past total_steps
            cycle.step()
    ends = [str(w.message) for w in caught if "end of its schedule" in str(w.message)]
    assert cycle.last_epoch == 5 and len(ends) == 1 and "stays there (one more step would raise)" in ends[0]
    plateau = PreparedScheduler(torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=1), None,
                                AccumulationState(1), per_step=2)
    for _ in range(2):
        plateau.step(1.0)  # no improvement after the first: patience 1 is used up by the second, not the first
    assert plateau.num_bad_epochs == 1


class ReturnsItsLoss(nn.Module):
    """A model that returns its loss, as nanoGPT's GPT ``(logits, loss)`` and Hugging Face's ``outputs.loss`` do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x, y):
        logits = self.fc(x)
        return logits, F.cross_entropy(logits, y)

    def estimate_mfu(self) -> float:  # nanoGPT's loop calls model.module.estimate_mfu(...)
        return 0.25


def _module_and_divided_loss(rank, world_size):
    torch.manual_seed(0)
    mine = ReturnsItsLoss()
    theirs = nn.parallel.DistributedDataParallel(ReturnsItsLoss())
    model, optimizer = prepare(mine, torch.optim.SGD(mine.parameters(), lr=0.1), grad_accum_steps=ACCUM)
    hf = pytest.importorskip("transformers.modeling_utils")
    out = {"torch's .module": isinstance(theirs.module, ReturnsItsLoss), ".module": model.module is mine,
           "unwrap()": model.unwrap() is mine, "hf unwrap_model": hf.unwrap_model(model) is mine,
           "estimate_mfu": model.module.estimate_mfu(),
           ".wrapper": isinstance(model.wrapper, nn.parallel.DistributedDataParallel) and model.wrapper.module is mine}
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    for divide in (False, True):  # nanoGPT's loop divides; each prepare() checks its first window
        if divide:
            torch.manual_seed(0)
            mine = ReturnsItsLoss()
            model, optimizer = prepare(mine, torch.optim.SGD(mine.parameters(), lr=0.1), grad_accum_steps=ACCUM)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2 * ACCUM):
                _, loss = model(x, y)
                (loss / ACCUM if divide else loss).backward()
                optimizer.step()
                optimizer.zero_grad()
        out[f"warnings, divided {divide}"] = [str(w.message) for w in caught if "grad_accum_steps" in str(w.message)]
    return out


@pytest.mark.timeout(60)
def test_module_is_the_users_model_and_a_loss_divided_by_the_accumulation_steps_is_named():
    for out in run_on_ranks(_module_and_divided_loss, 2):
        assert out["torch's .module"] and out[".module"] and out["unwrap()"] and out["hf unwrap_model"]
        assert out["estimate_mfu"] == 0.25 and out[".wrapper"]
        assert out["warnings, divided False"] == []
        [message] = out["warnings, divided True"]  # once, on the first window
        assert f"is 0.333333 = 1/{ACCUM}" in message and f"gradients {ACCUM} times too small" in message


# ------------------------------------------------------------------------ no process group


def test_a_window_closes_after_grad_accum_steps_or_at_the_end_of_data():
    state = AccumulationState(grad_accum_steps=3)
    closes = []
    for end in [False] * 4 + [True] + [False] * 3:  # a pass of 5 micro-batches, then the next pass begins
        state.end_of_data = end
        closes.append(state.begin_micro_step())
    assert closes == [False, False, True, False, True, False, False, True]
    assert state.window == 3 and state.micro_step == 3


def test_the_loader_shards_disjointly_keeps_its_settings_and_reshuffles_each_pass():
    def collate(samples):
        return torch.stack([s[0] for s in samples])

    dataset = TensorDataset(torch.arange(20))
    loader = DataLoader(dataset, batch_size=3, shuffle=True, drop_last=True, collate_fn=collate)
    shards = [shard_loader(loader, 2, rank, seed=5) for rank in range(2)]
    assert [(s.batch_size, s.drop_last, s.collate_fn) for s in shards] == [(3, True, collate)] * 2
    prepared = [PreparedLoader(s, AccumulationState(1), torch.device("cpu")) for s in shards]
    assert [len(p) for p in prepared] == [3, 3]  # 10 samples a rank, whole batches of 3
    passes = [[torch.cat(list(p)).tolist() for p in prepared] for _ in range(3)]
    for first, second in passes:
        assert not set(first) & set(second) and len(first) == len(second) == 9
    assert passes[0] != passes[1] != passes[2]
    assert [p.epoch for p in prepared] == [3, 3]  # the next pass's
    prepared[0].set_epoch(1)  # resuming at epoch 1
    assert torch.cat(list(prepared[0])).tolist() == passes[1][0]


def test_the_loader_marks_its_last_batch_as_the_end_of_data():
    state = AccumulationState(4)
    loader = PreparedLoader(shard_loader(DataLoader(TensorDataset(torch.arange(7)), batch_size=2), 1, 0), state,
                            torch.device("cpu"))
    assert [state.end_of_data for _ in loader] == [False, False, False, True]
    assert not state.end_of_data  # cleared when the pass ends


def test_settings_are_checked_before_anything_else():
    with pytest.raises(ValueError, match=r"unknown strategy 'zero-2' \(did you mean 'zero2'\?\)"):
        prepare(strategy="zero-2")
    with pytest.raises(ValueError, match="fp16 needs a loss scaler.*use bf16"):
        prepare(precision="fp16")
    with pytest.raises(ValueError, match="grad_accum_steps must be an integer >= 1, got 0"):
        prepare(grad_accum_steps=0)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="dptrain.init_distributed"):
            prepare(nn.Linear(2, 2))


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


def _errors(rank, world_size):
    data = TensorDataset(torch.arange(8.0))
    attempts = {
        "unknown": lambda: prepare(nn.Linear(2, 2), "model.pt"),
        "dataset": lambda: prepare(data),
        "two models": lambda: prepare(nn.Linear(2, 2), nn.Linear(2, 2)),
        "iterable": lambda: prepare(DataLoader(_Stream(), batch_size=2)),
        "batch sampler": lambda: prepare(DataLoader(data, batch_sampler=[[0, 1], [2, 3]])),
        "replacement": lambda: prepare(DataLoader(data, batch_size=2, sampler=RandomSampler(data, True, 4))),
        "custom sampler": lambda: prepare(DataLoader(data, batch_size=2, sampler=[3, 1, 2])),
        "wrapped": lambda: prepare(prepare(nn.Linear(2, 2))),
    }
    model = nn.Linear(2, 2)
    stepped = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    stepped.step()
    attempts["stepped"] = lambda: prepare(model, stepped, strategy="zero2")
    attempts["two optimizers"] = lambda: prepare(model, torch.optim.SGD(model.parameters(), lr=1),
                                                 torch.optim.SGD(model.parameters(), lr=1), strategy="zero1")
    attempts["split_by"] = lambda: prepare(nn.Linear(2, 2), strategy="zero3", zero_kwargs={"split_by": len})
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
        except (TypeError, ValueError) as e:
            messages[name] = f"{type(e).__name__}: {e}"
    return messages


@pytest.mark.timeout(60)
def test_what_prepare_cannot_do_faithfully_is_an_error_naming_the_fix():
    [messages] = run_on_ranks(_errors, 1)
    expected = {
        "unknown": re.escape("TypeError: prepare() does not know what to do with a str; it takes an nn.Module"),
        "dataset": "TypeError: .*TensorDataset \\(a Dataset: wrap it in a DataLoader first\\)",
        "two models": "ValueError: prepare\\(\\) got 2 models.*separate prepare\\(\\) calls",
        "iterable": "TypeError: _Stream is an IterableDataset.*without prepare\\(\\)",
        "batch sampler": "TypeError: the DataLoader's batch_sampler is a list.*batch_size= and shuffle=",
        "replacement": "TypeError: the DataLoader's RandomSampler draws 4 samples \\(replacement=True\\)",
        "custom sampler": "TypeError: the DataLoader's list is not one prepare\\(\\) can shard.*dptrain.DistributedSampler",
        "wrapped": "TypeError: this PreparedModel was already prepared",
        "stepped": "ValueError: the Adam already has state for 2 parameters.*load_sharded",
        "two optimizers": "ValueError: strategy zero1 with 2 optimizers.*strategy='ddp'",
        "split_by": "ValueError: zero_kwargs may not set split_by",
    }
    assert messages.keys() == expected.keys()
    for name, pattern in expected.items():
        assert re.match(pattern, messages[name]), (name, messages[name])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_prepare_example_trains():
    example = Path(__file__).parent.parent / "examples" / "prepare_loop.py"
    proc = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) >= 3 and losses[-1] < 0.5 * losses[0], proc.stdout

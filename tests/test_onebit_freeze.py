"""1-bit Adam's freeze rule (issue 46): on recorded variances, inside the optimizer, across a resume, and its warnings."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from dptrain import DistributedDataParallel
from dptrain.checkpoint.replicated import replicated_state, set_replicated_state
from dptrain.config.loader import load_config
from dptrain.optim.onebit_adam import OneBitAdam
from dptrain.optim.onebit_freeze import FreezeRule, onebit_notes
from dptrain.testing import run_on_ranks

# Recorded: AdamW (betas 0.9, 0.99; grad_clip 1; 30-step LR warm-up) on the 2-layer, width-80 GPT of issue 46, global
# batch 32. Per parameter tensor, in the optimizer's order, its numel and its second moment's bias-corrected mass
# sum(v) / (1 - 0.99^t) every 10 steps (3 significant digits). Frozen at the warm-up's 30 steps this model ended
# 1.51x AdamW's validation loss after 1,000 steps, and 1.00x frozen at 60 (docs/compression.md).
NUMELS = [20480, 5120, 19200, 6400, 25600, 25600, 19200, 6400, 25600, 25600,  # embeddings, then each block's matrices
          80, 80, 240, 80, 80, 80, 320, 80, 80, 80, 240, 80, 80, 80, 320, 80, 80, 80]  # biases and norms
RECORDED = """
10 .657 .00415 .00422 .0166 .00544 .0209 .00348 .0165 .00598 .0268 1.47e-6 2.27e-5 .000758 .094 2.09e-6 1.78e-5 .000484
   .0569 1.72e-6 1.19e-5 .000348 .0441 3.57e-6 1.03e-5 .000305 .0404 .00065 .000462
20 .831 .00203 .00214 .00822 .0027 .0104 .00173 .00863 .00294 .0134 8.5e-7 1.13e-5 .000367 .0449 1.34e-6 8.64e-6 .000231
   .0271 8.92e-7 5.73e-6 .000166 .0211 1.82e-6 5e-6 .000146 .0193 .00185 .00136
30 .827 .00293 .0173 .0333 .00349 .00822 .0017 .00715 .00224 .00938 1.33e-5 4.72e-5 .00081 .039 1.13e-5 2.42e-5 .000183
   .0175 1.59e-6 6.23e-6 .000121 .0135 2.4e-6 4.91e-6 9.79e-5 .0123 .00242 .00187
40 .71 .00695 .033 .079 .0092 .0109 .00267 .00876 .00325 .00888 3.13e-5 .000102 .0014 .0646 7e-5 .000116 .00024 .013
   4.02e-6 9.44e-6 .000121 .01 8.13e-6 1.05e-5 9.3e-5 .00895 .00216 .00163
50 .597 .0113 .0586 .0914 .0125 .0147 .00423 .00943 .00438 .00888 5.44e-5 .000171 .00228 .0931 .000115 .000176 .000285
   .0104 8.47e-6 1.48e-5 .000145 .00802 1.17e-5 1.26e-5 9.75e-5 .00714 .00181 .00137
60 .512 .0144 .0704 .0932 .0136 .0161 .00396 .00874 .00419 .00794 7.02e-5 .00021 .00268 .111 .000136 .000226 .000298
   .00845 8.26e-6 1.48e-5 .000132 .00656 1.16e-5 1.28e-5 8.82e-5 .00584 .00153 .00118
70 .454 .0164 .0773 .0918 .0152 .0182 .00403 .00822 .00416 .00731 9.93e-5 .000259 .00294 .114 .000155 .000257 .000313
   .00714 8.57e-6 1.59e-5 .00013 .00556 1.21e-5 1.35e-5 8.3e-5 .00496 .00134 .00105
80 .406 .0181 .0855 .0917 .0161 .0195 .00399 .008 .00389 .00685 .000131 .000296 .00323 .118 .00016 .000291 .000332
   .00618 8.48e-6 1.7e-5 .000128 .00488 1.18e-5 1.34e-5 7.67e-5 .00436 .0012 .000973
"""


def _recorded() -> dict[int, torch.Tensor]:
    rows, step = {}, None
    for token in RECORDED.split():
        if "." not in token and "e" not in token:
            step = int(token)
            rows[step] = []
        else:
            rows[step].append(float(token))
    return {t: torch.tensor(masses, dtype=torch.float64) for t, masses in rows.items()}


def _freeze_step(rule: FreezeRule, masses: dict[int, torch.Tensor], numels: list[int]) -> tuple[int | None, dict]:
    """Feed the rule the masses as the optimizer does: the first decision step that finds v settled, and the drifts."""
    drifts = {}
    for t in sorted(masses):
        if rule.checks_at(t):
            drifts[t] = rule.drift(masses[t], masses[t - rule.window], torch.tensor(numels))
            if rule.settled(drifts[t]):
                return t, drifts
    return None, drifts


def test_on_the_recorded_2x80_gpt_the_rule_waits_past_the_warmup_until_v_settles() -> None:
    masses = _recorded()
    assert all(len(m) == len(NUMELS) for m in masses.values())
    step, drifts = _freeze_step(FreezeRule(earliest=30), masses, NUMELS)
    assert step == 70  # not at 30, the warm-up's end, where v still moved by ~46% per 10 steps
    assert drifts[30] > 0.4 and drifts[60] > 0.1 >= drifts[70]
    assert _freeze_step(FreezeRule(earliest=30, tolerance=0.3), masses, NUMELS)[0] == 50  # looser: earlier
    assert _freeze_step(FreezeRule(earliest=80), masses, NUMELS)[0] == 80  # never before the warm-up


def test_the_rule_decides_every_window_from_the_warmup_on_and_names_bad_settings() -> None:
    assert [FreezeRule(earliest=e).first_check for e in (0, 20, 30, 35)] == [20, 20, 30, 40]
    rule = FreezeRule(earliest=30)
    assert [t for t in range(1, 61) if rule.records_at(t)] == [10, 20, 30, 40, 50, 60]
    assert [t for t in range(1, 61) if rule.checks_at(t)] == [30, 40, 50, 60]
    ones = torch.ones(3, dtype=torch.float64)
    assert rule.drift(torch.tensor([2.0, 0.0, 1.0], dtype=torch.float64), torch.tensor([1.0, 5.0, 0.0],
                      dtype=torch.float64), ones) == pytest.approx(math.log(2))  # only tensors with mass at both
    assert rule.drift(ones * 0, ones, ones) == math.inf
    with pytest.raises(ValueError, match="window 1"):
        FreezeRule(window=1)


# ---------------------------------------------------------------- inside the optimizer (world size 1)


def _scale(t: int) -> float:
    """The gradient's size at step t: three times its final size at first, settling (v follows, slower)."""
    return 1.0 + 2.0 * math.exp(-t / 15)


def _expected_freeze(rule: FreezeRule, beta2: float, steps: int) -> int:
    """The rule applied to v written out: one tensor of ones times _scale(t), so mass = numel * vhat (numel 1)."""
    v, masses = 0.0, {}
    for t in range(1, steps + 1):
        v = beta2 * v + (1 - beta2) * _scale(t) ** 2
        masses[t] = torch.tensor([v / (1 - beta2 ** t)], dtype=torch.float64)
    return _freeze_step(rule, {t: m for t, m in masses.items() if rule.records_at(t)}, [1])[0]


def _drive(opt: OneBitAdam, params: list[torch.Tensor], steps: range) -> None:
    for t in steps:
        for p in params:
            p.grad = torch.full_like(p, _scale(t + 1))
        opt.step()


def _onebit(freeze_step: int | None = None) -> tuple[DistributedDataParallel, OneBitAdam]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 3))
    return model, OneBitAdam(model.module.parameters(), model, lr=0.01, betas=(0.9, 0.99), freeze_step=freeze_step,
                             freeze_rule=FreezeRule(earliest=30))


def _inside(rank: int, world_size: int) -> dict:
    model, opt = _onebit()
    _drive(opt, list(model.module.parameters()), range(25))
    saved = {"flat": copy.deepcopy(replicated_state(model.module, opt)),
             "plain": copy.deepcopy((model.module.state_dict(), opt.state_dict()))}
    _drive(opt, list(model.module.parameters()), range(25, 120))
    out = {"frozen_at": opt.frozen_at, "expected": _expected_freeze(FreezeRule(earliest=30), 0.99, 120)}
    for name, (model_state, optim_state) in saved.items():  # resumed at step 25, between two of the rule's records
        again, opt2 = _onebit()
        if name == "flat":  # as dptrain's checkpoints hold it (torch.distributed.checkpoint's flat names)
            set_replicated_state(again.module, opt2, model_state, optim_state)
        else:
            again.module.load_state_dict(model_state)
            opt2.load_state_dict(optim_state)
        _drive(opt2, list(again.module.parameters()), range(25, 120))
        same = all(torch.equal(a, b) for a, b in zip(model.module.parameters(), again.module.parameters(), strict=True))
        out[name] = (opt2.frozen_at, same)
    return out


def test_the_optimizer_freezes_where_the_rule_says_and_resumes_exactly_around_it() -> None:
    r = run_on_ranks(_inside, 1)[0]
    assert r["frozen_at"] == r["expected"] == 80
    assert r["flat"] == (r["expected"], True) and r["plain"] == (r["expected"], True)


def _explicit(rank: int, world_size: int) -> dict:
    model, opt = _onebit(freeze_step=35)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _drive(opt, list(model.module.parameters()), range(40))
    legacy = copy.deepcopy(opt.state_dict())
    for state in legacy["state"].values():  # as saved before the rule existed
        del state["v_mass"], state["freeze"]
    _, old = _onebit()
    old.load_state_dict(legacy)
    return {"frozen_at": opt.frozen_at, "warnings": [str(w.message) for w in caught],
            "legacy": (old.frozen_at, old.freeze_step, old.compressing)}


def test_an_explicit_freeze_wins_warns_when_v_had_not_settled_and_old_states_keep_their_freeze() -> None:
    r = run_on_ranks(_explicit, 1)[0]
    assert r["frozen_at"] == 35
    assert len(r["warnings"]) == 1 and "at step 35" in r["warnings"][0] and "train.onebit_freeze_step = 0" in \
        r["warnings"][0]
    assert r["legacy"] == (30, 30, True)  # a state saved before the rule froze at the LR warm-up, the default then


def test_the_validator_warns_of_a_freeze_before_the_rule_can_and_of_a_run_too_short_to_freeze() -> None:
    early = onebit_notes(load_config(None, ["train.optimizer=onebit_adam", "train.onebit_freeze_step=10"]))
    assert len(early) == 1 and early[0].startswith("warning: train.onebit_freeze_step 10") and "step 30" in early[0]
    short = onebit_notes(load_config(None, ["train.optimizer=onebit_adam", "train.steps=30"]))
    assert len(short) == 1 and "uncompressed AdamW throughout" in short[0]
    assert onebit_notes(load_config(None, ["train.optimizer=onebit_adam"])) == []
    assert onebit_notes(load_config(None, ["train.optimizer=onebit_adam", "train.onebit_freeze_step=60"])) == []

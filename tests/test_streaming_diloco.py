"""Streaming DiLoCo (DiLoCo's fragments, overlap and mixing) and its 4-bit codecs: the schedule against a written-out
reference on 2 ranks, the fragments a model splits into, an exact resume with a reduction in flight, the close at the
end of training, and the codecs' rounding, bytes and error feedback."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dptrain.comm.topology import shard_bounds
from dptrain.compress.feedback import ErrorFeedback
from dptrain.compress.fourbit import E3M0, Int4
from dptrain.diloco import DiLoCo, DiLoCoOptions
from dptrain.diloco.fragments import split_fragments
from dptrain.diloco.options import outer_lr_for
from dptrain.diloco.outer import outer_optimizer
from dptrain.models.gpt import GPT
from dptrain.testing import run_on_ranks
from test_localsgd_diloco import _batch, _steps

pytestmark = pytest.mark.timeout(120)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3))


# ----------------------------------------------------------------------------- the schedule, written out

H, P, TAU, ALPHA = 4, 2, 1, 0.5
STEPS = 11  # ends with fragment 1's reduction in flight (taken after step 11, landing after 12)


def _reference(rank: int, world_size: int) -> tuple[list, list, list]:
    """The Linear layers strided over 2 fragments (0 and 2; 1 and 3); a slot of H / P = 2 steps; after inner step t
    with (t + tau) % 2 == 0, fragment ((t + tau) / 2 - 1) % 2 takes its mean pseudo-gradient (the ranks' weights
    gathered); after step t % 2 == 0 its outer step lands and the fragment becomes alpha x + (1 - alpha) g."""
    options = DiLoCoOptions(period=H, fragments=P, overlap_steps=TAU, mixing=ALPHA, outer_lr=0.7, outer_momentum=0.9)
    wrapper = DiLoCo(_model(), options)
    opt = torch.optim.AdamW(wrapper.module.parameters(), lr=1e-2)
    got = _steps(wrapper, opt, rank, range(STEPS))

    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    layers = [m for m in model if isinstance(m, nn.Linear)]
    fragments = [[*layers[0].parameters(), *layers[2].parameters()], [*layers[1].parameters(), *layers[3].parameters()]]
    global_ = [[p.detach().clone() for p in f] for f in fragments]
    outers = [outer_optimizer(g, 0.7, 0.9, True) for g in global_]
    pending, want = None, []
    for t in range(1, STEPS + 1):
        x, y = _batch(rank, t - 1)
        nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        if (t + TAU) % (H // P) == 0:
            f = ((t + TAU) // (H // P) - 1) % P
            means = []
            for g, x_i in zip(global_[f], fragments[f], strict=True):
                everyone = [torch.empty_like(x_i) for _ in range(world_size)]
                dist.all_gather(everyone, x_i.detach().contiguous())
                means.append(sum(g - x_j for x_j in everyone) / world_size)
            pending = (f, means)
        if t % (H // P) == 0:
            f, means = pending
            for g, d in zip(global_[f], means, strict=True):
                g.grad = d
            outers[f].step()
            with torch.no_grad():
                for g, x_i in zip(global_[f], fragments[f], strict=True):
                    g.grad = None
                    x_i.mul_(ALPHA).add_(g, alpha=1 - ALPHA)
        want.append([p.detach().clone() for p in model.parameters()])

    full = wrapper.full_state_dict()  # each fragment's global weights, as of its last landing
    with wrapper.evaluating() as module:
        evaluated = all(torch.equal(module.state_dict()[k], v) for k, v in full.items())
    wrapper.finish()  # the flight lands, every fragment with steps since its last outer step meets: all hold it
    closed = torch.cat([p.detach().reshape(-1) for p in wrapper.module.parameters()])
    everyone = [torch.empty_like(closed) for _ in range(world_size)]
    dist.all_gather(everyone, closed)
    kept = wrapper.full_state_dict()
    same = [evaluated, all(torch.equal(e, closed) for e in everyone),
            all(torch.equal(kept[k], v) for k, v in wrapper.module.state_dict().items())]
    return got, want, same


def test_streaming_steps_as_written_out_and_closes_on_the_global_weights():
    for got, want, same in run_on_ranks(_reference, 2):
        for g, w in zip(got, want, strict=True):
            for a, b in zip(g, w, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert all(same)


def _resume(rank: int, world_size: int) -> bool:
    """A checkpoint taken with fragment 0's int4 reduction in flight (after step 5) resumes bit for bit."""
    def build():
        return DiLoCo(_model(), period=H, fragments=P, overlap_steps=TAU, mixing=ALPHA, compression="int4")

    straight = build()
    opt = torch.optim.AdamW(straight.module.parameters(), lr=1e-2)
    expected = _steps(straight, opt, rank, range(10))[-1]

    first = build()
    opt = torch.optim.AdamW(first.module.parameters(), lr=1e-2)
    _steps(first, opt, rank, range(5))
    assert first.schedule.flight is not None
    saved = copy.deepcopy(first.checkpoint_state(opt))
    model_state = copy.deepcopy(first.module.state_dict())
    second = build()
    second.module.load_state_dict(model_state)
    opt2 = torch.optim.AdamW(second.module.parameters(), lr=1e-2)
    assert second.load_checkpoint_state(saved, opt2) is None
    resumed = _steps(second, opt2, rank, range(5, 10))[-1]
    return all(torch.equal(a, b) for a, b in zip(expected, resumed, strict=True))


def test_a_checkpoint_with_a_reduction_in_flight_resumes_bit_for_bit():
    assert all(run_on_ranks(_resume, 2))


def _bytes(rank: int, world_size: int) -> dict:
    wrapper = DiLoCo(_model(), period=H, fragments=P, compression="e3m0")
    _steps(wrapper, torch.optim.SGD(wrapper.module.parameters(), lr=0.05), rank, range(8))
    return {**wrapper.step_metrics(), "lrs": [o.optimizer.param_groups[0]["lr"] for o in wrapper.schedule.outers]}


def test_a_sync_point_sends_one_fragment_in_four_bits():
    m = run_on_ranks(_bytes, 2)[0]
    assert m["lrs"] == [0.6, 0.6]  # outer_lr unset: the scaling-law paper's best for 2 replicas
    whole = sum(p.numel() for p in _model().parameters())
    assert m["syncs"] == 4 and m["sync_period"] == H // P and m["sync_name"] == "fragment outer step"
    # each sync point: about half the model, 4.25 bits a value (a chunk's scale), against fp32's 32
    assert 0 < m["sync_peak_sent_bytes"] < whole * 4 / P / 6
    assert m["comm_sent_bytes_per_step"] * 8 == pytest.approx(4 * m["sync_peak_sent_bytes"], rel=0.5)


# ----------------------------------------------------------------------------- the fragments


def test_gpt_blocks_split_strided_or_sequential_and_the_rest_balances():
    model = GPT(n_layer=4, n_embd=32, n_head=2)
    params = [p for p in model.parameters() if p.requires_grad]
    name = {id(p): n for n, p in model.named_parameters()}

    def blocks(fragment):
        return sorted({name[id(params[i])].split(".")[1] for i in fragment if name[id(params[i])].startswith("blocks.")})

    strided = split_fragments(model, params, 2, "strided")
    assert [blocks(f) for f in strided] == [["0", "2"], ["1", "3"]]
    assert [blocks(f) for f in split_fragments(model, params, 2, "sequential")] == [["0", "1"], ["2", "3"]]
    assert sorted(i for f in strided for i in f) == list(range(len(params)))
    sizes = [sum(params[i].numel() for i in f) for f in strided]
    assert max(sizes) - min(sizes) <= model.wte.weight.numel()  # the rest, largest first, where there is room


def test_a_model_without_blocks_splits_by_parameter_and_a_function_overrides():
    model = nn.Linear(4, 3)
    params = list(model.parameters())
    assert split_fragments(model, params, 2) == [[0], [1]]
    assert split_fragments(model, params, 2, fragment_of=lambda name: 0 if name == "bias" else 1) == [[1], [0]]
    with pytest.raises(ValueError, match="fragment"):
        split_fragments(model, params, 3)
    with pytest.raises(ValueError, match=r"fragment_of\('weight'\) gave 5"):
        split_fragments(model, params, 2, fragment_of=lambda name: 5)


@pytest.mark.parametrize("keywords, message", [
    ({"period": 30, "fragments": 4}, "dividing period = 30"),
    ({"period": 30, "fragments": 3, "overlap_steps": 10}, r"\[0, period / fragments = 10\)"),
    ({"mixing": 1.0}, "mixing must be in"),
    ({"fragment_pattern": "random"}, "fragment_pattern must be one of"),
])
def test_streaming_options_refuse_what_no_schedule_can_run(keywords, message):
    with pytest.raises(ValueError, match=message):
        DiLoCoOptions(**keywords)


# ----------------------------------------------------------------------------- the 4-bit codecs


def test_int4_rounds_to_its_nearest_level_and_e3m0_to_its_nearest_power_of_two():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for codec in (Int4(), E3M0()):
        payload = codec.encode(x)
        assert payload.nbytes == codec.wire_bytes(x.numel()) == 512 + 4 * 8  # 8 chunks of 128, the last padded
    blocks = x[:896].view(-1, 128)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    int4 = Int4().roundtrip(x)[:896].view(-1, 128)
    assert ((int4 - blocks).abs() <= absmax / 14 + 1e-6).all()
    e3m0 = E3M0().roundtrip(x)[:896].view(-1, 128)
    large = blocks.abs() >= absmax * 2.0 ** -6
    assert ((e3m0 - blocks).abs()[large] <= blocks.abs()[large] / 3 + 1e-6).all()
    powers = (e3m0.abs() / absmax)[e3m0 != 0].log2()
    assert torch.equal(powers, powers.round())
    bad = torch.tensor([1.0, float("nan")] + [0.5] * 126 + [0.25] * 128)
    for codec in (Int4(), E3M0()):
        out = codec.roundtrip(bad)
        assert out[:128].isnan().all() and out[128:].isfinite().all()


def test_error_feedback_sends_the_four_bit_sum_of_what_it_was_given():
    feedback, codec, total, sent = ErrorFeedback(), E3M0(), torch.zeros(300), torch.zeros(300)
    for step in range(20):
        x = torch.randn(300, generator=torch.Generator().manual_seed(step))
        total += x
        sent += codec.decode(feedback.encode(0, x, codec))
    torch.testing.assert_close(sent, total - feedback.residuals[0], rtol=0, atol=1e-4)


def test_the_outer_learning_rate_by_default_follows_the_number_of_replicas():
    assert [outer_lr_for(m) for m in (1, 2, 3, 4, 8, 64)] == [0.4, 0.6, 0.6, 0.6, 0.8, 0.8]
    assert 0.6 < outer_lr_for(6) < 0.8  # between two of the paper's points, linear in log2 M
    assert DiLoCoOptions(outer_lr=0.7).lr_for(8) == 0.7  # set: kept


# ----------------------------------------------------------------------------- the close, resumes and live recovery


def _closes(rank: int, world_size: int) -> list[bool]:
    """finish() twice changes nothing the second time; after a meeting live recovery held at the last step it
    takes no outer step (the landing was recorded); hold_meetings counts the job's workers for the outer lr."""
    out = []
    wrapper = DiLoCo(_model(), period=4)
    opt = torch.optim.SGD(wrapper.module.parameters(), lr=0.05)
    _steps(wrapper, opt, rank, range(6))
    first = wrapper.finish()
    after = [p.detach().clone() for p in wrapper.module.parameters()]
    out += [first is not None, wrapper.finish() is None,
            all(torch.equal(a, p) for a, p in zip(after, wrapper.module.parameters(), strict=True))]

    held = DiLoCo(_model(), period=4)
    held.hold_meetings(8)
    out.append(held.outer.optimizer.param_groups[0]["lr"] == 0.8)
    opt = torch.optim.SGD(held.module.parameters(), lr=0.05)
    _steps(held, opt, rank, range(6))  # counted only: the gate holds the meeting at the last step, 6
    held.apply_meeting(held.launch_meeting(None, 1, True, 6, True)())
    met = [p.detach().clone() for p in held.module.parameters()]
    out += [held.finish() is None, all(torch.equal(a, p) for a, p in zip(met, held.module.parameters(), strict=True))]
    return out


def test_the_close_takes_no_outer_step_twice_nor_after_a_meeting_live_recovery_held():
    assert all(run_on_ranks(_closes, 1)[0])


def _changed_overlap(rank: int, world_size: int) -> list[bool]:
    """A checkpoint saved with a reduction in flight (tau = 1) resumed with none overlapped (tau = 0), and one saved
    between a start and its landing point with tau = 0 resumed with tau = 1: each lands what it must, once."""
    out = []
    for saved_tau, resumed_tau, stop in ((1, 0, 5), (0, 1, 3)):
        first = DiLoCo(_model(), period=H, fragments=P, overlap_steps=saved_tau)
        opt = torch.optim.AdamW(first.module.parameters(), lr=1e-2)
        _steps(first, opt, rank, range(stop))
        saved = copy.deepcopy(first.checkpoint_state(opt))
        second = DiLoCo(_model(), period=H, fragments=P, overlap_steps=resumed_tau)
        second.module.load_state_dict(first.module.state_dict())
        opt2 = torch.optim.AdamW(second.module.parameters(), lr=1e-2)
        second.load_checkpoint_state(saved, opt2)
        _steps(second, opt2, rank, range(stop, 9))
        out += [second.syncs == 4, second.finish() is not None or not second.schedule.unmet(second.steps)]
    return out


def test_a_resume_with_another_overlap_lands_each_reduction_once():
    for result in run_on_ranks(_changed_overlap, 2):
        assert all(result)


def _disagree(rank: int, world_size: int) -> str:
    try:
        DiLoCo(_model(), period=H, fragments=P, fragment_of=lambda name: rank if name.startswith("0.") else 1 - rank)
    except ValueError as e:
        return str(e)
    return "no error"


def test_fragments_that_differ_between_ranks_are_refused_on_every_rank():
    for message in run_on_ranks(_disagree, 2):
        assert "fragments differ between ranks" in message


def test_the_blocks_are_the_list_of_one_class_inside_a_sequential_model():
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)) for _ in range(4)])
    model = nn.Sequential(nn.Embedding(50, 16), blocks, nn.LayerNorm(16), nn.Linear(16, 50))
    params = list(model.parameters())
    fragments = split_fragments(model, params, 2)
    inner = {id(p) for p in blocks[0].parameters()} | {id(p) for p in blocks[2].parameters()}
    assert inner <= {id(params[i]) for i in fragments[0]}  # blocks 0 and 2 together, not the outer list's members
    assert not inner & {id(params[i]) for i in fragments[1]}


def _four_bit_mean(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    from dptrain.diloco.quantised import QuantisedReduction

    x = torch.randn(1001, generator=torch.Generator().manual_seed(rank))
    everyone = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(everyone, x)
    reduction = QuantisedReduction(E3M0(), error_feedback=True)
    delta = x.clone()
    counted = reduction.launch(0, delta, None)()
    return delta, sum(everyone) / world_size, counted


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_four_bit_reduction_gives_every_rank_the_same_mean(world_size):
    """2 ranks: one all-gather of each rank's encoding; 3: an all-to-all of encoded shards, an fp32 sum at each
    shard's owner, re-encoded and all-gathered (2 (M - 1) / M payloads a rank)."""
    results = run_on_ranks(_four_bit_mean, world_size)
    first = results[0][0]
    for rank, (delta, mean, counted) in enumerate(results):
        assert torch.equal(delta, first)
        assert (delta - mean).norm() / mean.norm() < 0.3  # E3M0 loses about a fifth of a Gaussian's norm per encoding
        # the payload: one encoding of all 1,001 values, or one of each rank's shard (each padded to its last chunk)
        shards = [b - a for a, b in shard_bounds(1001, world_size)] if world_size > 2 else [1001]
        assert counted["payload"] == sum(E3M0().wire_bytes(n) for n in shards)
        sent = counted["payload"] if world_size == 2 else \
            counted["payload"] - E3M0().wire_bytes(shards[rank]) + (world_size - 1) * max(map(E3M0().wire_bytes, shards))
        assert counted["sent"] == sent  # M - 1 shards out, M - 1 summed shards gathered: 2 (M - 1) / M payloads


# ----------------------------------------------------------------------------- live recovery holds the meetings


def _held_by_live(rank: int, world_size: int, path: str) -> list[torch.Tensor]:
    """Streaming DiLoCo (2 fragments, mixing 0.5, int4) meeting itself over torch.distributed's world, and the same
    with live recovery's calls (a round group outside the world: reduce, then apply) after every ``meeting_due``
    step and the last: each step's weights, and the global weights at the end, of both."""
    from test_live_meetings import _round_group

    group = _round_group(rank, world_size, path)
    options = DiLoCoOptions(period=H, fragments=P, mixing=ALPHA, outer_lr=0.7, outer_momentum=0.9,
                            compression="int4")
    alone = DiLoCo(_model(), options)
    opt = torch.optim.AdamW(alone.module.parameters(), lr=1e-2)
    want = _steps(alone, opt, rank, range(STEPS))
    alone.finish()
    held = DiLoCo(_model(), options)
    held.hold_meetings(world_size)
    opt = torch.optim.AdamW(held.module.parameters(), lr=1e-2)
    got, met = [], []
    for step in range(STEPS):
        got += _steps(held, opt, rank, [step])
        last = step == STEPS - 1
        if held.meeting_due or last:
            reduced = held.launch_meeting(group, world_size, True, held.steps, last)()
            met.append([f for f, _ in reduced.reduced])
            held.apply_meeting(reduced)
            got[-1] = [p.detach().clone() for p in held.module.parameters()]
    assert held.finish() is None  # the last meeting closed every fragment
    return [*(torch.cat([p.reshape(-1) for p in w]) for w in (*want, *got)),
            torch.cat([p.reshape(-1) for p in alone.module.parameters()]),
            torch.cat([p.reshape(-1) for p in held.module.parameters()]), met]


def test_live_recovery_holds_streaming_dilocos_meetings_as_it_holds_them_itself(tmp_path):
    """Fragment by fragment, every S = H / P steps, mixing, 4-bit pseudo-gradients, and after the last step every
    fragment at once (what the close does): the weights live recovery's meetings give are the schedule's own."""
    for out in run_on_ranks(_held_by_live, 2, str(tmp_path / "store")):
        *weights, final_alone, final_held, met = out
        want, got = weights[:STEPS], weights[STEPS:]
        for w, g in zip(want[:-1], got[:-1], strict=True):  # the last step's: before the close, and after it
            assert torch.equal(g, w)
        assert torch.equal(final_held, final_alone)  # after the close
        assert met == [[0], [1], [0], [1], [0], [0, 1]]  # after steps 2, 4, 6, 8, 10; and after the last, 11, both
        assert not torch.equal(want[2], want[3])  # the weights move: the comparison is not of constants


class _BrokenGroup:
    """A round's group whose collectives are launched and then fail (a member gone mid-reduction)."""

    class _Work:
        def wait(self):
            raise RuntimeError("a member of the round is gone")

    def size(self):
        return 2

    def rank(self):
        return 0

    def allgather(self, outputs, inputs):
        return self._Work()

    def allreduce(self, tensors):
        return self._Work()


def _live_edges(rank: int, world_size: int) -> list[bool]:
    """A live round whose wait fails leaves every fragment's residual as before it; a checkpoint saved with a
    reduction in flight, loaded where live recovery holds the meetings, drops it (its meeting reduces it afresh)."""
    out = []
    wrapper = DiLoCo(_model(), period=H, fragments=P, compression="int8")
    opt = torch.optim.SGD(wrapper.module.parameters(), lr=0.1)
    _steps(wrapper, opt, rank, range(4))  # two syncs: a residual for each fragment
    before = wrapper.schedule.residual()["feedback"]["residuals"]
    _steps(wrapper, opt, rank, range(4, 5))
    wait = wrapper.launch_meeting(_BrokenGroup(), 2, True, wrapper.steps, True)  # every fragment, encoded
    changed = wrapper.schedule.residual()["feedback"]["residuals"]
    with pytest.raises(RuntimeError, match="gone"):
        wait()
    after = wrapper.schedule.residual()["feedback"]["residuals"]
    out.append(any(not torch.equal(changed[k], v) for k, v in before.items()))  # the launch encoded
    out.append(after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items()))

    flying = DiLoCo(_model(), period=H, fragments=P, overlap_steps=TAU)
    opt = torch.optim.SGD(flying.module.parameters(), lr=0.1)
    _steps(flying, opt, rank, range(3))  # fragment 1's reduction taken after step 3, landing after 4
    state = copy.deepcopy(flying.checkpoint_state(opt))
    out.append("flight" in state["shared"])
    for hold_first in (True, False):
        held = DiLoCo(_model(), period=H, fragments=P, overlap_steps=TAU)
        if hold_first:
            held.hold_meetings(world_size)
        held.load_checkpoint_state(copy.deepcopy(state), torch.optim.SGD(held.module.parameters(), lr=0.1))
        if not hold_first:
            held.hold_meetings(world_size)
        out.append(held.schedule.flight is None)
    return out


def test_a_failed_live_wait_restores_the_residuals_and_a_flight_is_dropped_where_live_recovery_meets():
    assert all(run_on_ranks(_live_edges, 1)[0])

"""dptrain on CUDA with NCCL against torch's own implementation, compared after every step (issue 39).

One GPU at world size 1 (tests/_gpu.py): NCCL refuses two ranks on one device, so the
all-reduce, reduce-scatter and all-gather here are local and what these tests check is
everything around them on CUDA: the bucket copies, hooks, streams, casts, the sharded
optimizer step, the codecs' kernels. Several ranks over NCCL (cross-device collectives,
their overlap with backward, uneven shards) need several devices and are not exercised;
the gloo tests cover those paths at world sizes 1-4 on the CPU.

Skipped without CUDA; ``DPTRAIN_GPU_CHECK_DRY=1`` runs them on the CPU with gloo.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from _gpu import needs_gpu, not_dry, on_one_rank, rank_device, relative_diff
from dptrain import DistributedDataParallel
from dptrain.models.gpt import GPT, Block

pytestmark = [pytest.mark.gpu, needs_gpu]

STEPS = 4
# Measured on an H100 by `dptrain bench gpu` (2026-11-22): dptrain's DDP and torch's are bitwise
# equal after 20 AdamW steps in fp32 and under bf16 autocast. The bound leaves room for a
# kernel that sums in another order; a missing or doubled reduction is off by far more.
TOLERANCE = 1e-5


def _gpt(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return GPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64).to(device)


def _tokens(step: int, device: torch.device, batch: int = 4, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 256, (batch, block + 1), generator=g).to(device)
    return x[:, :-1], x[:, 1:]


def _lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        logits = model(x)
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _worst(ours: dict[str, torch.Tensor], theirs: nn.Module) -> float:
    return max(relative_diff(ours[name], p) for name, p in theirs.named_parameters())


# ----------------------------------------------------------------------------- DDP

def _ddp_parity(rank: int, world_size: int, device_type: str, precision: str) -> list[float]:
    device = rank_device(device_type)
    base = _gpt(device)
    theirs, ours = TorchDDP(copy.deepcopy(base)), DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.5)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (theirs, ours)]
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    scalers = [torch.amp.GradScaler(device_type, init_scale=2.0**12, enabled=precision == "fp16") for _ in range(2)]
    worst = []
    for step in range(STEPS):
        x, y = _tokens(step, device)
        for model, opt, scaler in zip((theirs, ours), opts, scalers, strict=True):
            scaler.scale(_lm_loss(model, x, y, dtype)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        assert scalers[0].get_scale() == scalers[1].get_scale(), step  # the same overflow decisions
        worst.append(_worst(dict(ours.module.named_parameters()), theirs.module))
    return worst


@pytest.mark.parametrize("precision", ["fp32", "bf16", pytest.param("fp16", marks=not_dry)])
def test_ddp_matches_torch_ddp_after_every_step(precision: str) -> None:
    """A 2-block GPT, AdamW, 4 steps; fp16 with a GradScaler on each side (its overflow skips and scale too)."""
    worst = on_one_rank(_ddp_parity, precision)
    assert max(worst) <= TOLERANCE, worst


# ----------------------------------------------------------------------------- ZeRO

def _zero_parity(rank: int, world_size: int, device_type: str, stage: int) -> list[float]:
    from dptrain.zero import ZeRO

    device = rank_device(device_type)
    base = _gpt(device)
    theirs = TorchDDP(copy.deepcopy(base))
    kw = {"unit_classes": (Block,)} if stage == 3 else {"bucket_cap_mb": 0.5}
    ours = ZeRO(copy.deepcopy(base), stage=stage, **kw)
    # SGD with momentum, not Adam: the attention key bias's true gradient is 0, and Adam turns rounding
    # noise there into lr-sized steps of random sign (tests/test_zero_parity.py)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (theirs, ours)]
    worst = []
    for step in range(STEPS):
        x, y = _tokens(step, device)
        for model, opt in zip((theirs, ours), opts, strict=True):
            _lm_loss(model, x, y, None).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        worst.append(_worst(ours.gathered_state(), theirs.module))
    return worst


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_matches_torch_ddp_after_every_step(stage: int) -> None:
    """ZeRO-1/2/3 (stage 3 a unit per GPT block) against torch's DDP, fp32; one rank holds every shard."""
    worst = on_one_rank(_zero_parity, stage)
    assert max(worst) <= TOLERANCE, worst


def _zero3_bf16_reduce(rank: int, world_size: int, device_type: str) -> list[float]:
    from dptrain.zero import MixedPrecision, ZeRO

    device = rank_device(device_type)
    base = _gpt(device)
    # the oracle: torch's DDP over a bf16 copy (it reduces the bf16 gradients in bf16), an fp32 master
    # copy that takes the step, cast back to bf16 for the next forward: mixed precision by hand
    compute = TorchDDP(copy.deepcopy(base).bfloat16())
    master = [p.detach().clone().requires_grad_() for p in base.parameters()]
    names = [n for n, _ in base.named_parameters()]
    opt_ref = torch.optim.SGD(master, lr=0.1, momentum=0.9)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.float32)
    ours = ZeRO(copy.deepcopy(base), stage=3, mixed_precision=mp, unit_classes=(Block,))
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    worst = []
    for step in range(STEPS):
        x, y = _tokens(step, device)
        nn.functional.cross_entropy(compute(x).float().flatten(0, 1), y.flatten()).backward()
        for p, m in zip(compute.parameters(), master, strict=True):
            m.grad, p.grad = p.grad.float(), None
        opt_ref.step()
        with torch.no_grad():
            for p, m in zip(compute.parameters(), master, strict=True):
                p.copy_(m)
        _lm_loss(ours, x, y, None).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        got = ours.gathered_state()
        worst.append(max(relative_diff(got[n], m) for n, m in zip(names, master, strict=True)))
    return worst


def test_zero3_with_bf16_reduce_matches_torch_ddp_with_mixed_precision_by_hand() -> None:
    """bf16 compute and reduce, fp32 master shards: against torch's DDP on a bf16 copy plus an fp32 master step."""
    worst = on_one_rank(_zero3_bf16_reduce)
    assert max(worst) <= TOLERANCE, worst


# ----------------------------------------------------------------------------- compression

def _mlp(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).to(device)


def _compressed_grads(rank: int, world_size: int, device_type: str, codec_name: str) -> list[float]:
    """Each step: both wrappers at the same parameters, ours with the codec's hook; our gradients against the
    codec applied to torch's, then an SGD step from ours (torch's copy follows it)."""
    from dptrain.compress import make_codec
    from dptrain.compress.hook import CompressionHook

    device = rank_device(device_type)
    base = _mlp(device)
    theirs, ours = TorchDDP(copy.deepcopy(base)), DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=100)
    codec = make_codec(codec_name, int8_chunk=64, powersgd_rank=2)
    ours.register_comm_hook(None, CompressionHook(codec, error_feedback=False))
    opt = torch.optim.SGD(ours.parameters(), lr=0.05)
    names = [n for n, _ in base.named_parameters()]
    worst = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 40, generator=g).to(device), torch.randn(16, 8, generator=g).to(device)
        theirs.module.load_state_dict(ours.module.state_dict())
        for model in (theirs, ours):
            nn.functional.mse_loss(model(x), y).backward()
        exact = {n: p.grad for n, p in theirs.module.named_parameters()}
        got = {n: p.grad for n, p in ours.module.named_parameters()}
        want = _int8_oracle(codec, ours.bucket_assignment, exact) if codec_name == "int8" else \
            _powersgd_oracle(exact, got, rank=2)
        worst.append(max(relative_diff(got[n], want[n]) for n in names))
        opt.step()
        opt.zero_grad(set_to_none=True)
        theirs.zero_grad(set_to_none=True)
    return worst


def _int8_oracle(codec, buckets: list[list[str]], exact: dict) -> dict:
    """Each bucket's gradients flattened in the bucket's order, quantised and restored (world size 1: no sum)."""
    out = {}
    for names in buckets:
        flat = codec.roundtrip(torch.cat([exact[n].reshape(-1) for n in names]))
        for n, part in zip(names, flat.split([exact[n].numel() for n in names]), strict=True):
            out[n] = part.view_as(exact[n])
    return out


def _powersgd_oracle(exact: dict, got: dict, rank: int) -> dict:
    """One power iteration sends P P^T M for the orthonormal P it found: project torch's gradient on the span of
    ours (any warm-start Q gives such a P), and vectors go uncompressed, exact."""
    out = {}
    for n, m in exact.items():
        if m.dim() < 2:
            out[n] = m
            continue
        p = torch.linalg.svd(got[n].float(), full_matrices=False).U[:, :rank]  # (rows, rank)
        out[n] = p @ (p.t() @ m.float())
    return out


@pytest.mark.parametrize("codec", ["int8", "powersgd"])
def test_compression_hooks_reduce_torch_ddps_gradients_as_their_codec_says(codec: str) -> None:
    """int8 (chunks of 64) and PowerSGD (rank 2) through the DDP engine's hook on NCCL, error feedback off so
    that each step's oracle is the codec applied to that step's gradient under torch's DDP. At world size 1
    int8 quantises and restores (no all-to-all of shards: that needs 3 ranks) and PowerSGD's all-reduces of P
    and Q are local."""
    worst = on_one_rank(_compressed_grads, codec)
    assert max(worst) <= 1e-4, worst  # fp32 rounding of the codec's arithmetic (the SVD in the PowerSGD oracle)


# ----------------------------------------------------------------------------- prepare() and Hugging Face

def _prepare_bf16(rank: int, world_size: int, device_type: str) -> list[float]:
    from torch.utils.data import DataLoader, TensorDataset

    from dptrain import prepare

    device = rank_device(device_type)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(4 * STEPS, 40, generator=g), torch.randn(4 * STEPS, 8, generator=g))
    base = _mlp(device)
    theirs = TorchDDP(copy.deepcopy(base))
    opt_ref = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    mine = copy.deepcopy(base)
    model, opt, loader = prepare(mine, torch.optim.AdamW(mine.parameters(), lr=1e-3), DataLoader(data, batch_size=4),
                                 precision="bf16")
    worst = []
    for step, (x, y) in enumerate(loader):
        if step == 0:
            assert x.device.type == device.type, x.device  # the prepared loader moves batches to the device
        nn.functional.mse_loss(model(x), y).backward()  # prepare's bf16: autocast forward, fp32 output
        opt.step()
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = theirs(x)
        nn.functional.mse_loss(out.float(), y).backward()
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
        worst.append(_worst(dict(model.unwrap().named_parameters()), theirs.module))
    return worst


def test_prepare_with_bf16_matches_torch_ddp_under_autocast() -> None:
    """``prepare(model, optimizer, loader, precision="bf16")`` on the device it picks (cuda with NCCL)
    against torch's DDP with the same autocast written out, AdamW."""
    worst = on_one_rank(_prepare_bf16)
    assert len(worst) == STEPS and max(worst) <= TOLERANCE, worst


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> str:
    """A 2-layer GPT-2 (vocabulary 256, no dropout) saved with its weights, as a user's local model directory."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


def _hf_parity(rank: int, world_size: int, device_type: str, path: str) -> list[float]:
    from dptrain.models.hf import causal_lm

    device = rank_device(device_type)
    base = causal_lm(path).to(device).train()
    theirs, ours = TorchDDP(copy.deepcopy(base)), DistributedDataParallel(copy.deepcopy(base))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (theirs, ours)]
    worst = []
    for step in range(STEPS):
        x, _ = _tokens(step, device)
        for model, opt in zip((theirs, ours), opts, strict=True):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        worst.append(_worst(dict(ours.module.named_parameters()), theirs.module))
    return worst


def test_a_hugging_face_model_from_a_local_directory_matches_torch_ddp(gpt2_dir: str) -> None:
    """``causal_lm(dir)`` (transformers' GPT-2, its saved weights loaded, the hub never contacted) under bf16
    autocast, dptrain's DDP against torch's, AdamW."""
    worst = on_one_rank(_hf_parity, gpt2_dir)
    assert max(worst) <= TOLERANCE, worst

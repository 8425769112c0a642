"""The conformance matrix: every registered strategy, on every surface a user reaches it from, with every model kind
that surface takes, held to every obligation.

The strategies come from the registry (``dptrain.strategies.strategy_names()``), so a new
entry joins every row with no test edited. A cell a strategy cannot fill is not skipped: it
is refused before training with one line saying why, and the suite checks that refusal
(:func:`refusal` derives it from the entry's facts, never from its name).
``tests/test_conformance.py`` runs the matrix; ``docs/repro/conformance_table.py`` writes
docs/conformance.md from these parameters, and a test keeps the two equal.
"""

from __future__ import annotations

import torch
from torch import nn

from dptrain.strategies import REGISTRY, strategy_names

SURFACES = {
    "run": "dptrain run (the job runner, its checkpoints and reports)",
    "Engine": "dptrain.Engine (your loop around engine.step())",
    "prepare": "dptrain.prepare() (your ordinary loop, Accelerate's way)",
}

MODEL_KINDS = {
    "gpt": "the built-in GPT (tied embedding and head)",
    "hf": "a Hugging Face GPT2LMHeadModel (2 layers, 48 wide, tied embeddings)",
    "plain": "your own nn.Module with buffers (BatchNorm's running statistics)",
}

# obligation -> (surfaces it applies to, what it checks)
OBLIGATIONS = {
    "trains": (("run", "Engine", "prepare"), "the loss falls, measured on the weights that are exported"),
    "evaluates": (("run", "Engine", "prepare"), "an evaluation runs at the end (Engine, prepare: through the "
                                                "surface's model, equal to the exported weights' loss)"),
    "module": (("Engine", "prepare"), "model.module is your model, its parameters visible (count, device, dtype)"),
    "usual save": (("Engine", "prepare"), "model.module.state_dict() is the full weights, or a one-line error "
                                          "naming dptrain.get_state_dict: never empty or partial"),
    "full state": (("Engine", "prepare"), "dptrain.get_state_dict gives the bare model's keys, the same on every "
                                          "rank; set_state_dict takes them back"),
    "torch helpers": (("prepare",), "isinstance(model, torch DDP); torch's get_model_state_dict / "
                                    "set_model_state_dict give and take the bare model's keys"),
    "same weights": (("Engine", "prepare"), "after dptrain.end_training every rank holds the same weights "
                                            "(DiLoCo: the global weights)"),
    "exported": (("run",), "model.safetensors equals dptrain consolidate of the last checkpoint"),
    "resume": (("run", "prepare"), "on another number of ranks: run: continues on 3 ranks from the step it stopped "
                                   "(or a one-line refusal, exit 2); prepare: the full state saved on 2 ranks loads "
                                   "on 1"),
    "report": (("run",), "the summary names the strategy; its bytes per step are the records' over the whole run"),
}


def strategies() -> tuple[str, ...]:
    return strategy_names()


def refusal(strategy: str, surface: str) -> str | None:
    """Why ``strategy`` cannot fill ``surface``'s cells (said before training, one line), or None."""
    entry = REGISTRY[strategy]
    if surface != "run" and entry.wrap is None:
        return "its ranks run different programs (its own loop): dptrain run only"
    return None


def cells() -> list[tuple[str, str, str]]:
    """(strategy, surface, model kind) for every cell of the matrix."""
    return [(s, surface, kind) for s in strategies() for surface in SURFACES for kind in MODEL_KINDS]


# ----------------------------------------------------------------------------- the model kinds, for the user API

VOCAB, BLOCK = 32, 8


class WithBuffers(nn.Module):
    """A user's plain module: a BatchNorm between two layers (float running statistics, an integer counter)."""

    def __init__(self, features: int = 6, classes: int = 4, width: int = 16):
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(features, width), nn.BatchNorm1d(width), nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


def build(kind: str) -> nn.Module:
    """The same model on every rank (seeded)."""
    torch.manual_seed(0)
    if kind == "gpt":
        from dptrain.models.gpt import GPT

        return GPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=1, n_head=2, n_embd=16)
    if kind == "hf":
        import transformers

        transformers.logging.set_verbosity_error()  # its notes on a tiny config's token ids, in every rank's output
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=48, n_layer=2, n_head=2,
                                         bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config)
    return WithBuffers()


def dataset(kind: str, samples: int = 64) -> torch.utils.data.TensorDataset:
    """A learnable task for each kind: the next token of a repeating sequence, or a linear labelling."""
    g = torch.Generator().manual_seed(1)
    if kind == "plain":
        x = torch.randn(samples, 6, generator=g)
        return torch.utils.data.TensorDataset(x, (x[:, :4] * torch.arange(1, 5)).argmax(1))
    start = torch.randint(0, VOCAB, (samples, 1), generator=g)
    seq = (start + torch.arange(BLOCK + 1)) % VOCAB
    return torch.utils.data.TensorDataset(seq[:, :-1], seq[:, 1:])


def loss_of(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=x, labels=x) if kind == "hf" else model(x)
    if kind == "hf":
        return out.loss
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

"""``dptrain consolidate``: a checkpoint's full weights as one safetensors file, in one process.

Imports torch only when it runs, so that ``dptrain --help`` stays quick.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

__all__ = ["consolidate"]


@click.command("consolidate")
@click.argument("checkpoint_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=Path("model.safetensors"),
              show_default=True, help="the safetensors file to write (written beside it under a temporary name, "
                                      "then renamed over it)")
@click.option("--optimizer", is_flag=True,
              help="also write the optimizer state, as optim.state.<name>.<key> tensors, with each parameter's "
                   "hyperparameters as JSON in the file's metadata")
def consolidate(checkpoint_dir: Path, output: Path, optimizer: bool) -> None:
    """Write CHECKPOINT_DIR's full weights to one safetensors file, under the model's parameter names.

    CHECKPOINT_DIR is a run directory (its newest checkpoint), a checkpoint directory
    (checkpoints/step_*), or its sharded/ directory. A ZeRO checkpoint saved on any number
    of ranks is read in this one process, without a process group; a ddp checkpoint too.
    Load the result with model.load_state_dict(safetensors.torch.load_file(PATH)).
    """
    from dptrain.checkpoint.consolidate import ConsolidateError, consolidate_checkpoint

    try:
        done = consolidate_checkpoint(checkpoint_dir, output, optimizer=optimizer)
    except ConsolidateError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(f"{done.output}: {done.tensors} tensors, {done.numel:,} elements, {done.size_bytes / 2**20:,.1f} MiB "
               f"(from {done.checkpoint})")

"""Training on top of the DDP engine: the Engine step for your own loop, and the loop
``dptrain run`` executes (config -> prepare -> loop, with metrics, trace, checkpoints)."""

from dptrain.train.engine import Engine, StepInfo

__all__ = ["Engine", "StepInfo"]

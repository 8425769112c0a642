"""The strategies' own sections of a run's config ([zero], [ps], [gossip], [localsgd], [diloco]): their fields, and
each section's check of its own values, before launch (the strategy's options policy checks the same for the API)."""

from __future__ import annotations

from dataclasses import dataclass

from dptrain.config.errors import ConfigError
from dptrain.config.fields import opt

__all__ = ["ZeROConfig", "PSConfig", "GossipConfig", "LocalSGDConfig", "DiLoCoConfig"]


@dataclass
class ZeROConfig:
    unit_classes: list = opt([], "zero3: names of the module classes that are gathered and freed as one unit "
                             "(e.g. ['Block']); empty: the blocks of the model's first ModuleList, or min_unit_numel")
    min_unit_numel: int = opt(0, "zero3: make every module with at least this many parameters a unit instead "
                              "(0: only when no unit class is given or found)")
    reshard_after_forward: bool = opt(True, "zero3: free a unit's gathered parameters after its forward (and "
                                      "gather again in backward); false keeps them until backward is done")
    prefetch: bool = opt(True, "zero3: start gathering the next unit while the current one computes")
    reduce_dtype: str = opt("fp32", "with precision bf16: the dtype gradients are reduce-scattered in (bf16 halves "
                            "the bytes)", choices=("fp32", "bf16"))
    shard_size: int = opt(0, "zero1-3: shard over groups of this many consecutive ranks (a host's) and replicate "
                          "across groups, all-reducing gradient shards between replicas (hybrid sharding, HSDP); "
                          "0: shard over all ranks")

    def check(self) -> None:
        """This section's own values (the shard size against the world: the strategy's entry, zero_check)."""
        if not all(isinstance(name, str) for name in self.unit_classes):
            raise ConfigError(f"zero.unit_classes must be module class names, got {self.unit_classes}; e.g. "
                              "--set 'zero.unit_classes=[\"Block\"]'")
        if self.min_unit_numel < 0:
            raise ConfigError(f"zero.min_unit_numel must be a parameter count >= 0, got {self.min_unit_numel}; "
                              "0 lets zero.unit_classes choose the units")
        if self.shard_size < 0:
            raise ConfigError(f"zero.shard_size must be >= 0, got {self.shard_size}; 0 shards over all ranks, or "
                              "give the ranks per host for hybrid sharding")


@dataclass
class PSConfig:
    servers: int = opt(1, "strategy ps: parameter-server ranks (the last ones); the other ranks are workers")
    mode: str = opt("sync", "strategy ps: sync (a round averages every worker's gradient), async (apply each on "
                    "arrival), ssp (async with a staleness bound) or backup (a round takes the first "
                    "workers - backups gradients)", choices=("sync", "async", "ssp", "backup"))
    staleness: int = opt(2, "mode ssp: how many steps a worker may run ahead of the slowest")
    backups: int = opt(1, "mode backup: the slowest gradients of each round that are not waited for")
    lookahead: bool = opt(False, "modes async and ssp: answer each worker with the parameters predicted for when its "
                          "gradient will be applied (delay compensation after DANA; adamw, adam or sgd)")


@dataclass
class GossipConfig:
    topology: str = opt("ring", "strategy gossip: whom each rank averages with: ring (both neighbours) or "
                        "exponential (one peer per step at distance 1, 2, 4, ...)", choices=("ring", "exponential"))


@dataclass
class LocalSGDConfig:
    period: int = opt(8, "strategy localsgd: optimizer steps between two averages of the replicas (H); 1 is "
                      "synchronous SGD")
    warmup_steps: int = opt(0, "strategy localsgd: the first steps are the DDP engine's, gradients all-reduced every "
                            "step (post-local SGD)")

    def check(self) -> None:
        """This section's own values, named by key before launch (LocalSGDOptions checks the same for the API)."""
        if self.period < 1:
            raise ConfigError(f"localsgd.period must be a whole number of steps >= 1, got {self.period}; 1 averages "
                              "after every step (synchronous SGD), e.g. --set localsgd.period=8")
        if self.warmup_steps < 0:
            raise ConfigError(f"localsgd.warmup_steps must be >= 0, got {self.warmup_steps}; 0 takes local steps "
                              "from the first, e.g. --set localsgd.warmup_steps=0")


@dataclass
class DiLoCoConfig:
    period: int = opt(50, "strategy diloco: inner steps of train.optimizer between two outer steps (H)")
    outer_lr: float = opt(0.0, "strategy diloco: the outer optimizer's learning rate (SGD on the averaged "
                          "pseudo-gradient); 0: by the number of replicas M, the scaling-law paper's best at H = 30 "
                          "(0.4 at M = 1, 0.6 at 2 and 4, 0.8 from 8)")
    outer_momentum: float = opt(0.7, "strategy diloco: the outer optimizer's momentum (the papers' 0.9 overshoots "
                                "from scratch at these sizes: docs/localsgd.md's ablations)")
    nesterov: bool = opt(True, "strategy diloco: Nesterov momentum for the outer step")
    compression: str = opt("none", "strategy diloco: the pseudo-gradient's reduction in bf16, int8, or 4 bits "
                           "(int4, or e3m0: Streaming DiLoCo's FP4), summed in fp32, with error_feedback",
                           choices=("none", "bf16", "int8", "int4", "e3m0"))
    error_feedback: bool = opt(True, "strategy diloco: add what a rank's compressed pseudo-gradient lost to its next "
                               "one")
    offload: bool = opt(True, "strategy diloco: keep the global weights and the outer momentum on the CPU")
    warmup_steps: int = opt(0, "strategy diloco: the first steps are the DDP engine's, gradients all-reduced every "
                               "step; the global weights start where they end (the paper starts from a model "
                               "trained synchronously)")
    fragments: int = opt(1, "strategy diloco: Streaming DiLoCo: the trained parameters in this many fragments, "
                         "each synced every period steps, one every period / fragments steps (1: DiLoCo)")
    fragment_pattern: str = opt("strided", "strategy diloco: which blocks a fragment holds: strided (p, p + P, ...: "
                                "the paper's) or sequential", choices=("strided", "sequential"))
    overlap_steps: int = opt(0, "strategy diloco: a fragment's reduction runs while this many inner steps are "
                             "taken (tau; below period / fragments)")
    mixing: float = opt(0.0, "strategy diloco: the share alpha of its own weights a replica keeps when a fragment's "
                        "outer step lands (0: the global weights)")

    def check(self) -> None:
        """This section's own values, named by key before launch (DiLoCoOptions checks the same for the API)."""
        if self.period < 1:
            raise ConfigError(f"diloco.period must be a whole number of inner steps >= 1, got {self.period}; the "
                              "paper uses 500 from a pretrained model, e.g. --set diloco.period=50 from scratch")
        if not self.outer_lr >= 0:
            raise ConfigError(f"diloco.outer_lr must be 0 (by the number of replicas) or above, got {self.outer_lr}; "
                              "the paper's is 0.7 (1 with no momentum takes the average of the ranks' weights): "
                              "--set diloco.outer_lr=0.7")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"diloco.outer_momentum must be in [0, 1), got {self.outer_momentum}; the default is "
                              "0.7, the papers' 0.9: --set diloco.outer_momentum=0.7")
        if self.warmup_steps < 0:
            raise ConfigError(f"diloco.warmup_steps must be >= 0, got {self.warmup_steps}; 0 starts the outer "
                              "steps from the first, e.g. --set diloco.warmup_steps=0")
        if self.fragments < 1 or self.period % self.fragments:
            raise ConfigError(f"diloco.fragments must divide diloco.period = {self.period}, got {self.fragments}: "
                              "one fragment syncs every period / fragments steps, e.g. --set diloco.fragments=1")
        if not 0 <= self.overlap_steps < self.period // self.fragments:
            raise ConfigError(f"diloco.overlap_steps must be in [0, period / fragments = "
                              f"{self.period // self.fragments}), got {self.overlap_steps}: one reduction is in "
                              "flight at a time, e.g. --set diloco.overlap_steps=0 (none overlapped)")
        if not 0 <= self.mixing < 1:
            raise ConfigError(f"diloco.mixing must be in [0, 1), got {self.mixing}; 0 takes the global weights, "
                              "the paper also uses 0.5: --set diloco.mixing=0.5")

"""Your own datasets: ``data.factory = "package.module:make_datasets"``.

The factory is called with ``data.factory_args`` as keyword arguments and returns the
training and validation sets, torch map-style ``Dataset``s (``__len__`` and
``__getitem__``), and optionally a collate function third (how a list of samples
becomes a micro-batch; torch's ``default_collate`` otherwise). Map-style because a run
resumes at a step: its position in the data is a sample index, which an
``IterableDataset`` does not have. Samples go to the model as the loss protocol says
(``dptrain.tasks.protocol``): ``(inputs, targets)`` tuples, or dicts of keyword arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset, IterableDataset

from dptrain.config import ConfigError
from dptrain.config.factory import load_factory

__all__ = ["user_datasets"]


def user_datasets(spec: str, args: dict[str, Any]) -> tuple[Dataset, Dataset, Callable | None]:
    """(train, validation, collate function or None) from the user's factory, each checked."""
    if not spec:
        raise ConfigError("data.source = \"factory\" needs data.factory = 'package.module:make_datasets'")
    factory = load_factory(spec, "data.factory")
    try:
        result = factory(**args)
    except TypeError as e:
        raise ConfigError(f"data.factory {spec!r} with data.factory_args {args}: {e}") from None
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise ConfigError(f"data.factory {spec!r} returned {type(result).__name__}; it must return (train, val) or "
                          "(train, val, collate_fn)")
    train, val, collate = (*result, None) if len(result) == 2 else result
    for name, ds in (("training", train), ("validation", val)):
        if isinstance(ds, IterableDataset):
            raise ConfigError(f"data.factory {spec!r}: the {name} set is an IterableDataset; a run resumes at a "
                              "sample index, so it needs a map-style Dataset (__len__ and __getitem__)")
        if not isinstance(ds, Dataset) or not hasattr(ds, "__len__"):
            raise ConfigError(f"data.factory {spec!r}: the {name} set is {type(ds).__name__}, not a torch "
                              "Dataset with __len__ and __getitem__")
        if len(ds) == 0:
            raise ConfigError(f"data.factory {spec!r}: the {name} set is empty")
    if collate is not None and not callable(collate):
        raise ConfigError(f"data.factory {spec!r}: the third value must be a collate function, got "
                          f"{type(collate).__name__}")
    return train, val, collate

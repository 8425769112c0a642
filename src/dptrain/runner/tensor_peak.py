"""The peak bytes of live tensors during a training step: what ``dptrain plan`` predicts.

On CUDA the caching allocator keeps this count (``torch.cuda.max_memory_allocated``). On
CPU nothing does, and the process's resident memory is no substitute: about 320 MiB of it
is the libraries, and the allocator keeps freed memory. So on CPU one step is watched
from inside the dispatcher (a ``TorchDispatchMode``, the mechanism of torch's own memory
trackers): at the start, every tensor storage Python can reach (parameters, gradients,
optimizer state, buffers, communication buffers) is counted, except the data set's
(``exclude``: on a GPU it would stay in host memory, and no plan of the model counts it);
then each new storage an
operation returns is added, and each storage is subtracted when it is freed (a weak
reference's callback). The live bytes after every operation are known, and the peak is
their maximum: parameters + gradients + optimizer state + saved activations + buffers,
each storage once (views share theirs). A storage emptied in place outside the
dispatcher (``untyped_storage().resize_(0)``: ZeRO frees a reduced gradient that way
while another thread may still hold the tensor, [Note: a finished collective's input]
in ``zero/reduction.py``) is recounted before a new peak is taken and when
``live_bytes`` is read, so it stops counting when it is emptied, not when it is dropped.

Not seen: memory a kernel allocates and frees inside one operation (workspaces),
storages made outside the dispatcher (``torch.from_numpy``) or on another thread
(dptrain's progress threads allocate their scratch once, in the first step, and are
counted from the second step on, reachable from Python). Every operation costs a Python
call while the mode is on, so the trainer measures one step, not every step.

    with TensorPeak(extra=model.parameters(), exclude=data_tensors(dataset)) as peak:
        train_one_step()
    peak.peak_bytes
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Iterable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TensorPeak", "reachable_tensors", "data_tensors"]


class TensorPeak(TorchDispatchMode):
    """Live tensor bytes on ``device_type``, watched operation by operation while the mode is on."""

    def __init__(self, device_type: str = "cpu", extra: Iterable[torch.Tensor | None] = (),
                 exclude: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.device_type = device_type
        self._live = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}  # a storage's StorageImpl address -> its bytes
        self._refs: dict[int, weakref.ref] = {}
        self._extra = extra
        self._excluded = {t.untyped_storage()._cdata for t in exclude}

    def __enter__(self) -> TensorPeak:
        # No recount while the tensors alive at the start are taken: each would raise the peak and rescan every
        # storage seen so far, quadratic in the process's tensors (thousands in a long-lived process).
        self.peak_bytes = float("inf")
        for t in [*self._extra, *reachable_tensors()]:
            if t is not None:
                self._track(t)
        self._extra = ()  # holding them would keep them alive
        self._recount()
        self.peak_bytes = self._live
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._refs.clear()  # the weak references go, and their callbacks with them

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type != self.device_type or t.is_sparse:
            return
        storage = t.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        if key in self._excluded:
            return
        known = self._sizes.get(key)
        if known is None:
            self._refs[key] = weakref.ref(storage, lambda _, key=key: self._freed(key))
        elif known == nbytes:
            return
        self._sizes[key] = nbytes  # new, or resized in place (resize_)
        self._live += nbytes - (known or 0)
        if self._live > self.peak_bytes:
            self._recount()
            self.peak_bytes = max(self.peak_bytes, self._live)

    @property
    def live_bytes(self) -> int:
        """The bytes of the tracked storages alive now."""
        self._recount()
        return self._live

    def _recount(self) -> None:
        """Take the current size of every tracked storage: some are emptied in place (see the module docstring)."""
        for key, ref in list(self._refs.items()):  # a snapshot: another thread may free one meanwhile
            storage = ref()
            known = self._sizes.get(key)
            if storage is not None and known is not None and storage.nbytes() != known:
                self._sizes[key] = storage.nbytes()
                self._live += storage.nbytes() - known

    def _freed(self, key: int) -> None:
        self._live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)


def reachable_tensors() -> list[torch.Tensor]:
    """Every tensor the Python garbage collector can see (a tensor held only from C++ is not among them)."""
    found = []
    with warnings.catch_warnings():  # isinstance() on deprecated module aliases warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor):
                    found.append(obj)
            except ReferenceError:  # a weak proxy whose referent is gone
                continue
    return found


def data_tensors(*datasets: object) -> list[torch.Tensor]:
    """The tensors a data set holds in its attributes (a ``TensorDataset``'s ``tensors``, a corpus), one level deep."""
    found = []
    for dataset in datasets:
        for value in vars(dataset).values() if hasattr(dataset, "__dict__") else ():
            values = value if isinstance(value, (list, tuple)) else [value]
            found += [v for v in values if isinstance(v, torch.Tensor)]
    return found

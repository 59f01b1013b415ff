"""A test instrument: peak bytes of live tensor storages, for checking the memory plan's formulas on CPU."""

from __future__ import annotations

import weakref


class LiveTensorBytes:
    """Peak bytes of live tensor storages, seen through the dispatcher: `max_memory_allocated` for any device.

    Counts every storage an op creates (forward, backward, recompute, optimizer) and the `existing` tensors
    handed in, until autograd and Python drop them. Kernel-internal scratch is not seen. Used on CPU to check
    the plan's formulas term by term; on CUDA the allocator's own counters are the truth.
    """

    def __init__(self, existing=()):
        self._live: dict[int, int] = {}  # id of a live storage's Python object -> its bytes
        self._total = 0
        for t in existing:
            self._add(t)
        self.peak = self._total

    def _add(self, t) -> None:
        # Storages keep one Python object for their lifetime, so a finalizer on it fires when the memory is
        # freed; ids are removed before they can be reused.
        st = t.untyped_storage()
        key = id(st)
        if key not in self._live:
            self._live[key] = st.nbytes()
            self._total += st.nbytes()
            weakref.finalize(st, self._freed, key)

    def _freed(self, key: int) -> None:
        self._total -= self._live.pop(key, 0)

    def live(self) -> int:
        return self._total

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        tracker._add(t)
                tracker.peak = max(tracker.peak, tracker._total)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)

"""Plans by signature: the runtime's call plans (`dmattn_bench.plan`) and the launchers' own, and
the tensors' part of a signature."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable


class PlanCache:
    """Plans by signature, at most `size` of them, the oldest built dropped first. A lookup is one
    dict read, without the lock (a training or serving loop repeats a handful of signatures);
    adding and clearing take it."""

    def __init__(self, size: int):
        self.size = size
        self._plans: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple):
        return self._plans.get(key)

    def put(self, key: tuple, plan) -> None:
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self.size:
                self._plans.popitem(last=False)

    def get_or_build(self, key: tuple, build: Callable[[], object]):
        plan = self._plans.get(key)
        if plan is None:
            plan = build()
            self.put(key, plan)
        return plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()


def python_tensor_layouts(*tensors) -> tuple:
    """The tensors' part of a plan key: each one's shape, strides, dtype, device and 16-byte
    alignment (None for an absent one). Raises AttributeError on a non-tensor."""
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15) for t in tensors)

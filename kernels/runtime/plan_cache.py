"""Plans by signature: the runtime's call plans (`dmattn_bench.plan`) and the launchers' own."""

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

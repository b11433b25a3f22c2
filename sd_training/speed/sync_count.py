"""Count the calls that make the host wait for the device (on CUDA) inside a window of code.

    with BlockingCalls() as calls:     # on any device: counts tensor .item(), bool(), float(), .cpu(), ...
        step()
    calls.found                        # [(label, method name), ...]

On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` is the authoritative check (scripts/sync_check.py
uses it); this counter finds the same calls on the CPU, where nothing would block, so the CPU test
suite and benchmarks/bench_step.py can hold the step to zero.
"""

from __future__ import annotations

from typing import Callable

import torch

BLOCKING = ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy")


class BlockingCalls:
    """Patch the blocking ``torch.Tensor`` methods while active; ``label()`` tags each call found."""

    def __init__(self, label: Callable[[], object] = lambda: None, active: bool = True):
        """``active``: count from the start of the ``with`` block; False: only while ``active`` is set
        (e.g. by a wrapper around the step methods)."""
        self.label = label
        self.found: list[tuple[object, str]] = []
        self.active = False
        self._start_active = active
        self._saved: dict[str, Callable] = {}

    def __enter__(self) -> "BlockingCalls":
        for name in BLOCKING:
            real = getattr(torch.Tensor, name)
            self._saved[name] = real

            def counted(tensor, *args, _real=real, _name=name, **kw):
                if self.active:
                    self.found.append((self.label(), _name))
                return _real(tensor, *args, **kw)

            setattr(torch.Tensor, name, counted)
        self.active = self._start_active
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)
        self._saved.clear()

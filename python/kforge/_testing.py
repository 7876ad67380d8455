"""Test and A/B-timing aids that change what a launcher does; not for models.

override(op, variant=..., max_warps=...) forces a launcher's dispatch while the `with` block runs:
    with kforge._testing.override("layernorm_backward", variant=1):   # never RING / GROUP
        kforge._C.layernorm_backward(...)
Launchers with an override: kforge._C._testing_override_ops(); their variants: kforge._C.plan's
docstring and src/ops/<op>_plan.h. The setting is process-wide (every thread, every device); a CUDA
graph captured inside the block replays the kernels chosen at capture.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from . import _C


@contextlib.contextmanager
def override(op: str, variant: int = 0, max_warps: int = 0) -> Iterator[None]:
    """Force `op`'s launcher to `variant` and at most `max_warps` resident warps per SM (0: its own
    limit) inside the block; the previous setting comes back after it (also on an exception)."""
    before = _C._testing_override(op)
    _C._set_testing_override(op, variant, max_warps)
    try:
        yield
    finally:
        _C._set_testing_override(op, *before)


@contextlib.contextmanager
def overrides(ops: dict[str, dict[str, int]]) -> Iterator[None]:
    """Several launchers at once: {op: {"variant": v, "max_warps": w}}."""
    with contextlib.ExitStack() as stack:
        for op, kw in ops.items():
            stack.enter_context(override(op, **kw))
        yield

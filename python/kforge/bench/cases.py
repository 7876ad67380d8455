"""What an op contributes to `python -m kforge.bench ops`: a list of BenchCase rows.

Each op module may define `bench_cases(dtype: torch.dtype, quick: bool) -> list[BenchCase]`. The
bench harness times `kforge`, `eager` and `torch.compile(eager)` on the same inputs with CUDA events
and reports GB/s from `bytes` (the fewest bytes the op must move: each input read once, each output
written once) against the measured device-to-device copy bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class BenchCase:
    op: str                          # op name, e.g. "layernorm"
    direction: str                   # "fwd" or "bwd"
    shape: str                       # human-readable size, e.g. "8192x768"
    make_inputs: Callable[[], tuple]  # fresh CUDA inputs (called once; random data, never zeros)
    kforge: Callable[..., Any]       # calls the kforge launcher(s) directly (no autograd)
    eager: Callable[..., Any]        # the same computation in plain PyTorch
    bytes: int                       # minimal bytes moved (reads + writes)
    compile_ok: bool = True          # whether torch.compile(eager) is meaningful here

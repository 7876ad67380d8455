"""A/B timing of a launcher's `variant`s on the bench cases of `python -m kforge.bench ops`:

    python scripts/ab.py rmsnorm:bwd:rmsnorm_backward:0,1 softmax:fwd:softmax_forward:0,1,2

Each spec is op:dir:binding:variants. The case's own kforge call is run under the launcher's testing
override, `kforge._testing.override(binding, variant=v)` (launchers with one:
`kforge._C._testing_override_ops()`), and timed like the ops benchmark (back-to-back calls, CUDA
events, inputs rotated through more than L2). A variant written name=value sets that override
instead, e.g. layernorm:fwd:layernorm_forward:0,max_warps=16.
A spec op:dir (no binding) times the case's kforge call as it is: for A/B of a process-wide switch,
e.g. `KFORGE_DEPENDENT_LAUNCH=0 python scripts/ab.py colsum:fwd` against the same without it.
"""
import contextlib
import sys

import torch

from kforge._testing import override
from kforge.bench.harness import copy_bandwidth_gbs, input_sets_for, op_modules, same_size_copy_us, time_op


def _override(binding: str, variant: str):
    """The testing override for `variant` ("3" or "name=3") of `binding`; none without a binding."""
    if not binding:
        return contextlib.nullcontext()
    key, _, value = variant.rpartition("=")
    return override(binding, **{key or "variant": int(value)})


def main(specs: list[str]) -> None:
    bw = copy_bandwidth_gbs()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"copy bandwidth {bw:.0f} GB/s")
    for spec in specs:
        op, d, binding, variants = (spec.split(":") + ["", ""])[:4]
        (mod,) = op_modules([op])
        for dtype in (torch.float32, torch.bfloat16):
            for case in mod.bench_cases(dtype, True):
                if case.direction != d:
                    continue
                sets = input_sets_for(case, l2)
                same = same_size_copy_us(case.bytes, l2)
                cells = []
                for v in variants.split(",") if binding else ["-"]:
                    try:
                        with _override(binding, v):
                            us = time_op(case.kforge, sets)
                        cells.append(f"v{v} {us:7.1f} us {100 * case.bytes / (us * 1e-6) / 1e9 / bw:4.0f}%")
                    except Exception as e:  # keep going: report the broken variant
                        cells.append(f"v{v} ERROR {type(e).__name__}: {str(e)[:80]}")
                eager = time_op(case.eager, sets)
                print(f"{op:10s} {d} {case.shape:26s} {str(dtype)[6:]:9s} copy {same:6.1f} us | eager "
                      f"{eager:7.1f} us | " + " | ".join(cells), flush=True)
                del sets
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])

"""Run chosen `python -m kforge.bench ops` cases once each, for Nsight Compute to profile:

    ncu --clock-control none --kernel-name regex:'^(?!.*(elementwise|distribution|fill))' \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section WarpStateStats python3 scripts/ncu_probe.py rmsnorm:bwd:bf16 layernorm::bf16

Arguments are op[:dir[:dtype[:binding=variant]]] filters (empty part = any); only the first (quick)
size is run. With binding=variant, `kforge._C.<binding>` runs under its testing override
`kforge._testing.override(binding, variant=...)` (as scripts/ab.py does), e.g.
rmsnorm:bwd:bf16:rmsnorm_backward=1.
"""
import contextlib
import sys

import torch

from kforge._testing import override
from kforge.bench.harness import op_modules

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main(argv: list[str]) -> None:
    want = [(a.split(":") + ["", "", ""])[:4] for a in argv]
    for op, d, dt, bv in want:
        for mod in op_modules([op]):
            binding, v = bv.split("=") if bv else ("", "0")
            for name, dtype in DT.items():
                if dt and dt != name:
                    continue
                for case in mod.bench_cases(dtype, True):
                    if d and case.direction != d:
                        continue
                    inputs = case.make_inputs()
                    torch.cuda.synchronize()
                    torch.cuda.nvtx.range_push(f"{case.op}.{case.direction}.{case.shape}.{name}")
                    with override(binding, variant=int(v)) if binding else contextlib.nullcontext():
                        case.kforge(*inputs)
                    torch.cuda.nvtx.range_pop()
                    torch.cuda.synchronize()
                    print("ran", case.op, case.direction, case.shape, name, bv, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

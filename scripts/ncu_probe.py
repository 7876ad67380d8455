"""Run chosen `python -m kforge.bench ops` cases once each, for Nsight Compute to profile:

    ncu --clock-control none --kernel-name regex:'^(?!.*(elementwise|distribution|fill))' \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section WarpStateStats python3 scripts/ncu_probe.py rmsnorm:bwd:bf16 layernorm::bf16

Arguments are op[:dir[:dtype]] filters (empty part = any); only the first (quick) size is run.
"""
import sys

import torch

from kforge.bench.harness import op_modules

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main(argv: list[str]) -> None:
    want = [(a.split(":") + ["", ""])[:3] for a in argv]
    for op, d, dt in want:
        for mod in op_modules([op]):
            for name, dtype in DT.items():
                if dt and dt != name:
                    continue
                for case in mod.bench_cases(dtype, True):
                    if d and case.direction != d:
                        continue
                    inputs = case.make_inputs()
                    torch.cuda.synchronize()
                    torch.cuda.nvtx.range_push(f"{case.op}.{case.direction}.{case.shape}.{name}")
                    case.kforge(*inputs)
                    torch.cuda.nvtx.range_pop()
                    torch.cuda.synchronize()
                    print("ran", case.op, case.direction, case.shape, name, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

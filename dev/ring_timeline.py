"""When each block of the RMSNorm ring backward finishes its rows and its dweight epilogue.

A copy of kernels_src is patched so that the ring kernel (bf16, 8192 x 4096, the Llama bench case)
reads %globaltimer at its start, after its row loop, after the fold of its row groups' dweight sums
through shared memory, and after its partial row is written; thread 0 of block b stores the four
stamps and its SM's id as raw bits over dx's first bytes (dx is garbage there, nothing else
changes). The patched copy is used through KFORGE_KERNEL_DIR (the kernel cache is keyed by the
source), so no rebuild.
Prints, per call: the spread of the blocks' loop ends, the epilogues of the last blocks to finish, and
a histogram of the loop ends; at the end, whether the same SMs are slow in every call (the correlation
over SMs of the loop ends of different calls: near 1 if an SM's pace is a property of the SM, near 0
if it changes from call to call).
GPU only: python dev/ring_timeline.py [kernel source dir to patch, default kernels_src]
"""
import atexit
import os
import pathlib
import shutil
import sys
import tempfile

SRC = pathlib.Path(__file__).resolve().parent.parent / "kernels_src"
PATCHES = [  # (anchor in rmsnorm_backward_ring_kernel, replacement)
    ("  kf_wait_prior_grids();\n  using E = Vec16<T>;",
     "  kf_wait_prior_grids();\n  unsigned long long ts0, ts1, ts2 = 0, ts3;\n"
     "  asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(ts0));\n  using E = Vec16<T>;"),
    ("  if (dw_partial == nullptr) return;",
     "  asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(ts1));\n"
     "  if (dw_partial == nullptr) return;"),
    ("      part4[q] = sum;\n    }\n  }\n}",
     "      part4[q] = sum;\n    }\n  }\n  __syncthreads();\n"
     "  asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(ts3));\n"
     "  if (threadIdx.x == 0 && threadIdx.y == 0) {\n"
     "    unsigned sm;\n    asm(\"mov.u32 %0, %%smid;\" : \"=r\"(sm));\n"
     "    unsigned long long* o = reinterpret_cast<unsigned long long*>(dx) + blockIdx.x * 5;\n"
     "    o[0] = ts0, o[1] = ts1, o[2] = ts2, o[3] = ts3, o[4] = sm;\n  }\n}"),
    ("    __syncthreads();\n    float4* part4",
     "    __syncthreads();\n    asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(ts2));\n"
     "    float4* part4"),
]


def patched_kernel_dir(src: pathlib.Path = SRC) -> str:
    out = pathlib.Path(tempfile.mkdtemp(prefix="kforge-timeline-"))
    shutil.copytree(src, out, dirs_exist_ok=True)
    path = out / "rmsnorm.cu"
    text = path.read_text()
    start = text.index("rmsnorm_backward_ring_kernel(")
    for anchor, new in PATCHES:
        at = text.find(anchor, start)
        if at < 0:
            raise SystemExit(f"ring_timeline: the ring kernel changed, anchor not found:\n{anchor}")
        text = text[:at] + new + text[at + len(anchor):]
    path.write_text(text)
    return str(out)


def main() -> None:
    patched = patched_kernel_dir(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else SRC)
    atexit.register(shutil.rmtree, patched, True)
    os.environ["KFORGE_KERNEL_DIR"] = patched
    import torch
    from kforge import _C

    dt, rows, D = torch.bfloat16, 8192, 4096
    w = torch.randn(D, device="cuda", dtype=dt)
    _, rstd = _C.rmsnorm_forward(torch.randn(rows, D, device="cuda", dtype=dt), w, 1e-6)
    sets = [(torch.randn(rows, D, device="cuda", dtype=dt), torch.randn(rows, D, device="cuda", dtype=dt))
            for _ in range(3)]
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    grid = min(nsm, rows // 3)
    per_sm = []  # per call: loop end (us from the call's first start) indexed by SM id
    for _ in range(3):
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)  # the calls below then run back to back
        outs = [_C.rmsnorm_backward(*sets[i % 3], w, rstd) for i in range(9)]
        torch.cuda.synchronize()
        for n, (dx, _) in enumerate(outs[1:]):
            t = dx.view(-1)[: grid * 20].view(torch.int64).view(grid, 5).cpu()
            r = (t[:, :4] - t[:, 0].min()).double() / 1000.0  # microseconds from the first block's start
            loop_end = torch.full((nsm,), float("nan"), dtype=torch.float64)
            loop_end[t[:, 4]] = r[:, 1]
            per_sm.append(loop_end)
            if n < len(outs) - 3:
                continue
            order = torch.argsort(r[:, 1])
            epi = r[:, 3] - r[:, 1]
            last = "; ".join(f"{r[i, 1]:.2f}->{r[i, 2]:.2f}->{r[i, 3]:.2f}" for i in order[-3:].tolist())
            print(f"start spread {r[:, 0].max():.2f} us | loop end: first {r[order[0], 1]:.2f} median "
                  f"{r[:, 1].median():.2f} last {r[order[-1], 1]:.2f} | the last 3 blocks' loop end -> fold "
                  f"-> partial row written: {last} | epilogue median {epi.median():.2f} max {epi.max():.2f}")
            hist = torch.histc(r[:, 1], bins=10, min=float(r[:, 1].min()), max=float(r[:, 1].max()))
            print("   loop ends, 10 bins from the first to the last:", hist.int().tolist())
    # Same SMs slow in every call? Correlation over SMs between calls (SMs that ran a block in both).
    m = torch.stack(per_sm)
    seen = ~m.isnan().any(0)
    z = m[:, seen]
    z = (z - z.mean(1, keepdim=True)) / z.std(1, keepdim=True)
    c = (z @ z.T) / (z.shape[1] - 1)
    off = c[~torch.eye(len(per_sm), dtype=torch.bool)]
    print(f"{len(per_sm)} calls, {int(seen.sum())} SMs: correlation of the SMs' loop ends between calls: "
          f"median {off.median():.2f}, min {off.min():.2f}, max {off.max():.2f}")
    mean = m[:, seen].mean(0)
    ids = seen.nonzero().flatten()
    slow = ids[torch.argsort(mean)].tolist()
    print("SMs from the fastest to the slowest (mean loop end over the calls):", slow)
    print("   their mean loop ends (us):", [round(v, 1) for v in mean[torch.argsort(mean)].tolist()])


if __name__ == "__main__":
    main()

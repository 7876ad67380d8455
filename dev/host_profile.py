"""Host time of a kforge training step of a zoo model: is the step host-bound?

    python3 dev/host_profile.py plain-llama [--size bench] [--autocast] [--backend kforge] [--batch 8 --seq 1024]
                                            [--cudagraphs] [--steps 10] [--profile 5]

Prints, per round of `--steps` steps, the host time to enqueue a step (perf_counter around the calls,
no synchronisation) beside the wall time once the GPU has caught up. Enqueue close to wall means the
host never gets ahead of the GPU: the step is bound by host time, not kernel time. Then the host time
of each phase of a step (forward call, backward call, optimizer step and zero_grad; no
synchronisation) and, in steps synchronised at their end as `bench models` times them, the GPU's
time per step (CUDA events) beside the host's. `--backend` is any of `bench models`' backends
(kforge, kforge+gemm, kforge+group, torch.compile, ...). Then a cProfile of
`--profile` steps, sorted by own time and by cumulative time (C functions called from Thunder's
generated traces, such as kforge's GeneratedKernel, count toward the trace function's own time).
"""
import argparse
import contextlib
import cProfile
import io
import pstats
import time

import torch

from kforge.bench.models import load_factory, wrap
from kforge.zoo import MODELS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--autocast", action="store_true", help="fp32 weights under torch.autocast(bf16)")
    ap.add_argument("--size", default="bench", help="the zoo size (GPT-2 models: 124M)")
    ap.add_argument("--backend", default="kforge", help="a `bench models` backend (default kforge)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", default=None, help="fp32 / bf16 weights (default: the factory's)")
    ap.add_argument("--cudagraphs", action="store_true", help="as bench models --cudagraphs")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", type=int, default=5, help="steps under cProfile (0: none)")
    args = ap.parse_args()
    extra = {"dtype": {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]} if args.dtype else {}
    model, inputs, opts = load_factory(MODELS[args.model])(size=args.size, batch=args.batch, seq=args.seq,
                                                          device="cuda", autocast=args.autocast, **extra)
    fn = wrap(args.backend, model, opts.get("mode", "jit"), cudagraphs=args.cudagraphs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ac = torch.autocast("cuda", dtype=opts["autocast"]) if opts.get("autocast") else contextlib.nullcontext()
    call = (lambda: fn(**inputs)) if isinstance(inputs, dict) else (lambda: fn(*inputs))
    mark = args.cudagraphs and args.backend == "torch.compile"
    phases = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}

    def step() -> None:
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        t0 = time.perf_counter()
        with ac:
            loss = opts["loss_fn"](call())
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        phases["forward"] += t1 - t0
        phases["backward"] += t2 - t1
        phases["optimizer"] += t3 - t2

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    for _ in range(2):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"{args.model}{' autocast' if args.autocast else ''} {args.backend}: enqueue {1e3 * (t1 - t0) / args.steps:.2f} "
              f"ms/step, wall {1e3 * (t2 - t0) / args.steps:.2f} ms/step")
    for k in phases:
        phases[k] = 0.0
    gpu, host = [], []
    for _ in range(args.steps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s.record()
        step()
        e.record()
        e.synchronize()
        host.append(1e3 * (time.perf_counter() - t0))
        gpu.append(s.elapsed_time(e))
    print(f"synchronised steps: CUDA events {sorted(gpu)[len(gpu) // 2]:.2f} ms/step (median), host wall "
          f"{sorted(host)[len(host) // 2]:.2f}; host per phase, ms/step: "
          + ", ".join(f"{k} {1e3 * v / args.steps:.2f}" for k, v in phases.items()))
    if args.backend.startswith("kforge"):  # did the plans take the calls, or did they fall back to ATen?
        from kforge.ops import gemm

        print("gemm:", gemm.stats())
    if args.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.profile):
            step()
        pr.disable()
        torch.cuda.synchronize()
        for key, n in (("tottime", 45), ("cumtime", 40)):
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats(key).print_stats(n)
            print(s.getvalue())


if __name__ == "__main__":
    main()

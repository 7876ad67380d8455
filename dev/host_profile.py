"""Host time of a kforge training step of a zoo model: is the step host-bound?

    python3 dev/host_profile.py plain-llama [--size bench] [--autocast] [--gemm] [--steps 10] [--profile 5]

Prints, per round of `--steps` steps, the host time to enqueue a step (perf_counter around the calls,
no synchronisation) beside the wall time once the GPU has caught up. Enqueue close to wall means the
host never gets ahead of the GPU: the step is bound by host time, not kernel time. Then a cProfile of
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
    ap.add_argument("--gemm", action="store_true", help="kforge.jit(gemm=True): GEMMs on kforge's cuBLASLt plans")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", type=int, default=5, help="steps under cProfile (0: none)")
    args = ap.parse_args()
    model, inputs, opts = load_factory(MODELS[args.model])(size=args.size, batch=8, seq=1024, device="cuda",
                                                          autocast=args.autocast)
    fn = wrap("kforge+gemm" if args.gemm else "kforge", model, opts.get("mode", "jit"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ac = torch.autocast("cuda", dtype=opts["autocast"]) if opts.get("autocast") else contextlib.nullcontext()
    call = (lambda: fn(**inputs)) if isinstance(inputs, dict) else (lambda: fn(*inputs))

    def step() -> None:
        with ac:
            loss = opts["loss_fn"](call())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

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
        print(f"{args.model}{' autocast' if args.autocast else ''}: enqueue {1e3 * (t1 - t0) / args.steps:.2f} "
              f"ms/step, wall {1e3 * (t2 - t0) / args.steps:.2f} ms/step")
    if args.gemm:  # did the plans take the calls, or did they fall back to ATen?
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

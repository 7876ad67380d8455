"""Build notebooks/gpt2_llmc_kernels.ipynb from the cells below (the notebook is generated, not edited).

    python notebooks/build_notebook.py             # write the notebook, outputs empty
    python notebooks/build_notebook.py --execute   # write it, then run it (GPU) and save the outputs

The journey: a PyTorch GPT-2 prototype -> thunder.jit with Thunder's default executors -> the same with
kforge first -> inspect the traces and the claimed symbols -> tie-out -> benchmark against eager and
torch.compile (chart) -> profile table -> a short Llama section. Sizes are small so that it runs in a
couple of minutes on an H100 / H200. Executing needs nbclient and ipykernel.
"""
from __future__ import annotations

import argparse
import os
import sys

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))
PATH = os.path.join(HERE, "gpt2_llmc_kernels.ipynb")

CELLS: list[tuple[str, str]] = [
    ("md", """\
# GPT-2 on llm.c-style kernels: kforge + Lightning Thunder

[kforge](../README.md) compiles llm.c-style CUDA kernels with NVRTC at run time and serves them to
Lightning Thunder as an executor. This notebook follows one model from a plain PyTorch prototype to a
compiled training step whose layernorm, GELU, attention softmax / permutes and cross-entropy run on
kforge's own forward and backward kernels, and checks at each stage what ran and whether the numbers
still match eager PyTorch.

It needs a CUDA GPU (sm_80 or newer) and takes a couple of minutes on an H100 / H200. The same steps
are available from the shell: `python -m kforge demo | inspect | tieout | profile | bench`."""),
    ("code", """\
import inspect as pyinspect
import time

import matplotlib.pyplot as plt
import thunder
import torch
from tabulate import tabulate

import kforge

assert torch.cuda.is_available(), "this notebook runs kforge's kernels: it needs a CUDA GPU"
print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | thunder {thunder.__version__} | kforge {kforge.__version__}")

# Every kernel, compiled by NVRTC for this GPU's architecture (0 ms: loaded from the disk cache).
compile_ms = kforge.compile_all()
print(tabulate(sorted(compile_ms.items()), headers=["kernel source", "NVRTC ms"], floatfmt=".0f"))"""),
    ("md", """\
## 1. The PyTorch prototype

`kforge.models.gpt2.GPT` is laid out like llm.c's `train_gpt2.py`: tied embeddings, pre-norm blocks,
a GELU-tanh MLP and, in the "manual" attention variant, attention written out as
`split_qkv -> q @ k^T -> causal_softmax -> @ v -> merge_heads`. Those three helpers are plain PyTorch
functions; kforge registers Thunder operators that replace them. Weights are random (llm.c's
initialisation, seeded); nothing is downloaded."""),
    ("code", """\
from kforge.models.gpt2 import GPT, CausalSelfAttention, GPTConfig, random_batch

cfg = GPTConfig(block_size=256, n_layer=4, n_head=12, n_embd=768)  # GPT-2 124M widths, 4 layers
B, T = 8, 256
idx, targets = random_batch(cfg, B, T, device="cuda")


def make_model(dtype=torch.float32):
    return GPT(cfg, seed=0).to(device="cuda", dtype=dtype)


model = make_model()
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, B={B}, T={T}")
print(pyinspect.getsource(CausalSelfAttention.forward))
logits, loss = model(idx, targets)
print(f"eager loss {loss.item():.4f} (ln(vocab) = {torch.log(torch.tensor(50257.0)).item():.4f} at init)")"""),
    ("md", """\
## 2. `thunder.jit` with Thunder's default executors

Thunder traces the model into a program of torch-level symbols, differentiates it and hands each
symbol to the first executor in its list that accepts it."""),
    ("code", """\
print("default executors:", [ex.name for ex in thunder.get_default_executors()],
      "+ always:", [ex.name for ex in thunder.get_always_executors()])
jit_default = thunder.jit(make_model())
t0 = time.perf_counter()
_, loss_default = jit_default(idx, targets)
loss_default.backward()
torch.cuda.synchronize()
print(f"first call (trace, transform, compile, run): {time.perf_counter() - t0:.1f} s; loss {loss_default.item():.4f}")"""),
    ("md", """\
## 3. The same with kforge first

`kforge.executor` goes in front of Thunder's defaults. For each symbol it claims (layer_norm, gelu
with approximate="tanh", softmax over the last dim, cross_entropy, and the three attention helpers) a
checker decides whether the kernel supports the call; whatever it declines falls through to the next
executor, so nothing unsupported is computed by kforge."""),
    ("code", """\
executors = [kforge.executor, *thunder.get_default_executors()]
jit_kforge = thunder.jit(make_model(), executors=executors)
t0 = time.perf_counter()
_, loss_kforge = jit_kforge(idx, targets)
loss_kforge.backward()
torch.cuda.synchronize()
print(f"first call: {time.perf_counter() - t0:.1f} s; loss {loss_kforge.item():.4f} (eager {loss.item():.4f})")"""),
    ("md", """\
## 4. Inspect: what kforge claimed, what it declined and why

`kforge.inspect.inspect` counts the kforge symbols in the final forward and backward traces
(`thunder.last_traces`, `thunder.last_backward_traces`), lists what kforge's checkers accepted, and
every op they declined with the reason."""),
    ("code", """\
from kforge.inspect import inspect

report = inspect(jit_kforge)
print(report)"""),
    ("code", """\
# The final forward trace calls the kernels' launchers by name; a few lines of it:
forward_src = str(report.forward_traces[0]).splitlines()
print("\\n".join([line for line in forward_src if "= kforge_" in line][:10]))"""),
    ("code", """\
# Declines in action: float64 is not something these kernels support, so every claim falls back.
micro = GPTConfig.preset("micro")
jit_fp64 = thunder.jit(GPT(micro).to(device="cuda", dtype=torch.float64), executors=executors)
jit_fp64(*random_batch(micro, 2, 16, device="cuda"))[1].backward()
print(inspect(jit_fp64).declines_table())"""),
    ("md", """\
## 5. Tie-out against eager

`kforge.tieout.tieout` runs an eager copy and a compiled copy of the model with identical weights on
the same batch, backpropagates the same loss through both and compares the outputs, the loss and
every parameter gradient (max abs and relative error against a tolerance per dtype; TF32 is off on
both sides for fp32). `python -m kforge tieout` does the same and exits non-zero on a failure."""),
    ("code", """\
from kforge.tieout import tieout

tie = tieout(make_model(), (idx, targets))
print(tie.summary())
worst = sorted(tie.rows, key=lambda r: r.rel / r.tol if r.tol else 0.0, reverse=True)[:8]
print(tabulate([(r.name, f"{r.rel:.2e}", f"{r.tol:.0e}", f"{r.max_abs:.2e}", "ok" if r.ok else "FAIL") for r in worst],
               headers=["tensor (8 closest to their bound)", "rel err", "rel tol", "max abs", ""]))"""),
    ("md", """\
## 6. Benchmark: a training step against eager and torch.compile

bf16 weights, forward + backward + fused AdamW, median of 10 steps after warm-up (which includes each
backend's compilation)."""),
    ("code", """\
from tqdm import tqdm

from kforge.bench.harness import train_step_timing

backends = {
    "eager": lambda m: m,
    "torch.compile": torch.compile,
    "thunder": thunder.jit,
    "thunder + kforge": lambda m: thunder.jit(m, executors=executors),
}
results, compiled_models = [], {}
for name, wrap in tqdm(backends.items(), desc="backends"):
    m = make_model(torch.bfloat16)
    fn = wrap(m)
    r = train_step_timing(fn, list(m.parameters()), (idx, targets), steps=10)
    results.append((name, r["ms"], r["peak_gib"], r["final_loss"]))
    compiled_models[name] = (m, fn)
eager_ms = results[0][1]
print(tabulate([(n, f"{ms:.2f}", f"{eager_ms / ms:.2f}x", f"{gib:.2f}", f"{l:.3f}") for n, ms, gib, l in results],
               headers=["backend", "ms/step", "vs eager", "peak GiB", "loss"]))"""),
    ("code", """\
fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 3.5))
names = [r[0] for r in results]
colors = ["#999999", "#4c72b0", "#dd8452", "#55a868"]
ax_t.bar(names, [r[1] for r in results], color=colors)
ax_t.set_ylabel("ms / training step")
ax_t.set_title(f"GPT-2 {cfg.n_layer} layers x {cfg.n_embd}, B={B}, T={T}, bf16")
ax_m.bar(names, [r[2] for r in results], color=colors)
ax_m.set_ylabel("peak memory (GiB)")
for ax in (ax_t, ax_m):
    ax.tick_params(axis="x", rotation=20)
fig.tight_layout()
plt.show()"""),
    ("md", """\
## 7. Profile: where the step's time goes

`kforge.profile.profile` runs the step under the PyTorch profiler with an NVTX / `record_function`
range around every kforge launch ("kforge.layernorm.forward", ...) and sorts the kernels into
kforge, matmul, attention and the rest, per region (forward, backward, optimizer) and per op."""),
    ("code", """\
from kforge.profile import profile

m, fn = compiled_models["thunder + kforge"]
opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)


def step():
    fn(idx, targets)[1].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


prof = profile(step, steps=3)
print(prof.summary())
print()
print(prof.table(top=15))"""),
    ("md", """\
## 8. Llama

The reference Llama (`kforge.models.llama.Llama`: RMSNorm, RoPE, grouped-query attention, SwiGLU)
goes through `thunder.jit` the same way. An unmodified Hugging Face `LlamaForCausalLM` cannot be traced
by `thunder.jit` (transformers 5.x), so it takes Thunder's Dynamo path,
`kforge.transforms.thunderfx(model)`, where a trace transform recognises the decomposed RMSNorm, RoPE,
SwiGLU and `repeat_kv` patterns and hands them to kforge (checked with lightning-thunder 0.2.6,
torch 2.11, transformers 5.17)."""),
    ("code", """\
from kforge.models import llama

lcfg = llama.LlamaConfig.preset("tiny")
lidx, ltargets = llama.random_batch(lcfg, 4, 128, device="cuda")
jit_llama = thunder.jit(llama.Llama(lcfg).cuda(), executors=executors)
jit_llama(lidx, ltargets)[1].backward()
print(inspect(jit_llama).symbols_table())
print(tieout(llama.Llama(lcfg).cuda(), (lidx, ltargets)).summary())"""),
    ("code", """\
import kforge.transforms

torch._dynamo.reset()
hf = llama.hf_llama("hf-test", device="cuda")
hf_compiled = kforge.transforms.thunderfx(hf)
out = hf_compiled(input_ids=lidx, labels=lidx)
out.loss.backward()
print(inspect(hf_compiled))"""),
    ("md", """\
## From the shell

```bash
python -m kforge demo                                  # compile, tie-out, claimed symbols, ms/step
python -m kforge inspect gpt2 --size tiny --show-traces
python -m kforge tieout llama --dtype bf16             # exit status 1 if anything is out of tolerance
python -m kforge profile gpt2 --size 124M --batch 8 --seq 1024 --dtype bf16
python -m kforge bench ops --plot plots/               # GB/s per kernel vs eager / torch.compile
```"""),
]


def build() -> nbformat.NotebookNode:
    """The notebook, outputs empty; cell ids are fixed so rebuilding gives the same file."""
    cells = []
    for i, (kind, src) in enumerate(CELLS):
        cell = new_markdown_cell(src) if kind == "md" else new_code_cell(src)
        cell["id"] = f"cell-{i:02d}"
        cells.append(cell)
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 900, cwd: str = HERE) -> nbformat.NotebookNode:
    """Run every cell headless (nbclient + ipykernel); raises on the first cell error."""
    from nbclient import NotebookClient

    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": cwd}}).execute()
    return nb


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--execute", action="store_true", help="run the notebook and save it with its outputs")
    p.add_argument("--out", default=PATH, help=f"where to write it (default {PATH})")
    args = p.parse_args(argv)
    nb = build()
    nbformat.validate(nb)
    if args.execute:
        nb = execute(nb)
    nbformat.write(nb, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

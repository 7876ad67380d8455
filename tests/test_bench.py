"""python -m kforge.bench: the command line, the record, BENCHMARKS.md generated from it, the one-time
importer of the hand-kept tables, and `bench models` (users' models, factories, set-ups, backends).

CPU: argument parsing and help texts, usage lines under both spellings, the record's round trip, the
importer (a sample of the old format, and the committed record against the file it was imported
from), the latest-run-per-table rule, the derived targets, charts, BENCHMARKS.md up to date with the
record, factories and their errors, presets, a --dry run of every zoo model on the CPU (a failing
backend leaves its error and the run goes on), the second process's plumbing. GPU: a short
`bench models` run with timings and the second process.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kforge
from conftest import gpu
from kforge.bench import legacy, models, records, report
from kforge.bench.__main__ import SUBCOMMANDS, main, parser

PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kforge.__file__)))
REPO = os.path.dirname(PKG_ROOT)
RECORD = os.path.join(REPO, "benchmarks", "records.jsonl")


def run_module(*args: str, module: str = "kforge.bench", gpu_visible: bool = True, extra_path: str | None = None,
               timeout: int = 900):
    """`python -m MODULE ARGS` in a fresh process; returns (exit status, stdout, stderr)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, PKG_ROOT, env.get("PYTHONPATH")) if p)
    if not gpu_visible:
        env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, "-m", *module.split(), *args], capture_output=True, text=True, env=env,
                       timeout=timeout)
    return r.returncode, r.stdout, r.stderr


FACTORIES = textwrap.dedent('''
    import torch
    import torch.nn.functional as F

    class Net(torch.nn.Module):
        def __init__(self, vocab=29, dim=16):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, dim)
            self.norm = torch.nn.LayerNorm(dim)
            self.out = torch.nn.Linear(dim, vocab)

        def forward(self, idx, targets):
            logits = self.out(F.gelu(self.norm(self.emb(idx))))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def make(batch=2, seq=8, seed=0):
        # no device / dtype: the bench moves and casts
        torch.manual_seed(seed)
        idx = torch.randint(0, 29, (batch, seq))
        return Net(), (idx, idx)

    def make_all(**kw):
        # takes everything: sees size, autocast, dtype, device
        torch.manual_seed(0)
        seen.append(kw)
        net = Net().to(device=kw["device"], dtype=torch.float32 if kw["autocast"] else kw["dtype"])
        idx = torch.randint(0, 29, (kw["batch"], kw["seq"]), device=kw["device"])
        return net, {"idx": idx, "targets": idx}, {"loss_fn": lambda out: out * 1.0,
                                                    "autocast": kw["dtype"] if kw["autocast"] else None}

    seen = []

    def bad_options():
        return Net(), (torch.zeros(1, 2, dtype=torch.long),) * 2, {"colour": "red"}

    def not_a_model():
        return 42, ()

    def bad_mode():
        return Net(), (torch.zeros(1, 2, dtype=torch.long),) * 2, {"mode": "fast"}

    not_callable = 3
''')


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "kf_bench_models.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("kf_bench_models", None)
    yield str(tmp_path)
    sys.modules.pop("kf_bench_models", None)


# ---- command line --------------------------------------------------------------------------------
def _all_parsers(p: argparse.ArgumentParser):
    yield p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sp in a.choices.values():
                yield from _all_parsers(sp)


def test_every_option_has_help_text():
    for p in _all_parsers(parser("python -m kforge.bench")):
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert a.help and a.help != argparse.SUPPRESS, (p.prog, a.option_strings or a.dest)


def test_without_subcommand_lists_them_under_both_spellings():
    for module, prog in (("kforge.bench", "python -m kforge.bench"), ("kforge bench", "python -m kforge bench")):
        rc, out, err = run_module(module=module)
        assert rc == 2, (module, out, err)
        assert f"usage: {prog} " in err and "name a subcommand" in err
        for s in SUBCOMMANDS:
            assert s in err


def test_help_names_the_module_and_every_subcommand():
    rc, out, _ = run_module("--help", module="kforge bench")
    assert rc == 0 and out.startswith("usage: python -m kforge bench")
    assert "python -m kforge.bench" in out
    for s in SUBCOMMANDS:
        assert s in out
    rc, out, _ = run_module("models", "--help")
    assert rc == 0 and out.startswith("usage: python -m kforge.bench models")
    for opt in ("--model", "--setup", "--backends", "--second-process", "--preset", "--cudagraphs", "--dry", "--record"):
        assert opt in out


def test_main_prog_argument_and_errors(capsys):
    assert main([], prog="python -m kforge bench") == 2
    assert "python -m kforge bench: error: name a subcommand" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["models", "--setup", "nope"])
    assert e.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_measuring_needs_a_gpu(capsys):
    for argv in (["models", "nanogpt"], ["ops", "--quick"], ["launch"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "needs a CUDA GPU" in err
    assert main(["models"]) == 2
    assert "--dry checks the wiring" in capsys.readouterr().err
    assert main(["models", "--backends", "eager,jax"]) == 2  # usage errors come first
    assert "unknown backend 'jax'" in capsys.readouterr().err
    assert main(["models", "--model", "no_such_module_xyz:make"]) == 2
    assert "cannot import" in capsys.readouterr().err


def test_progress_bars_only_on_a_terminal():
    from kforge.bench.harness import progress_enabled

    assert progress_enabled() == sys.stderr.isatty()


# ---- the record ----------------------------------------------------------------------------------
def test_record_round_trip_and_errors(tmp_path):
    path = str(tmp_path / "sub" / "records.jsonl")
    header = records.run_header("python -m kforge.bench launch", device="cpu")
    for key in ("schema", "device", "gpu", "torch", "thunder", "kforge", "python", "commit", "date", "command"):
        assert key in header
    assert header["thunder"] and header["kforge"] == kforge.__version__
    records.append(path, {**header, "kind": "launch", "rows": [{"launcher": "x", "host_us_per_launch": 1.5}]})
    records.append(path, {**header, "kind": "launch", "rows": [], "dtype": torch.bfloat16})
    runs = records.load(path)
    assert [r["rows"] for r in runs] == [[{"launcher": "x", "host_us_per_launch": 1.5}], []]
    assert runs[1]["dtype"] == "torch.bfloat16"
    assert records.load(str(tmp_path / "missing.jsonl")) == []
    with open(path, "a") as f:
        f.write("\n{not json\n")
    with pytest.raises(ValueError, match=r"records.jsonl:4: not JSON"):
        records.load(path)


def test_commit_from_environment(monkeypatch):
    monkeypatch.setenv("KFORGE_COMMIT", "abc1234")
    assert records.git_commit() == "abc1234"


def test_commit_of_a_tree_that_differs_from_its_git_is_marked_dirty(tmp_path, monkeypatch):
    """A tree copied over an older .git (or with uncommitted code edits) is not the commit git names:
    the record says so; documentation edits and untracked files do not count."""
    import subprocess

    monkeypatch.delenv("KFORGE_COMMIT", raising=False)
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=tmp_path,  # noqa: E731
                                    check=True, capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    (tmp_path / "python").mkdir()
    (tmp_path / "python" / "m.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("r\n")
    git("add", ".")
    git("commit", "-q", "-m", "c")
    sha = git("rev-parse", "--short", "HEAD")
    assert records.git_commit(str(tmp_path / "python")) == sha
    (tmp_path / "README.md").write_text("edited\n")
    (tmp_path / "python" / "new.py").write_text("")
    assert records.git_commit(str(tmp_path / "python")) == sha
    (tmp_path / "python" / "m.py").write_text("x = 2\n")
    assert records.git_commit(str(tmp_path / "python")) == sha + "+dirty"


# ---- importer ------------------------------------------------------------------------------------
LEGACY = textwrap.dedent('''\
    # Benchmarks

    ## Where the targets stand

    | target (issue) | result |
    |---|---|
    | x | met |

    ### `python -m kforge.bench gpt2 --markdown /root/out/gpt2.md`

    NVIDIA H200 · torch 2.11.0+cu130 · Python 3.12.3 · 2026-11-22 · kforge fa97873

    | model   | attention   | backend        | B x T   | dtype   |   ms/step |   peak GiB |   warm-up s |   loss | error   |
    |---------|-------------|----------------|---------|---------|-----------|------------|-------------|--------|---------|
    | gpt2    | sdpa        | eager          | 8x1024  | bf16    |     32.1  |       5.36 |           0 |  8.562 |         |
    | gpt2    | sdpa        | thunder        | 8x1024  | bf16    |           |            |             |        | RuntimeError: boom |

    An older run, kept for the record:

    | model   | attention   | backend        | B x T   | dtype   |   ms/step |   peak GiB |   warm-up s |   loss | error   |
    |---------|-------------|----------------|---------|---------|-----------|------------|-------------|--------|---------|
    | gpt2    | sdpa        | eager          | 8x1024  | bf16    |     99.9  |       5.36 |           0 |  8.562 |         |

    ### `python -m kforge.bench ops --op colsum --quick`

    NVIDIA H100 80GB HBM3 · torch 2.11.0+cu130 · Python 3.12.3 · 2026-11-22 · kforge 8c88da8

    Measured device-to-device copy bandwidth: **4214 GB/s** (read + write). `% copy`: ...

    | op       | dir   | shape            | dtype   |   kforge µs |   kforge GB/s |   % copy |   same-size copy µs |   % same-size copy |   eager µs |   eager GB/s | compile µs   | compile GB/s   |
    |----------|-------|------------------|---------|-------------|---------------|----------|---------------------|--------------------|------------|--------------|--------------|----------------|
    | colsum   | fwd   | 8x1024x768       | fp32    |        10.1 |          2489 |       59 |                11.1 |                109 |       19.4 |         1299 | —            | —              |

    ### `python -m kforge.bench launch --markdown /root/out/launch.md`

    NVIDIA H200 · torch 2.11.0+cu130 · Python 3.12.3 · 2026-11-22 · kforge 8c88da8

    | launcher       |   host µs / launch |
    |----------------|--------------------|
    | kforge._C.axpy |               4.63 |

    ### The A/B runs (not a bench table)

    ### `python -m kforge.bench gpt2 --markdown /root/out/gpt2.md`

    NVIDIA H200 · torch 2.11.0+cu130 · Python 3.12.3 · 2026-11-21 · kforge 0000000

    | model   | attention   | backend        | B x T   | dtype   |   ms/step |   peak GiB |   warm-up s |   loss | error   |
    |---------|-------------|----------------|---------|---------|-----------|------------|-------------|--------|---------|
    | gpt2    | sdpa        | eager          | 8x1024  | bf16    |     77.7  |       5.36 |           0 |  8.562 |         |
''')


def test_importer_reads_the_newest_table_of_each_command():
    runs = legacy.parse(LEGACY, from_commit="a10325a")
    assert [(r["kind"], r["commit"]) for r in runs] == [("model", "fa97873"), ("ops", "8c88da8"), ("launch", "8c88da8")]
    gpt2, ops, launch = runs
    assert gpt2["gpu"] == "NVIDIA H200" and gpt2["torch"] == "2.11.0+cu130" and gpt2["date"] == "2026-11-22"
    assert gpt2["python"] == "3.12.3" and gpt2["thunder"] is None and gpt2["imported"]["from_commit"] == "a10325a"
    assert gpt2["rows"][0] == dict(model="gpt2", attention="sdpa", backend="eager", batch=8, seq=1024, dtype="bf16",
                                   ms=32.1, peak_gib=5.36, warmup_s=0.0, final_loss=8.562)
    assert gpt2["rows"][1]["ms"] is None and gpt2["rows"][1]["error"] == "RuntimeError: boom"
    assert len(gpt2["rows"]) == 2  # the older table under the same heading is prose, not imported
    assert ops["gpu"] == "NVIDIA H100 80GB HBM3" and ops["copy_gbs"] == 4214.0
    assert ops["rows"][0]["kforge_us"] == 10.1 and ops["rows"][0]["compile_us"] is None
    assert ops["rows"][0]["kforge_pct_copy"] == 59.0
    assert launch["rows"] == [{"launcher": "kforge._C.axpy", "host_us_per_launch": 4.63}]
    assert legacy.already_imported(runs, runs[1]) and not legacy.already_imported([], runs[1])


def test_importer_rejects_a_table_it_cannot_read():
    bad = LEGACY.replace("|   host µs / launch |", "|   something else   |")
    with pytest.raises(legacy.LegacyFormatError, match="unknown columns"):
        legacy.parse(bad)


def test_import_md_command_appends_once(tmp_path, capsys):
    src = tmp_path / "BENCHMARKS.md"
    src.write_text(LEGACY)
    rec = str(tmp_path / "records.jsonl")
    assert main(["import-md", str(src), "--record", rec, "--from-commit", "a10325a", "--dry-run"]) == 0
    assert not os.path.exists(rec)
    assert main(["import-md", str(src), "--record", rec, "--from-commit", "a10325a"]) == 0
    assert len(records.load(rec)) == 3
    assert main(["import-md", str(src), "--record", rec, "--from-commit", "a10325a"]) == 0
    assert len(records.load(rec)) == 3 and "3 tables already in" in capsys.readouterr().out
    src.write_text("# Benchmarks\n\n### layernorm\n\n| a |\n|---|\n| 1 |\n")
    assert main(["import-md", str(src), "--record", rec]) == 2


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def test_committed_record_holds_the_hand_kept_tables_unchanged():
    imported = [r for r in records.load(RECORD) if r.get("imported")]
    assert len(imported) == 7
    src_commit = imported[0]["imported"]["from_commit"]
    text = _git("show", f"{src_commit}:BENCHMARKS.md")
    if text is None:
        pytest.skip("no git history here to read the hand-kept BENCHMARKS.md from")
    parsed = legacy.parse(text, from_commit=src_commit)
    key = lambda r: r["command"]  # noqa: E731
    assert sorted(imported, key=key) == sorted(parsed, key=key)


# ---- report --------------------------------------------------------------------------------------
def _run(kind: str, rows: list[dict], gpu: str = "NVIDIA H200", commit: str = "c0", **kw) -> dict:
    return {"schema": 1, "kind": kind, "device": "cuda", "gpu": gpu, "torch": "2.11.0", "thunder": "0.2.6",
            "commit": commit, "date": "2026-11-25", "command": f"python -m kforge.bench {kind}", "rows": rows, **kw}


def _op(op: str, us: float, pct: float, d: str = "fwd") -> dict:
    return dict(op=op, dir=d, shape="8192x768", dtype="bf16", kforge_us=us, kforge_gbs=1000.0, kforge_pct_copy=pct)


def test_latest_run_per_table_and_gpu():
    runs = [_run("ops", [_op("layernorm", 10.0, 90), _op("gelu", 20.0, 95)], commit="old", copy_gbs=4000.0),
            _run("ops", [_op("layernorm", 9.0, 70)], commit="new", copy_gbs=4100.0),
            _run("ops", [_op("layernorm", 12.0, 85)], gpu="NVIDIA H100", commit="h100"),
            {**_run("ops", [_op("gelu", 1.0, 99)], commit="dry"), "device": "cpu"},
            {**_run("ops", [_op("gelu", 1.0, 99)], commit="dry2"), "dry": True},
            {**_run("ops", [_op("layernorm", 1.0, 99)], commit="busy"), "contended": "other work on the host"}]
    tables = {(t.key[1], t.key[2]): t for t in report.current_tables(runs)}
    assert tables[("layernorm", "NVIDIA H200")].run["commit"] == "new"
    assert tables[("gelu", "NVIDIA H200")].run["commit"] == "old"
    assert tables[("layernorm", "NVIDIA H100")].run["commit"] == "h100"
    assert len(tables) == 3
    status, figures = report._ops_pct(None, 80)(list(tables.values()))
    assert status == "**not met**" and "2 of 3" in figures and "layernorm fwd bf16 8192x768 70 %" in figures


def test_fusion_targets_read_the_generated_kernel_and_large_regions():
    """Issue 17's targets: the generated kernel's launch row (not axpy's), and fusion rows that move
    at least 200 MB (model-size rows and other ops are left out)."""
    launch = _run("launch", [dict(launcher="kforge._C.axpy", host_us_per_launch=4.0),
                             dict(launcher="torch.add", host_us_per_launch=7.0),
                             dict(launcher="kforge.fusion GeneratedKernel (a + b)", host_us_per_launch=5.4),
                             dict(launcher="torch.add", host_us_per_launch=6.1)])
    status, figures = report._fusion_launch_target(report.current_tables([launch]))
    assert status == "**not met**" and figures.startswith("5.40 µs (torch.add 6.10)"), figures
    big = dict(_op("fusion.rope", 70.0, 90), bytes=268_000_000)
    small = dict(_op("fusion.rope", 7.0, 60), shape="8x12x1024x64", bytes=25_000_000)
    red = dict(_op("fusion.bias_grad", 60.0, 84, d="reduce"), shape="32768x4096", bytes=268_000_000)
    other = dict(_op("layernorm", 9.0, 50), bytes=900_000_000)
    tables = report.current_tables([_run("ops", [big, small, red, other])])
    status, figures = report._ops_pct(None, 85, prefix="fusion.", min_bytes=200_000_000)(tables)
    assert status == "**not met**" and "1 of 2" in figures and "fusion.bias_grad reduce" in figures, figures


def _users_run(k_ms: float, c_ms: float, e_ms: float, *, cudagraphs: bool = False) -> dict:
    def row(backend, ms, peak, first, **kw):
        return dict(model="nanogpt", size="124M", setup="bf16", backend=backend, batch=8, seq=1024, ms=ms,
                    peak_gib=peak, first_s=first, final_loss=10.9, cudagraphs=cudagraphs and backend != "eager", **kw)
    rows = [row("eager", e_ms, 6.0, 1.0), row("torch.compile", c_ms, 5.0, 40.0, first_s_2nd=9.0),
            row("thunder", None, None, None, error="RuntimeError: query and dout must have the same dtype"),
            row("kforge", k_ms, 5.2, 30.0, nvrtc_compiles=40, first_s_2nd=8.0, nvrtc_compiles_2nd=0, path="jit")]
    return _run("models", rows)


def test_a_later_run_without_a_second_process_keeps_the_warm_start_figure(tmp_path):
    """The speed tables take the newest run; the warm-start target and its table keep the newest run
    that started a second process, with that run's commit, until a newer one does."""
    warm = _users_run(17.0, 19.0, 40.0)
    warm["commit"] = "w1"
    plain = _users_run(16.0, 19.0, 40.0)
    plain["commit"] = "p2"
    for r in plain["rows"]:
        for k in ("first_s_2nd", "nvrtc_compiles_2nd"):
            r.pop(k, None)
    tables = report.current_tables([warm, plain])
    target = next(t for t in report.TARGETS if "warm from the disk cache" in t.text)
    status, figures = target.check(tables)
    assert status == "met" and "nanogpt bf16 8x1024: 8.0 s, 0 NVRTC compiles" in figures and "kforge w1" in figures, figures
    assert [t.run["commit"] for t in report._tables(tables, "models")] == ["p2"]
    text, _ = report.render([warm, plain], doc_path=str(tmp_path / "B.md"))
    section = text.split("A second process's first step")[1].split("\n## ")[0]
    assert "kforge w1" in section and "| kforge " in section and "8.0" in section, section
    # once the newest run has its own second process, the separate table goes and the target follows it
    newer = _users_run(15.0, 19.0, 40.0)
    newer["commit"] = "n3"
    for r in newer["rows"]:
        if r["backend"] == "kforge":
            r["nvrtc_compiles_2nd"] = 3
    tables = report.current_tables([warm, plain, newer])
    status, figures = target.check(tables)
    assert status == "**not met**" and "3 NVRTC compiles" in figures and "kforge n3" in figures, figures
    assert "A second process's first step" not in report.render([warm, plain, newer],
                                                                 doc_path=str(tmp_path / "B.md"))[0]


def test_users_model_targets_and_table():
    tables = report.current_tables([_users_run(17.0, 19.0, 40.0)])
    rows = {t.text: t.check(tables) for t in report.TARGETS}
    assert rows["users' models: thunder + kforge ≤ 0.9× torch.compile ms/step (issue 18)"] == ("met", "nanogpt bf16: 0.89× (H200)")
    assert rows["users' models: thunder + kforge never slower than eager (issue 18)"][0] == "met"
    assert rows["users' models: peak memory ≤ 1.1× torch.compile's (issue 18)"][0] == "met"
    assert rows["users' models: first step (trace + compile) ≤ torch.compile's (issue 18)"][0] == "met"
    warm = rows["users' models: a second process starts warm from the disk cache (issue 18)"]
    assert warm[0] == "met" and "0 NVRTC compiles" in warm[1]
    # a second process that traced again (no Thunder program restored) is not warm
    traced = _users_run(17.0, 19.0, 40.0)
    for r in traced["rows"]:
        if r["backend"] == "kforge":
            r["traces_restored_2nd"] = 0
    warm_target = next(t for t in report.TARGETS if "warm from the disk cache" in t.text)
    status, figures = warm_target.check(report.current_tables([traced]))
    assert status == "**not met**" and "0 Thunder programs restored" in figures, figures
    # ... nor one that restored a program and traced anyway (its prologue rejected the inputs)
    for r in traced["rows"]:
        if r["backend"] == "kforge":
            r["traces_restored_2nd"], r["traced_2nd"] = 1, 1
    status, figures = warm_target.check(report.current_tables([traced]))
    assert status == "**not met**" and "1 traced" in figures, figures
    assert rows["launch overhead < 10 µs host time per launch"] == ("no run", "")
    slow = report.current_tables([_users_run(18.5, 19.0, 40.0)])
    assert report.TARGETS[0].check(slow)[0] == "**not met**"
    md = report.models_table(tables[0].rows)
    assert "0.89" in md and "query and dout" in md and "| jit " in md
    # set-ups measured by separate runs add up to one table, each set-up from its latest run
    auto = _users_run(20.0, 21.0, 45.0)
    for r in auto["rows"]:
        r["setup"] = "autocast"
    auto["commit"] = "c1"
    merged = report._tables(report.current_tables([_users_run(99.0, 19.0, 40.0), _users_run(17.0, 19.0, 40.0),
                                                   auto]), "models")
    assert len(merged) == 1 and [r["setup"] for r in merged[0].rows] == ["bf16"] * 4 + ["autocast"] * 4
    assert merged[0].run["commit"] == "c1" and len(merged[0].runs) == 2 and merged[0].rows[3]["ms"] == 17.0
    block = "\n".join(report._table_block(merged[0], "### t", "body", None, "."))
    assert "- bf16 weights: NVIDIA H200" in block and "- fp32 weights + bf16 autocast: NVIDIA H200" in block
    assert "kforge c1" in block and "kforge c0" in block
    graphs = report._tables(report.current_tables([_users_run(1.0, 1.2, 3.0, cudagraphs=True)]), "models")
    small = [t for t in report.TARGETS if t.text.startswith("small batch")][0]
    assert small.check(graphs)[0] == "met" and report.TARGETS[0].check(graphs) == ("no run", "")
    assert "kforge + CUDAGraphTransform" in report.models_table(graphs[0].rows)


def test_run_of_several_models_compares_each_with_its_own_baselines():
    """A run timing two models prints one table: each row's × compile / × eager is over its own
    model's torch.compile and eager rows, never the other model's."""
    first, second = _users_run(17.0, 19.0, 40.0), _users_run(30.0, 20.0, 50.0)
    for r in second["rows"]:
        r["model"] = "hf-gpt2"
    md = report.run_markdown(_run("models", first["rows"] + second["rows"]))
    rows = {(c[1].strip(), c[3].strip()): c for c in (l.split("|") for l in md.splitlines() if l.startswith("| "))}
    assert rows[("nanogpt", "kforge")][8].strip() == "0.89" and rows[("nanogpt", "kforge")][9].strip() == "0.42"
    assert rows[("hf-gpt2", "kforge")][8].strip() == "1.50" and rows[("hf-gpt2", "kforge")][9].strip() == "0.60"
    assert rows[("hf-gpt2", "eager")][9].strip() == "1.00"


def test_render_writes_charts_and_links_them(tmp_path):
    runs = [_users_run(17.0, 19.0, 40.0), _run("ops", [_op("layernorm", 9.0, 70), _op("layernorm", 9.0, 70, "bwd")],
                                                copy_gbs=4100.0)]
    (tmp_path / "docs" / "experiments").mkdir(parents=True)
    (tmp_path / "docs" / "experiments" / "layernorm.md").write_text("# layernorm notes\n")
    text, plots = report.render(runs, doc_path=str(tmp_path / "BENCHMARKS.md"), plots_dir=str(tmp_path / "docs" / "plots"),
                                exp_dir=str(tmp_path / "docs" / "experiments"),
                                record_path=str(tmp_path / "benchmarks" / "records.jsonl"))
    names = sorted(os.path.basename(p) for p in plots)
    assert names == ["layernorm_bwd_bf16.png", "layernorm_fwd_bf16.png", "step_nanogpt_124M_8x1024.png"]
    assert all(os.path.getsize(p) > 1000 for p in plots)
    assert "](docs/plots/step_nanogpt_124M_8x1024.png)" in text and "](docs/plots/layernorm_bwd_bf16.png)" in text
    assert "[layernorm](docs/experiments/layernorm.md): layernorm notes" in text
    assert "[benchmarks/records.jsonl](benchmarks/records.jsonl)" in text
    # the same record gives the same text, with or without charts
    again, _ = report.render(runs, doc_path=str(tmp_path / "BENCHMARKS.md"), exp_dir=str(tmp_path / "docs" / "experiments"),
                             record_path=str(tmp_path / "benchmarks" / "records.jsonl"))
    assert again == text


def test_run_markdown_of_every_kind():
    for run in (_users_run(1.0, 2.0, 3.0), _run("ops", [_op("gelu", 1.0, 90)], copy_gbs=None),
                _run("launch", [{"launcher": "torch.add", "host_us_per_launch": 7.0}]),
                _run("model", [dict(model="gpt2", attention="sdpa", backend="eager", batch=8, seq=1024, dtype="bf16",
                                    ms=30.0, peak_gib=5.0, warmup_s=1.0, final_loss=8.5)])):
        md = report.run_markdown(run)
        assert md.startswith(f"### `{run['command']}`") and "NVIDIA H200 · torch 2.11.0" in md and "|" in md


def test_benchmarks_md_is_generated_from_the_record():
    rc = main(["report", "--check"])
    assert rc == 0, "BENCHMARKS.md differs from the record: run `python -m kforge.bench report`"


def test_bench_files_speak_of_the_project_only():
    # Runs are named by commit and date, never by the working periods that produced them; the word
    # is spelled in two parts so that this file passes `git grep` for it as well.
    word = "ses" + "sion"
    paths = [os.path.join(REPO, "BENCHMARKS.md"), RECORD, os.path.abspath(__file__)]
    for d in (os.path.join(REPO, "docs", "experiments"), os.path.join(PKG_ROOT, "kforge", "bench")):
        paths += [os.path.join(d, n) for n in os.listdir(d) if n.endswith((".md", ".py"))]
    for p in paths:
        with open(p, encoding="utf-8") as f:
            assert word not in f.read().lower(), p


# ---- factories and presets -----------------------------------------------------------------------
def test_load_factory_errors(factories):
    for spec, msg in (("nocolon", "must look like"), ("no_such_module_xyz:make", "cannot import"),
                      ("kf_bench_models:nope", "has no attribute"), ("kf_bench_models:not_callable", "not callable")):
        with pytest.raises(models.FactoryError, match=msg):
            models.load_factory(spec)


def test_build_moves_casts_and_checks(factories):
    case = models.ModelCase("m", "kf_bench_models:make")
    b = models.build(case, "bf16", batch=3, seq=5, device="cpu")
    assert {p.dtype for p in b.model.parameters()} == {torch.bfloat16} and b.autocast is None and b.mode == "jit"
    assert b.inputs[0].shape == (3, 5)
    b = models.build(case, "autocast", batch=3, seq=5, device="cpu")
    assert {p.dtype for p in b.model.parameters()} == {torch.float32} and b.autocast == torch.bfloat16
    assert b.loss_fn(b.call(b.model)).shape == ()
    import kf_bench_models

    b = models.build(models.ModelCase("m", "kf_bench_models:make_all", "tiny"), "autocast", batch=2, seq=4, device="cpu")
    kw = kf_bench_models.seen[-1]
    assert kw["size"] == "tiny" and kw["autocast"] is True and kw["dtype"] == torch.bfloat16
    assert isinstance(b.inputs, dict) and b.autocast == torch.bfloat16
    for spec, msg in (("bad_options", "options must be a dict"), ("not_a_model", "not an nn.Module"),
                      ("bad_mode", "mode must be")):
        with pytest.raises(models.FactoryError, match=msg):
            models.build(models.ModelCase(spec, f"kf_bench_models:{spec}"), "bf16", batch=1, seq=2, device="cpu")
    with pytest.raises(models.UsageError, match="set-up"):
        models.build(case, "fp8", batch=1, seq=2, device="cpu")


def test_default_loss_picks_the_scalar():
    t = torch.tensor(2.0)
    assert models.default_loss(t) is not None
    assert models.default_loss((torch.ones(3), t)).item() == 2.0
    assert models.default_loss({"loss": t}).item() == 2.0
    with pytest.raises(models.FactoryError, match="loss_fn"):
        models.default_loss(torch.ones(3))


def _args(**kw) -> argparse.Namespace:
    base = dict(names=[], model_specs=None, preset=None, size=None, setup=None, backends=None, batch=None, seq=None,
                steps=None, warmup=None, cudagraphs=False, path=None, second_process=False, warm_caches=False,
                dry=False, dropout=None)
    return argparse.Namespace(**{**base, **kw})


def test_path_option_sends_plain_models_through_dynamo():
    """--path dynamo: the plain Llama (a thunder.jit model by its factory) reaches kforge through
    kforge.compile; the row says so and trains (CPU --dry run). Without --path the factory decides."""
    assert models.resolve(_args()).path is None
    cfg = models.resolve(_args(dry=True, names=["plain-llama"], backends="kforge", setup="bf16", path="dynamo"))
    run = models.bench_models(cfg)
    (row,) = run["rows"]
    assert row.get("error") is None and row["path"] == "dynamo" and run["config"]["path"] == "dynamo"
    assert math.isfinite(row["final_loss"])
    (jit_row,) = models.bench_models(models.resolve(_args(dry=True, names=["plain-llama"], backends="kforge",
                                                          setup="bf16")))["rows"]
    assert jit_row["path"] == "jit"
    case = models.zoo_case("hf-llama", "micro")
    assert models.build(case, "bf16", batch=1, seq=8, device="cpu").mode == "dynamo"
    assert models.build(case, "bf16", batch=1, seq=8, device="cpu", path="jit").mode == "jit"


def test_group_backend_adds_the_linear_group_pattern():
    """kforge+group (asked for by name): kforge.jit with the opt-in linear_group kind added to every default one."""
    from kforge.transforms import ALL_KINDS

    assert "kforge+group" not in models.DEFAULT_BACKENDS

    def kinds(backend: str) -> tuple:
        fn = models.wrap(backend, torch.nn.Linear(4, 4))
        return fn.llama_patterns.kinds

    assert "linear_group" not in ALL_KINDS and kinds("kforge") == ALL_KINDS
    assert kinds("kforge+group") == ALL_KINDS + ("linear_group",)


def test_tune_backends_switch_gemm_tuning_per_step(monkeypatch):
    """kforge+tune / kforge-tune (asked for by name): each of their steps turns GEMM tuning on / off, each
    plain kforge step sets it as KFORGE_GEMM_TUNE says (on unset, off for "0"), so the rows alternate in
    one process."""
    from kforge.ops import gemm

    assert "kforge+tune" not in models.DEFAULT_BACKENDS and "kforge-tune" not in models.DEFAULT_BACKENDS
    seen: list[tuple[bool, bool]] = []
    real = gemm.set_tune
    monkeypatch.setattr(gemm, "set_tune", lambda on, forget=False: (seen.append((on, forget)), real(on, forget)))
    was = gemm.stats()["tune"]
    try:
        for env, plain in ((None, True), ("0", False)):
            if env is None:
                monkeypatch.delenv("KFORGE_GEMM_TUNE", raising=False)
            else:
                monkeypatch.setenv("KFORGE_GEMM_TUNE", env)
            seen.clear()
            rows = models.bench_models(models.resolve(_args(dry=True, names=["plain-llama"], setup="bf16",
                                                            backends="kforge,kforge+tune,kforge-tune")))["rows"]
            assert [r["backend"] for r in rows] == ["kforge", "kforge+tune", "kforge-tune"]
            assert all(r.get("error") is None and math.isfinite(r["final_loss"]) for r in rows), rows
            assert {on for on, _ in seen} == {False, True} and not any(forget for _, forget in seen), seen
            # the first set_tune of each row's warm-up comes in row order: plain, +tune, -tune
            assert [on for on, _ in seen[:1]] == [plain], (env, seen)
            tuned = {r["backend"]: r.get("gemm_tuning") for r in rows}
            # tuned rows list their tuned shapes: none on a CPU, where no GEMM takes a plan
            assert tuned == {"kforge": [] if plain else None, "kforge+tune": [], "kforge-tune": None}, tuned
    finally:
        real(was)


def test_cefused_backend_traces_with_its_environment(monkeypatch):
    """kforge+cefused (asked for by name): built and first called with KFORGE_CE_FUSED=1, the
    environment restored afterwards; the plain kforge row traces without it."""
    assert "kforge+cefused" not in models.DEFAULT_BACKENDS
    monkeypatch.delenv("KFORGE_CE_FUSED", raising=False)
    seen: dict[str, str | None] = {}
    real = models.wrap

    def wrap(backend, *args, **kwargs):
        seen[backend] = os.environ.get("KFORGE_CE_FUSED")
        return real(backend, *args, **kwargs)

    monkeypatch.setattr(models, "wrap", wrap)
    rows = models.bench_models(models.resolve(_args(dry=True, names=["plain-llama"], setup="bf16",
                                                    backends="kforge,kforge+cefused")))["rows"]
    assert [r["backend"] for r in rows] == ["kforge", "kforge+cefused"]
    assert all(r.get("error") is None and math.isfinite(r["final_loss"]) for r in rows), rows
    assert seen == {"kforge": None, "kforge+cefused": "1"}, seen
    assert "KFORGE_CE_FUSED" not in os.environ


def test_gemm_backends_switch_the_plans_on_and_off(monkeypatch):
    """kforge+gemm / kforge-gemm (asked for by name, not defaults): kforge.jit(gemm=True / False), rows of
    their own whatever KFORGE_GEMM says; plain kforge follows KFORGE_GEMM (on by default)."""
    assert "kforge+gemm" not in models.DEFAULT_BACKENDS and "kforge-gemm" not in models.DEFAULT_BACKENDS
    rows = models.bench_models(models.resolve(_args(dry=True, names=["plain-llama"], backends="kforge+gemm,kforge-gemm",
                                                    setup="bf16")))["rows"]
    assert [r["backend"] for r in rows] == ["kforge+gemm", "kforge-gemm"]
    for row in rows:
        assert row.get("error") is None and math.isfinite(row["final_loss"])
        assert row["gemm_calls"] == {"plan": 0, "aten": 0}  # CPU: the rewrite takes CUDA only
    import thunder

    from kforge.ops.gemm import GemmCalls

    def gemm_transforms(backend: str) -> list:
        fn = models.wrap(backend, torch.nn.Linear(4, 4))
        return [t for t in thunder.compile_data(fn).transforms if isinstance(t, GemmCalls)]

    monkeypatch.setenv("KFORGE_GEMM", "0")
    assert len(gemm_transforms("kforge+gemm")) == 1 and gemm_transforms("kforge") == []
    monkeypatch.delenv("KFORGE_GEMM")
    assert gemm_transforms("kforge-gemm") == [] and len(gemm_transforms("kforge")) == 1


def test_resolve_presets_and_defaults():
    cfg = models.resolve(_args())
    assert [(c.label, c.size) for c in cfg.cases] == [("nanogpt", "124M"), ("plain-llama", "bench"), ("hf-llama", "bench")]
    assert cfg.setups == ["bf16", "autocast"] and cfg.backends == list(models.DEFAULT_BACKENDS)
    assert (cfg.batch, cfg.seq, cfg.steps, cfg.warmup, cfg.cudagraphs, cfg.cold) == (8, 1024, 10, 3, False, True)
    small = models.resolve(_args(preset="small"))
    assert [(c.label, c.size) for c in small.cases] == [("nanogpt", "124M")]
    assert (small.batch, small.seq, small.setups, small.cudagraphs) == (4, 64, ["fp32"], True)
    assert models.resolve(_args(preset="small", batch=2)).batch == 2
    dry = models.resolve(_args(dry=True, names=["hf-llama"]))
    assert [(c.label, c.size) for c in dry.cases] == [("hf-llama", "micro")] and (dry.batch, dry.seq) == (2, 16)
    dry_small = models.resolve(_args(dry=True, preset="small", names=["nanogpt", "plain-llama"]))
    assert [c.size for c in dry_small.cases] == ["micro", "micro"] and dry_small.cudagraphs
    named = models.resolve(_args(preset="small", names=["plain-llama"]))
    assert [(c.label, c.size) for c in named.cases] == [("plain-llama", "bench")]  # the preset's size is nanogpt's
    assert [c.size for c in models.resolve(_args(size="tiny")).cases] == ["tiny"] * 3
    with pytest.raises(models.UsageError, match="unknown backend"):
        models.resolve(_args(backends="eager,jax"))
    with pytest.raises(models.UsageError, match="unknown zoo model"):
        models.resolve(_args(names=["gpt5"]))
    with pytest.raises(models.UsageError, match="--steps must be at least 1"):
        models.resolve(_args(steps=0))


def test_backends_are_wired():
    model = torch.nn.Linear(2, 2)
    assert models.wrap("eager", model) is model
    assert type(models.cudagraph_transform()).__name__ == "CUDAGraphTransform"
    with pytest.raises(ValueError, match="unknown backend"):
        models.wrap("tvm", model)
    assert models.path_of("kforge", "dynamo") == "dynamo" and models.path_of("thunder", "jit") == "jit"
    assert models.path_of("eager", "jit") is None
    assert models.backend_label({"backend": "torch.compile", "cudagraphs": True}) == "torch.compile (reduce-overhead)"


# ---- zoo -----------------------------------------------------------------------------------------
def _autocast_micro_step(make) -> None:
    """A zoo HF factory at its micro size under CPU autocast: fp32 weights, the sequence clipped to
    the context, an fp32 loss near log(vocab)."""
    m, inputs, opts = make(size="micro", batch=2, seq=64, device="cpu", dtype=torch.bfloat16, autocast=True)
    assert {p.dtype for p in m.parameters()} == {torch.float32} and opts["autocast"] == torch.bfloat16
    assert inputs["input_ids"].shape == (2, 32)  # clipped to the context
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = opts["loss_fn"](m(**inputs))
    assert loss.dtype == torch.float32 and 3 < loss.item() < 6  # ~ log(97)


def test_hf_llama_has_the_plain_llamas_sizes():
    from kforge.zoo import MODELS, hf_llama, plain_llama

    assert set(MODELS) == {"nanogpt", "plain-llama", "hf-llama", "hf-gpt2", "hf-mixtral"}
    assert hf_llama.SIZES == plain_llama.SIZES
    hf, inputs, opts = hf_llama.make(size="bench", batch=2, seq=16, device="meta", dtype=torch.bfloat16)
    plain, _, _ = plain_llama.make(size="bench", batch=2, seq=16, device="meta", dtype=torch.bfloat16)
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in plain.parameters())
    assert opts["mode"] == "dynamo" and opts["autocast"] is None and set(inputs) == {"input_ids", "labels"}
    assert hf.config.num_key_value_heads == 4 and hf.config.intermediate_size == 2048 and not hf.config.use_cache
    _autocast_micro_step(hf_llama.make)


def test_hf_mixtral_is_the_llama_with_its_feed_forward_as_experts():
    """The bench size: the Llama's attention, and per token (top 2 of 8 experts of 1024) its 2048-wide
    feed-forward."""
    from kforge.zoo import hf_mixtral, plain_llama

    mx, inputs, opts = hf_mixtral.make(size="bench", batch=2, seq=16, device="meta", dtype=torch.bfloat16)
    ll, _, _ = plain_llama.make(size="bench", batch=2, seq=16, device="meta", dtype=torch.bfloat16)
    c, s = mx.config, plain_llama.SIZES["bench"]
    assert c.num_experts_per_tok * c.intermediate_size == s["hidden_dim"] and c.num_local_experts == 8
    ffn = 3 * s["dim"] * s["hidden_dim"] * s["n_layer"]  # the Llama's w1, w2, w3
    router = c.num_local_experts * s["dim"] * s["n_layer"]
    n_mx, n_ll = (sum(p.numel() for p in m.parameters()) for m in (mx, ll))
    assert n_mx == n_ll - ffn + 4 * ffn + router, (n_mx, n_ll)
    assert opts["mode"] == "dynamo" and set(inputs) == {"input_ids", "labels"} and not c.use_cache
    assert c.router_aux_loss_coef == 0.0 and not c.output_router_logits
    _autocast_micro_step(hf_mixtral.make)


def test_hf_mixtral_trains_a_step_under_kforge_as_eager_does():
    """CPU, micro size: the loss and every gradient within 1e-4 of its largest entry (the router's
    in-place renormalisation and the grouped expert products, kforge.inplace / kforge.ops.grouped_mm)."""
    from kforge.transforms import jit
    from kforge.zoo import hf_mixtral

    model, inputs, opts = hf_mixtral.make(size="micro", batch=2, seq=32, device="cpu", dtype=torch.float32)
    ref = opts["loss_fn"](model(**inputs))
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = opts["loss_fn"](jit(model)(**inputs))
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        assert (p.grad - want[n]).abs().max() <= 1e-4 * want[n].abs().max(), n


def test_hf_gpt2_has_nanogpts_sizes():
    from kforge.zoo import hf_gpt2, nanogpt

    assert hf_gpt2.SIZES.keys() == nanogpt.SIZES.keys()
    hf, inputs, opts = hf_gpt2.make(size="124M", batch=2, seq=16, device="meta", dtype=torch.bfloat16)
    ng, _, _ = nanogpt.make(size="124M", batch=2, seq=16, device="meta", dtype=torch.bfloat16)
    # The same parameters (tied embeddings in both): 124M and a few.
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ng.parameters())
    assert opts["autocast"] is None and "mode" not in opts and set(inputs) == {"input_ids", "labels"}
    assert hf.config.resid_pdrop == hf.config.attn_pdrop == hf.config.embd_pdrop == 0.0
    _autocast_micro_step(hf_gpt2.make)


@pytest.mark.parametrize("name", ["nanogpt", "hf-gpt2", "hf-llama", "hf-mixtral"])
def test_zoo_models_take_a_dropout(name):
    """make(dropout=p): in train mode two steps of the same inputs differ, in eval mode the model is
    the dropout-free one (same weights); dropout=0 (the default) is deterministic in train mode."""
    from kforge.zoo import MODELS

    make = models.load_factory(MODELS[name])

    def losses(dropout, train, calls=2):
        model, inputs, opts = make(size="micro", batch=2, seq=16, device="cpu", dtype=torch.float32, dropout=dropout)
        model.train(train)
        call = (lambda: model(**inputs)) if isinstance(inputs, dict) else (lambda: model(*inputs))
        return [opts["loss_fn"](call()).item() for _ in range(calls)]

    torch.manual_seed(1)
    a, b = losses(0.5, True)
    assert a != b, "dropout 0.5 in train mode changed nothing"
    assert losses(0.5, False) == losses(0.0, False) == losses(0.0, True)[:1] * 2


def test_dropout_reaches_the_factories_rows_and_a_table_of_its_own(factories):
    """--dropout P: passed to every factory (one that takes none is an error naming it), kept in each
    row, and its runs make tables of their own that the issue's targets leave out."""
    import kf_bench_models

    cfg = models.resolve(_args(names=["nanogpt"], model_specs=["kf_bench_models:make_all"], dropout=0.1))
    assert [c.dropout for c in cfg.cases] == [0.1, 0.1]
    models.build(cfg.cases[1], "bf16", batch=1, seq=4, device="cpu")
    assert kf_bench_models.seen[-1]["dropout"] == 0.1
    models.build(models.ModelCase("m", "kf_bench_models:make_all"), "bf16", batch=1, seq=4, device="cpu")
    assert "dropout" not in kf_bench_models.seen[-1]  # only when asked for
    with pytest.raises(models.FactoryError, match="takes no dropout"):
        models.build(models.ModelCase("m", "kf_bench_models:make", dropout=0.1), "bf16", batch=1, seq=4, device="cpu")
    with pytest.raises(models.UsageError, match="--dropout"):
        models.resolve(_args(dropout=1.0))
    (row,) = models.bench_models(models.resolve(_args(dry=True, names=["nanogpt"], backends="eager", setup="bf16",
                                                      dropout=0.1)))["rows"]
    assert row["dropout"] == 0.1 and "error" not in row, row
    plain, dropped = _users_run(17.0, 19.0, 40.0), _users_run(30.0, 19.0, 40.0)
    for r in dropped["rows"]:
        r["dropout"] = 0.1
    tables = report._tables(report.current_tables([plain, dropped]), "models")
    assert sorted(t.key[2] for t in tables) == ["124M", "124M dropout 0.1"]
    assert report.TARGETS[0].check(report.current_tables([plain, dropped]))[0] == "met"  # 30 ms is not judged
    assert report.TARGETS[0].check(report.current_tables([dropped])) == ("no run", "")


# ---- dry runs ------------------------------------------------------------------------------------
def test_dry_run_of_every_zoo_model(monkeypatch):
    real_wrap = models.wrap

    def wrap(backend, model, mode="jit", **kw):
        if backend == "kforge":
            raise RuntimeError("kforge refused on purpose")
        return real_wrap(backend, model, mode, **kw)

    monkeypatch.setattr(models, "wrap", wrap)
    cfg = models.resolve(_args(dry=True, backends="eager,kforge,thunder"))
    cfg.cases[2:] = []  # hf-llama below: Thunder's Dynamo path takes ~30 s on a CPU
    result = models.bench_models(cfg)
    rows = result["rows"]
    assert result["dry"] and len(rows) == 2 * 2 * 3
    for r in rows:
        if r["backend"] == "kforge":
            assert r["error"] == "RuntimeError: kforge refused on purpose"
        else:
            assert "error" not in r, r
            assert r["first_s"] >= 0 and 2 < r["final_loss"] < 7 and r.get("ms") is None
    thunder_rows = [r for r in rows if r["backend"] == "thunder"]
    assert all(r["path"] == "jit" for r in thunder_rows)
    for r in thunder_rows:  # the first step's phases, from Thunder's compile statistics
        phases = r["first_trace_s"] + r["first_transforms_s"] + r["first_forward_s"]
        assert min(r["first_trace_s"], r["first_transforms_s"], r["first_forward_s"]) > 0, r
        assert phases <= r["first_s"], r
    assert all("first_trace_s" not in r for r in rows if r["backend"] == "eager")


def test_dry_run_from_the_command_line(factories, tmp_path):
    rec = tmp_path / "records.jsonl"
    rc, out, err = run_module("models", "--dry", "--backends", "eager", "--setup", "all", "hf-llama",
                              "--model", "kf_bench_models:make", "--record", str(rec), extra_path=factories,
                              gpu_visible=False)
    assert rc == 0, err[-3000:]
    assert "dry run: not recorded" in err and not rec.exists()
    assert out.startswith("### `python -m kforge.bench models --dry")
    for name in ("hf-llama", "kf_bench_models:make", "fp32 weights + bf16 autocast", "bf16 weights", "| fp32 "):
        assert name in out, name
    assert "Error" not in out


class _FakeTrainer:
    def __init__(self, name, log, fail_at=None):
        self.name, self.log, self.fail_at, self.times = name, log, fail_at, []

    def timed(self, n):
        if self.fail_at is not None and len(self.times) >= self.fail_at:
            raise RuntimeError(f"{self.name} broke")
        self.log.append((self.name, n))
        self.times += [1.0] * n


def test_interleave_alternates_blocks_and_keeps_going_past_a_failure():
    log = []
    a, b, c = _FakeTrainer("a", log), _FakeTrainer("b", log, fail_at=3), _FakeTrainer("c", log)
    errors = models.interleave([a, b, c], steps=7, rounds=3)
    # 7 steps in blocks of 3, 2, 2; the order turns round each block; b fails in its second block
    assert log == [("a", 3), ("b", 3), ("c", 3), ("c", 2), ("a", 2), ("a", 2), ("c", 2)]
    assert errors == [None, "RuntimeError: b broke", None]
    assert len(a.times) == len(c.times) == 7
    log.clear()
    models.interleave([a], steps=2, rounds=5)  # never more rounds than steps
    assert log == [("a", 1), ("a", 1)]


def test_step_summary_percentiles_stay_within_the_steps():
    from types import SimpleNamespace

    import random

    rng = random.Random(0)
    for n in (1, 2, 7, 20):
        times = [rng.uniform(10, 30) for _ in range(n)]
        s = models.Trainer.summary(SimpleNamespace(times=times, losses=[2.5]))
        assert min(times) == s["ms_min"] <= s["ms_p10"] <= s["ms"] <= s["ms_p90"] <= max(times), (n, s)
        assert s["timed_steps"] == n and s["final_loss"] == 2.5


def test_forget_regions_drops_region_structures():
    from kforge.fusion import executor

    executor._regions["k"] = object()
    executor.forget_regions()
    assert executor.regions() == []


def test_cold_caches_start_like_a_fresh_process(tmp_path, monkeypatch):
    from kforge import frontend
    from kforge.fusion import executor

    orig = kforge.cache_dir()
    for k in ("KFORGE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(k, os.environ.get(k, ""))  # restored afterwards
    monkeypatch.setattr(frontend, "_warming", True)
    executor._regions["k"] = object()
    env = models.cold_caches(str(tmp_path), "000", drop_memory=False)
    assert frontend._warming and executor.regions()  # live models keep what they use
    env = models.cold_caches(str(tmp_path), "001")
    # Every kernel source compiles again into the new directory, as in a second process's start.
    assert not frontend._warming and executor.regions() == []
    assert all(os.path.isdir(d) and d.startswith(str(tmp_path / "001")) for d in env.values())
    kforge._C.set_cache(orig, True)


def test_second_process_plumbing_on_cpu(factories):
    case = models.ModelCase("m", "kf_bench_models:make")
    res = models.second_process(case, "fp32", "eager", batch=2, seq=4, device="cpu", cudagraphs=False, env={})
    assert "error_2nd" not in res and res["first_s_2nd"] >= 0 and "first_trace_s_2nd" not in res
    th = models.second_process(case, "fp32", "thunder", batch=2, seq=4, device="cpu", cudagraphs=False, env={})
    assert "error_2nd" not in th and 0 < th["first_trace_s_2nd"] < th["first_s_2nd"], th
    bad = models.second_process(models.ModelCase("m", "kf_bench_models:bad_mode"), "fp32", "eager", batch=2, seq=4,
                                device="cpu", cudagraphs=False, env={})
    assert "mode must be" in bad["error_2nd"]


# ---- GPU -----------------------------------------------------------------------------------------
@gpu
@pytest.mark.timeout(900)
def test_models_on_gpu_records_timings(tmp_path):
    rec = tmp_path / "records.jsonl"
    # One model, but six rows each with fresh caches (Inductor compiles included) and a second process
    # per set-up: under a 16-way parallel suite that took more than the usual 300 s once.
    rc, out, err = run_module("models", "nanogpt", "--size", "tiny", "--batch", "2", "--seq", "128",
                              "--steps", "7", "--warmup", "2", "--setup", "both",
                              "--backends", "eager,torch.compile,kforge", "--second-process", "--record", str(rec))
    assert rc == 0, err[-4000:]
    (run,) = records.load(str(rec))
    assert run["kind"] == "models" and run["gpu"] and run["device"] == "cuda"
    assert run["config"]["timing"] == f"interleaved x{models.ROUNDS}"
    for setup in ("bf16", "autocast"):
        by = {r["backend"]: r for r in run["rows"] if r["setup"] == setup}
        for r in by.values():
            assert "error" not in r or r["backend"] == "kforge", r
            if "error" not in r:
                assert r["timed_steps"] == 7 and 0 < r["ms_min"] <= r["ms_p10"] <= r["ms"] <= r["ms_p90"], r
                assert 0 < r["peak_gib"] < 8, r
        assert by["torch.compile"].get("first_s_2nd") is not None
        k = by["kforge"]
        if "error" not in k:
            # The second set-up's kforge row starts cold too, and writes every kernel it needs to its
            # own disk cache: its second process compiles nothing.
            assert k["nvrtc_compiles"] > 0 and k["nvrtc_compiles_2nd"] == 0, k
    text, _ = report.render(records.load(str(rec)), doc_path=str(tmp_path / "B.md"))
    assert "size tiny, B=2 T=128" in text

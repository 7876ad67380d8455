"""The benchmark record: one JSON object per `python -m kforge.bench` run, one line each, appended to
benchmarks/records.jsonl. BENCHMARKS.md and docs/plots are generated from it
(`python -m kforge.bench report`); the history is this file and git.

A run object holds what identifies the measurement (GPU, library versions, kforge commit, date,
command) and every row the run measured:

    {"schema": 1, "kind": "ops" | "model" | "models" | "launch", "gpu": "NVIDIA H200",
     "device": "cuda", "torch": "2.11.0+cu130", "cuda": "13.0", "thunder": "0.2.6", "kforge": "0.1.0",
     "transformers": "5.17.0", "python": "3.12.3", "commit": "5d12b31", "date": "2026-11-22",
     "time": "2026-11-22T10:31:05+00:00", "command": "python -m kforge.bench ops ...",
     "rows": [...], ...kind-specific fields (ops: "copy_gbs")}

Imported runs (tables of the hand-kept BENCHMARKS.md, parsed by `kforge.bench.legacy`) carry
`"imported": {...}` and None for what their tables did not state.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from collections.abc import Iterable, Sequence
from typing import Any

SCHEMA = 1
RECORD_NAME = os.path.join("benchmarks", "records.jsonl")


def repo_root() -> str | None:
    """The kforge checkout this package runs from (editable install or PYTHONPATH=python), else None."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(os.path.dirname(here)))  # python/kforge/bench -> repo
    return root if os.path.exists(os.path.join(root, "kernels_src")) else None


def default_record_path() -> str:
    """benchmarks/records.jsonl of the checkout, else of the working directory."""
    return os.path.join(repo_root() or os.getcwd(), RECORD_NAME)


_CODE = ("python", "src", "kernels_src", "setup.py", "CMakeLists.txt")  # what a timing depends on


def git_commit(cwd: str | None = None) -> str | None:
    """The kforge commit measured: $KFORGE_COMMIT (set where the checkout has no .git), else git's
    short HEAD of this package's checkout (`cwd`), with "+dirty" when the code differs from it (a
    copied tree over an older .git, or uncommitted edits), else None."""
    from .._env import text

    env = text("KFORGE_COMMIT")
    if env:
        return env
    cwd = cwd or os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=cwd)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = git("rev-parse", "--short", "HEAD")
    if not sha:
        return None
    top = git("rev-parse", "--show-toplevel")
    changed = git("-C", top, "status", "--porcelain", "--untracked-files=no", "--", *_CODE) if top else None
    return f"{sha}+dirty" if changed else sha


def _version(module: str) -> str | None:
    # importlib.metadata: the installed version without importing the package (thunder's import is slow
    # and transformers' import heavy); None when not installed.
    from importlib import metadata

    name = {"thunder": "lightning-thunder"}.get(module, module)
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def run_header(command: str, *, device: str | None = None) -> dict[str, Any]:
    """Everything a run object states besides its rows: GPU, versions, commit, date, command."""
    import torch

    from .. import __version__ as kforge_version

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "schema": SCHEMA,
        "device": device,
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "thunder": _version("thunder"),
        "kforge": kforge_version,
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "commit": git_commit(),
        "date": now.date().isoformat(),
        "time": now.isoformat(timespec="seconds"),
        "command": command,
    }


def append(path: str, run: dict[str, Any]) -> None:
    """Append one run as one JSON line (created with its directory if missing). One write call per
    line, so runs appended by concurrent processes do not interleave within a line."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    line = json.dumps(run, sort_keys=False, default=_json_default, ensure_ascii=False) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


def _json_default(o: Any) -> Any:
    # Rows may hold torch dtypes or numpy scalars; the record stores their text / Python value.
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def load(paths: str | Sequence[str]) -> list[dict[str, Any]]:
    """Every run of the record file(s), oldest first (the order they were appended). Blank lines are
    skipped; a line that is not a JSON object raises ValueError naming the file and line."""
    runs = []
    for path in [paths] if isinstance(paths, str) else paths:
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    run = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON: {e}") from e
                if not isinstance(run, dict) or "kind" not in run or "rows" not in run:
                    raise ValueError(f"{path}:{n}: a run needs 'kind' and 'rows'")
                runs.append(run)
    return runs


def extend(path: str, runs: Iterable[dict[str, Any]]) -> int:
    """Append several runs; returns how many."""
    n = 0
    for run in runs:
        append(path, run)
        n += 1
    return n

"""One-time importer: the tables of the hand-kept BENCHMARKS.md into the record.

Before the record existed, each `python -m kforge.bench` run's Markdown block was pasted into
BENCHMARKS.md under a heading holding its command:

    ### `python -m kforge.bench ops --op colsum ... --markdown /root/out/ops3.md`

    NVIDIA H200 · torch 2.11.0+cu130 · Python 3.12.3 · 2026-11-22 · kforge 8c88da8

    Measured device-to-device copy bandwidth: **4214 GB/s** (read + write). ...

    | op | dir | shape | dtype | kforge µs | ...

`parse` reads the first table under each such heading (the newest of its kind: later runs were
pasted above earlier ones, and older tables of a command sit in prose, not under a heading) and
turns it into a run object with the figures exactly as printed. Nothing is typed by hand; what the
file did not state (thunder version, bytes moved) stays None.
"""
from __future__ import annotations

import re
import subprocess
from typing import Any

from .records import SCHEMA

HEADING = re.compile(r"^### `(python -m kforge\.bench (\S+)[^`]*)`\s*$")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
COPY = re.compile(r"copy bandwidth: \*\*([0-9.]+) GB/s\*\*")
KINDS = {"ops": "ops", "gpt2": "model", "llama": "model", "launch": "launch"}

# Table header -> row key, per kind; "B x T" is split into batch and seq.
COLUMNS = {
    "ops": {"op": "op", "dir": "dir", "shape": "shape", "dtype": "dtype", "kforge µs": "kforge_us",
            "kforge GB/s": "kforge_gbs", "% copy": "kforge_pct_copy", "same-size copy µs": "copy_same_us",
            "% same-size copy": "kforge_pct_same", "eager µs": "eager_us", "eager GB/s": "eager_gbs",
            "compile µs": "compile_us", "compile GB/s": "compile_gbs"},
    "model": {"model": "model", "attention": "attention", "backend": "backend", "B x T": "B x T",
              "dtype": "dtype", "ms/step": "ms", "peak GiB": "peak_gib", "warm-up s": "warmup_s",
              "loss": "final_loss", "error": "error"},
    "launch": {"launcher": "launcher", "host µs / launch": "host_us_per_launch"},
}
TEXT_KEYS = {"op", "dir", "shape", "dtype", "model", "attention", "backend", "launcher", "error"}


class LegacyFormatError(ValueError):
    """A table under a bench heading that does not read as the bench printed it."""


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _number(text: str) -> float | None:
    if text in ("—", "", "-"):
        return None
    return float(text)


def parse_provenance(line: str) -> dict[str, Any]:
    """`NVIDIA H200 · torch 2.11.0+cu130 · Python 3.12.3 · 2026-11-22 · kforge 8c88da8` -> fields."""
    parts = [p.strip() for p in line.split("·")]
    out: dict[str, Any] = {"gpu": parts[0], "torch": None, "python": None, "date": None, "commit": None}
    for p in parts[1:]:
        if p.startswith("torch "):
            out["torch"] = p[len("torch "):]
        elif p.startswith("Python "):
            out["python"] = p[len("Python "):]
        elif p.startswith("kforge "):
            out["commit"] = p[len("kforge "):]
        elif DATE.match(p):
            out["date"] = p
    return out


def _rows(kind: str, header: list[str], body: list[list[str]]) -> list[dict[str, Any]]:
    cols = COLUMNS[kind]
    unknown = [h for h in header if h not in cols]
    if unknown:
        raise LegacyFormatError(f"{kind} table: unknown columns {unknown}")
    rows = []
    for cells in body:
        if len(cells) != len(header):
            raise LegacyFormatError(f"{kind} table: row {cells} has {len(cells)} cells, header {len(header)}")
        row: dict[str, Any] = {}
        for h, c in zip(header, cells):
            key = cols[h]
            if key == "B x T":
                b, t = c.split("x")
                row["batch"], row["seq"] = int(b), int(t)
            elif key in TEXT_KEYS:
                if c or key != "error":
                    row[key] = c
            else:
                row[key] = _number(c)
        rows.append(row)
    return rows


def parse(text: str, *, source: str = "BENCHMARKS.md", from_commit: str | None = None) -> list[dict[str, Any]]:
    """Every bench table under a `### \\`python -m kforge.bench ...\\`` heading, as run objects, in
    the file's order. A command heading that appears twice keeps its first (newest) table."""
    lines = text.splitlines()
    runs, seen = [], set()
    i = 0
    while i < len(lines):
        m = HEADING.match(lines[i])
        i += 1
        if not m or KINDS.get(m.group(2)) is None:
            continue
        command, kind = m.group(1), KINDS[m.group(2)]
        prov: dict[str, Any] | None = None
        copy_gbs = None
        table: list[str] = []
        while i < len(lines) and not lines[i].startswith("#"):
            line = lines[i]
            if line.startswith("|"):
                table.append(line)
            elif table:
                break  # the first table ends; anything after it is prose
            elif prov is None and "·" in line and line.strip():
                prov = parse_provenance(line)
            elif (c := COPY.search(line)) is not None:
                copy_gbs = float(c.group(1))
            i += 1
        if not table or prov is None or command in seen:
            continue
        seen.add(command)
        header = _cells(table[0])
        body = [_cells(ln) for ln in table[2:]]  # table[1] is the |---| rule
        run: dict[str, Any] = {
            "schema": SCHEMA, "kind": kind, "device": "cuda", "gpu": prov["gpu"], "torch": prov["torch"],
            "cuda": None, "thunder": None, "kforge": None, "transformers": None, "python": prov["python"],
            "commit": prov["commit"], "date": prov["date"], "time": None, "command": command,
            "rows": _rows(kind, header, body),
            "imported": {"from": source, "from_commit": from_commit,
                         "note": "figures as that file printed them (rounded); None where it stated nothing"},
        }
        if kind == "ops":
            run["copy_gbs"] = copy_gbs
        runs.append(run)
    return runs


def commit_depth(commit: str | None, cwd: str | None = None) -> int | None:
    """How many commits lead to `commit` (git rev-list --count): orders imported runs oldest first."""
    if not commit:
        return None
    try:
        r = subprocess.run(["git", "rev-list", "--count", commit], capture_output=True, text=True, timeout=10, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip().isdigit() else None


def oldest_first(runs: list[dict[str, Any]], cwd: str | None = None) -> list[dict[str, Any]]:
    """Runs sorted by their commit's place in git history (unknown commits keep file order, first)."""
    depth = {id(r): commit_depth(r.get("commit"), cwd) for r in runs}
    return sorted(runs, key=lambda r: -1 if depth[id(r)] is None else depth[id(r)])


def already_imported(existing: list[dict[str, Any]], run: dict[str, Any]) -> bool:
    """Whether the record holds this imported table already (same command, commit and rows)."""
    return any(e.get("imported") and e.get("command") == run["command"] and e.get("commit") == run["commit"]
               and e.get("rows") == run["rows"] for e in existing)

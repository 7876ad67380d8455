"""Every environment variable kforge reads, parsed in one place (the README's "Environment" table).

    KFORGE_KERNEL_DIR        directory of the kernel sources (default: the installed / checked-out kernels_src)
    KFORGE_CACHE_DIR         disk cache directory (default: $XDG_CACHE_HOME/kforge, else ~/.cache/kforge)
    KFORGE_DISK_CACHE        boolean, default on: read and write compiled kernels on disk
    KFORGE_NVRTC             path of the libnvrtc to load, tried before any other
    KFORGE_FUSION            boolean, default on: kforge's fusion executor in kforge.executors()
    KFORGE_DEPENDENT_LAUNCH  boolean, default on: programmatic dependent launches on sm_90+ (A/B timing)
    KFORGE_LOOKASIDES        boolean, default on: kforge.jit / kforge.compile install kforge.lookasides
    KFORGE_TRACE_CACHE       boolean, default on: kforge.jit / kforge.compile keep Thunder's compiled programs on disk
    KFORGE_GEMM              boolean, default on: GEMMs on kforge's cached cuBLASLt plans (kforge.ops.gemm)
    KFORGE_GEMM_TUNE         boolean, default on: time cuBLASLt's candidate kernels per GEMM shape, keep the fastest
    KFORGE_CE_FUSED          boolean, default off: cross-entropy's gradient written in the forward, scaled in the backward
    KFORGE_COMMIT            commit recorded by kforge.bench where the checkout has no .git

Booleans: "1", "true", "on", "yes" mean on and "0", "false", "off", "no" mean off, in any case and
with surrounding spaces ignored; unset or empty means the default. Anything else raises
`KforgeEnvError` naming the variable, rather than silently meaning on (as "FALSE" once did).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["KNOBS", "KforgeEnvError", "Knob", "flag", "text"]

_ON = frozenset({"1", "true", "on", "yes"})
_OFF = frozenset({"0", "false", "off", "no"})


class KforgeEnvError(ValueError):
    """An environment variable kforge reads holds a value it does not understand."""


@dataclass(frozen=True)
class Knob:
    """One environment variable: its name, kind ("flag", "path" or "text"), default and meaning."""

    name: str
    kind: str
    default: bool | None
    doc: str


KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("KFORGE_KERNEL_DIR", "path", None, "directory of the kernel sources (<name>.cu and headers)"),
    Knob("KFORGE_CACHE_DIR", "path", None, "disk cache directory"),
    Knob("KFORGE_DISK_CACHE", "flag", True, "read and write compiled kernels in the disk cache"),
    Knob("KFORGE_NVRTC", "path", None, "libnvrtc to load before searching"),
    Knob("KFORGE_FUSION", "flag", True, "kforge's fusion executor in kforge.executors()"),
    Knob("KFORGE_DEPENDENT_LAUNCH", "flag", True, "programmatic dependent launches (sm_90+)"),
    Knob("KFORGE_LOOKASIDES", "flag", True, "kforge.lookasides: module calls and Tensor methods traced faster"),
    Knob("KFORGE_TRACE_CACHE", "flag", True, "kforge.jit / kforge.compile keep Thunder's compiled programs on disk (kforge.trace_cache)"),
    Knob("KFORGE_GEMM", "flag", True, "the traces' GEMMs called on kforge's cached cuBLASLt plans (kforge.ops.gemm)"),
    Knob("KFORGE_GEMM_TUNE", "flag", True, "time cuBLASLt's candidate kernels per GEMM shape once and keep the fastest"),
    Knob("KFORGE_CE_FUSED", "flag", False, "cross-entropy's unit gradient written by the forward kernel (one read of "
         "the logits), scaled by the loss gradient in the backward (kforge.ops.cross_entropy)"),
    Knob("KFORGE_COMMIT", "text", None, "commit that kforge.bench records"),
)}


def _knob(name: str, kind: str) -> Knob:
    knob = KNOBS.get(name)
    if knob is None or knob.kind not in ((kind,) if kind == "flag" else ("path", "text")):
        raise KeyError(f"{name} is not a kforge {kind} variable (see kforge._env.KNOBS)")
    return knob


def flag(name: str) -> bool:
    """The boolean environment variable `name` (one of `KNOBS`); its default when unset or empty.
    Raises KforgeEnvError naming the variable for a value that is neither on nor off."""
    knob = _knob(name, "flag")
    raw = os.environ.get(name)
    value = "" if raw is None else raw.strip().lower()
    if not value:
        return bool(knob.default)
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise KforgeEnvError(f"{name}={raw!r} is not understood: use 1 / true / on / yes or 0 / false / off / no "
                         f"(any case); unset, it means {'on' if knob.default else 'off'} ({knob.doc})")


def text(name: str) -> str | None:
    """The path or text variable `name` (one of `KNOBS`), None when unset or empty."""
    _knob(name, "text")
    return os.environ.get(name) or None

"""Locating kernel sources, NVRTC and the cache directory, and configuring kforge._C with them."""
from __future__ import annotations

import glob
import os
import sys
import warnings
from pathlib import Path


class KforgeCacheWarning(RuntimeWarning):
    """A kernel cache file was unusable (truncated, corrupted) and has been recompiled."""


# The kernels use sm_80 PTX (cvt.rn.bf16.f32 for bf16 stores): older targets fail in ptxas.
MIN_ARCH = 80


def check_arch(arch: object, who: str) -> int:
    """`arch` as an int when kforge can compile for sm_<arch>, else ValueError naming `who`."""
    if isinstance(arch, bool) or not isinstance(arch, int):
        raise ValueError(f"{who}: arch must be an int such as {MIN_ARCH} (sm_{MIN_ARCH}), got {arch!r}")
    if arch < MIN_ARCH:
        raise ValueError(f"{who}: sm_{arch} is not supported; sm_{MIN_ARCH} is the minimum architecture "
                         f"kforge supports")
    return arch


def kernel_dir() -> str:
    """Directory holding the kernel sources (`<name>.cu`, headers)."""
    env = os.environ.get("KFORGE_KERNEL_DIR")
    if env:
        return env
    here = Path(__file__).resolve().parent
    installed = here / "kernels_src"  # copied in by setup.py's build_py
    if installed.is_dir():
        return str(installed)
    return str(here.parent.parent / "kernels_src")  # editable install / source checkout


def cache_dir() -> str:
    """Disk cache directory: $KFORGE_CACHE_DIR, else ~/.cache/kforge (XDG_CACHE_HOME honoured)."""
    env = os.environ.get("KFORGE_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kforge")


def disk_cache_enabled() -> bool:
    return os.environ.get("KFORGE_DISK_CACHE", "1") not in ("0", "false", "False", "no")


def nvrtc_candidates() -> list[str]:
    """libnvrtc candidates, best first: $KFORGE_NVRTC, the one the CUDA torch wheel ships (matching
    torch's CUDA), one already on the loader path, then the CUDA toolkit."""
    out: list[str] = []
    env = os.environ.get("KFORGE_NVRTC")
    if env:
        out.append(env)
    major = None
    try:
        import torch

        if torch.version.cuda:
            major = torch.version.cuda.split(".")[0]
    except Exception:  # torch missing or broken: still try the toolkit
        pass
    pats = [f"libnvrtc.so.{major}"] if major else []
    pats.append("libnvrtc.so.*[0-9]")
    for sp in sys.path:
        for sub in ("nvidia/cu*/lib", "nvidia/cuda_nvrtc/lib"):
            for pat in pats:
                out.extend(sorted(glob.glob(os.path.join(sp, sub, pat))))
    if major:
        out.append(f"libnvrtc.so.{major}")
    out.append("libnvrtc.so")
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            out.extend(sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*"))))
    seen: set[str] = set()
    return [p for p in out if not (p in seen or seen.add(p))]


def _warn(msg: str) -> None:
    warnings.warn(msg, KforgeCacheWarning, stacklevel=2)


def configure(C) -> None:
    C.configure(kernel_dir(), cache_dir(), disk_cache_enabled(), nvrtc_candidates())
    C.set_warning_handler(_warn)

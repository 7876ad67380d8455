"""The dev/ probes that patch kernel sources by matching their text still find their anchors, and the
patched kernels still compile (NVRTC, no GPU needed). Opt-in, not part of `pytest tests`:

    PYTHONPATH=python python3 -m pytest -q dev/tests

A failure here means a kernel changed under a probe: update the probe's anchors (or retire it).
"""
from __future__ import annotations

import importlib.util
import pathlib
import shutil

import kforge

DEV = pathlib.Path(__file__).resolve().parent.parent


def load_probe(name: str):
    spec = importlib.util.spec_from_file_location(name, DEV / f"{name}.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


def test_ring_timeline_probe_still_patches_and_compiles(tmp_path):
    # dev/ring_timeline.py finds its places in the ring kernel by anchor text: they still match,
    # and the patched kernel compiles (NVRTC, sm_90), so the probe does not rot when the kernel changes.
    probe = load_probe("ring_timeline")
    patched = probe.patched_kernel_dir()
    kforge._C.set_cache(str(tmp_path), False)
    try:
        src = pathlib.Path(patched, "rmsnorm.cu").read_text()
        assert src.count("%%globaltimer") == 4
        names = kforge._C.compile_source("rmsnorm", patched,
                                         ["rmsnorm_backward_ring_kernel<bf16, 4, 3, true, 384>"], 90)
        assert len(names) == 1
    finally:
        kforge._C.set_cache(kforge.cache_dir(), kforge._runtime.disk_cache_enabled())
        shutil.rmtree(patched)


def test_ring_dynamic_probe_still_patches_and_compiles(tmp_path):
    # dev/ring_dynamic_probe.py (docs/experiments/rmsnorm.md, 5d12b31) replaces the ring kernel's row loop
    # by anchor text: the anchors still match and both patched kernels compile (NVRTC, sm_90).
    probe = load_probe("ring_dynamic_probe")
    dynamic, static = probe.write(tmp_path / "probe")
    assert "atomicAdd(&kf_dyn_next" in (dynamic / "rmsnorm.cu").read_text()
    assert "atomicAdd(&kf_dyn_next" not in (static / "rmsnorm.cu").read_text()
    kforge._C.set_cache(str(tmp_path / "cache"), False)
    try:
        for d in (dynamic, static):
            names = kforge._C.compile_source("rmsnorm", str(d),
                                             ["rmsnorm_backward_ring_kernel<bf16, 4, 3, true, 384>"], 90)
            assert len(names) == 1
    finally:
        kforge._C.set_cache(kforge.cache_dir(), kforge._runtime.disk_cache_enabled())

"""Shared test machinery: the GPU marker, per-dtype tolerances, references and poisoned outputs."""
from __future__ import annotations

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
NO_GPU_REASON = "needs a CUDA GPU (run the GPU suite on the GPU machine)"

# Use as a decorator / pytestmark on every test that launches a kernel.
gpu = pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)

# Relative error ||out - ref|| / ||ref|| against a float64 reference computed from the same
# (rounded) inputs. fp32 kernels accumulate in fp32: well under 1e-5 for these sizes; bf16/fp16
# results carry one output rounding (2^-8 / 2^-11 relative) plus fp32 accumulation.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
# Element-wise bound used alongside REL_TOL, in units of the output dtype's epsilon times |ref|.
DTYPES = [torch.float32, torch.bfloat16]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN/inf in `out` where `ref` is finite gives inf."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64[torch.isfinite(ref64)]).all():
        return float("inf")
    denom = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    return num / denom if denom > 0 else num


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "",
                 tol: float | None = None) -> None:
    """Relative-error check with the per-dtype tolerance (or `tol`); shapes must match exactly."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = rel_err(out, ref)
    limit = REL_TOL[dtype] if tol is None else tol
    assert err <= limit, f"{what}: relative error {err:.3e} > {limit:.1e} ({dtype})"


def randn(*shape, dtype=torch.float32, device="cuda", scale=1.0, seed=None) -> torch.Tensor:
    """Random normal test data (never zeros), generated in fp32 then cast."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


@pytest.fixture(autouse=True, scope="session")
def _poison_outputs():
    """Every output a kforge launcher allocates starts as NaN, so unwritten elements fail tests."""
    import kforge

    kforge._C.set_poison_outputs(True)
    yield
    kforge._C.set_poison_outputs(False)

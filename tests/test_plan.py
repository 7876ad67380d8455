"""kforge._C.plan: the dispatch of the multi-layout launchers, asked on the CPU (no GPU needed).

The launchers launch exactly what these plans say (src/ops/<op>_plan.h), so every layout an op has
must be reachable by some input, and every plan must respect the limits the kernels are compiled
for (launch bounds, the device's shared memory)."""
from __future__ import annotations

import itertools

import pytest
import torch

kforge = pytest.importorskip("kforge")
C = kforge._C

# (SM count, opt-in shared memory per block): H100 SXM, A100 (sm_80), an sm_86 card.
DEVICES = [(132, 232448), (108, 166912), (84, 101376)]
DTYPES = ["float32", "bfloat16", "float16"]
ROWS = [1, 3, 64, 4096, 1 << 20, (1 << 30) + 1, 1 << 31]
COLS = [1, 7, 8, 64, 100, 256, 512, 768, 1000, 1024, 1025, 1536, 2048, 2056, 3000, 4096, 5000,
        8192, 16384, 50257]

# The head copies: token-major input (with n_head) or head-major input, and the parts of a token row.
PERMUTE = {"split_qkv_forward": (True, 3), "split_qkv_backward": (False, 3),
           "merge_heads_forward": (False, 1), "merge_heads_backward": (True, 1)}

# Threads per block the kernels are compiled for (their __launch_bounds__ / launch_params.cuh).
MAX_THREADS = {
    ("layernorm_forward", "group"): 384,   # kGroupFwdWarps warps
    ("layernorm_forward", "warp"): 128,    # kFwdWarps warps
    ("layernorm_backward", "ring"): 768,   # kRingThreads
    ("layernorm_backward", "group"): 768,  # ln_group_bwd_warps: at most 24 warps
    ("layernorm_backward", "warp"): 768,   # ln_bwd_warps: at most 24 warps
    ("rmsnorm_forward", "warp"): 256,
    ("rmsnorm_forward", "block"): 256,
    ("add_rmsnorm_forward", "warp"): 256,
    ("add_rmsnorm_forward", "block"): 256,
    ("rmsnorm_backward", "plain"): 512,
    ("rmsnorm_backward", "pipelined"): 512,
    ("rmsnorm_backward", "ring"): 512,
    ("softmax_forward", "warps"): 512,
    ("softmax_forward", "warp"): 128,
    ("softmax_backward", "warp"): 128,
    ("cross_entropy_backward", "vec"): 256,
    ("cross_entropy_backward", "scalar"): 256,
    ("rope_forward", "tile"): 256,       # kTileThreads
    ("rope_forward", "token"): 128,
    ("rope_backward", "tile"): 256,
    ("rope_backward", "token"): 128,
    ("gelu_forward", "packs"): 256,
    ("gelu_forward", "scalar"): 256,
    ("gelu_backward", "packs"): 256,
    ("gelu_backward", "scalar"): 256,
    ("colsum_forward", "vec"): 256,      # 32 * kColsumRows, both kernels
    ("colsum_forward", "scalar"): 256,
    ("embedding_backward", "vec"): 256,  # kEmbThreads
    ("embedding_backward", "scalar"): 256,
    **{(op, "lanes"): 256 for op in PERMUTE},  # __launch_bounds__(256, ...)
    **{(op, "tiles"): 512 for op in PERMUTE},  # kMaxBlockX columns, or 256 threads for short rows
}


def permute_queries(op: str):
    """(shape, options) of the input op's launcher takes: token-major (B, T, parts * NH * HS) with
    n_head, or head-major (B, NH, T, HS) heads, contiguous, token-major views of a (B, T, parts * NH *
    HS) tensor or with padded rows (head_strides: the outputs are always new contiguous tensors)."""
    to_heads, parts = PERMUTE[op]
    for B, T, NH, HS in itertools.product((1, 4), (1, 7, 4096, 1 << 20), (1, 12, 32), (1, 6, 64, 128)):
        if to_heads:
            yield (B, T, parts * NH * HS), {"n_head": NH}
            continue
        yield (B, NH, T, HS), {}
        row = parts * NH * HS
        yield (B, NH, T, HS), {"head_strides": (T * row, HS, row)}
        yield (B, NH, T, HS), {"head_strides": (NH * T * (HS + 1), T * (HS + 1), HS + 1)}


def queries(op: str):
    if op in PERMUTE:
        yield from permute_queries(op)
        return
    if op == "embedding_backward":  # grad (N, C) and the rows of dW
        for shape, V in itertools.product(shapes(op), (1, 65, 1000, 50304)):
            yield shape, {"num_weights": V}
        return
    for shape in shapes(op):
        yield shape, {}


def shapes(op: str):
    if op.startswith("rope"):  # q (B, H, T, D)
        yield from itertools.product((1, 4), (1, 12, 32, 40000), (1, 7, 4096), (2, 6, 64, 128, 256, 2048))
        return
    for rows, cols in itertools.product(ROWS, COLS):
        if op.startswith("causal_softmax"):
            if rows in (1, 3, 64) or cols in (1, 7, 8):  # (..., T, T) scores: rows = batch * T
                yield (max(rows // cols, 1), cols, cols)
        elif op.startswith("cross_entropy") and rows > (1 << 30):
            continue  # N * chunks must fit gridDim.x; the launcher refuses these
        else:
            yield (rows, cols)


def all_plans(op: str):
    """(query, plan) for every shape / dtype / alignment / device of the grid the op accepts."""
    for (shape, options), dtype, aligned, (sms, optin) in itertools.product(
            queries(op), DTYPES, (True, False), DEVICES):
        try:
            p = C.plan(op, list(shape), dtype, aligned=aligned, sms=sms, smem_optin=optin, **options)
        except ValueError:  # rows past the op's longest (rmsnorm), as the launcher refuses them
            continue
        yield (shape, dtype, aligned, sms, optin, options), p


@pytest.fixture(scope="module")
def plans():
    return {op: list(all_plans(op)) for op in C.plan_ops()}


def test_plan_ops_cover_the_multi_layout_launchers():
    ops = set(C.plan_ops())
    for op in ("layernorm_forward", "layernorm_backward", "rmsnorm_forward", "add_rmsnorm_forward",
               "rmsnorm_backward", "softmax_forward", "softmax_backward", "causal_softmax_forward",
               "causal_softmax_backward", "cross_entropy_forward", "cross_entropy_backward",
               "cross_entropy_forward_backward", "gelu_forward", "gelu_backward", "rope_forward",
               "rope_backward", "colsum_forward", "embedding_backward", *PERMUTE):
        assert op in ops
        assert hasattr(C, op), op  # a plan names a real launcher


@pytest.mark.parametrize("op", sorted(C.plan_ops()))
def test_every_layout_is_reached(plans, op):
    layouts = C.plan_layouts(op)
    assert layouts and len(set(layouts)) == len(layouts)
    reached = {}
    for query, p in plans[op]:
        assert p["layout"] in layouts, (query, p)
        reached.setdefault(p["layout"], query)
    assert set(reached) == set(layouts), f"{op}: never chosen: {set(layouts) - set(reached)}"


@pytest.mark.parametrize("op", sorted(C.plan_ops()))
def test_plans_within_limits(plans, op):
    for (shape, dtype, aligned, sms, optin, options), p in plans[op]:
        gx, gy, gz = p["grid"]
        bx, by, bz = p["block"]
        threads = bx * by * bz
        assert 1 <= gx <= 2**31 - 1 and 1 <= gy <= 65535 and gz == 1, (shape, dtype, p)
        assert 1 <= threads <= 1024, (shape, dtype, p)
        # rope's per-token blocks and the permute tiles fit the row's chunks (and heads, tokens)
        if not op.startswith("rope") and not (op in PERMUTE and p["layout"] == "tiles"):
            assert threads >= 32 and threads % 32 == 0, (shape, dtype, p)  # whole warps
        assert threads <= MAX_THREADS.get((op, p["layout"]), 1024), (shape, dtype, p)
        assert 0 <= p["smem"] <= optin, (shape, dtype, optin, p)
        assert "{T}" in p["kernel"], p


def test_persistent_layouts_use_at_most_one_wave():
    """RING / GROUP / WARP backward and rmsnorm's ring / pipelined kernels: one block per SM."""
    for op, shape, dtype in [("layernorm_backward", (1 << 20, 768), "bfloat16"),
                             ("layernorm_backward", (1 << 20, 768), "float32"),
                             ("rmsnorm_backward", (1 << 20, 4096), "bfloat16")]:
        for sms in (1, 84, 132):
            p = C.plan(op, list(shape), dtype, sms=sms)
            assert p["grid"][0] <= sms, (op, sms, p)


def test_testing_variant_never_picks_group_or_ring():
    for shape, dtype in [((4096, 768), "float32"), ((4096, 768), "bfloat16"), ((4096, 1024), "float16")]:
        assert C.plan("layernorm_forward", list(shape), dtype, variant=1)["layout"] in ("warp", "block")
        assert C.plan("layernorm_backward", list(shape), dtype, variant=1)["layout"] in ("warp", "block")
        assert C.plan("rmsnorm_backward", list(shape), dtype, variant=1)["layout"] != "ring"


@pytest.mark.parametrize("y_dtype", ["bfloat16", "float16"])
def test_layernorm_narrow_y_kernels_are_instantiated(y_dtype):
    """A float32 LayerNorm storing a 16-bit out: where the plan is GROUP (16-byte units or
    element-wise) it names the narrow instantiation, a name expression of the program; other layouts
    keep the float32 kernel (the launcher converts after it). A 16-bit x is refused."""
    exprs = set(C.name_expressions("layernorm"))
    short = "bf16" if y_dtype == "bfloat16" else "half"
    for shape, aligned, group in (([8192, 768], True, True), ([33, 7], False, True), ([8192, 4096], True, False)):
        p = C.plan("layernorm_forward", shape, "float32", aligned=aligned, y_dtype=y_dtype)
        assert (p["layout"] == "group") == group, p
        want = f"layernorm_forward_group_kernel<{{T}}, {'true' if aligned else 'false'}, {short}>"
        assert (p["kernel"] == want) == group, p
        assert p["kernel"].replace("{T}", "float") in exprs, (p["kernel"], sorted(exprs))
    for dtype, y in (("bfloat16", "float32"), ("float32", "float64")):
        with pytest.raises(ValueError, match="only float32 x|got float64"):
            C.plan("layernorm_forward", [8192, 768], dtype, y_dtype=y)


def test_layernorm_backward_epilogue_kernels_are_instantiated():
    """The float32 backward adding dres and / or storing a 16-bit copy: the 16-byte GROUP plan names
    its epilogue instantiation (a name expression of the program); element-wise and other layouts keep
    the plain kernel (torch adds / converts after it)."""
    exprs = set(C.name_expressions("layernorm"))
    for res, copy, nz in ((True, None, 0), (False, "bfloat16", 1), (True, "float16", 2)):
        p = C.plan("layernorm_backward", [8192, 768], "float32", dresidual=res, copy_dtype=copy)
        assert p["kernel"] == f"layernorm_backward_group_kernel<{{T}}, true, {str(res).lower()}, {nz}>", p
        assert p["kernel"].replace("{T}", "float") in exprs
        for shape, aligned in (([33, 7], True), ([8192, 768], False), ([8192, 1600], True)):
            q = C.plan("layernorm_backward", shape, "float32", aligned=aligned, dresidual=res, copy_dtype=copy)
            assert q["kernel"] == C.plan("layernorm_backward", shape, "float32", aligned=aligned)["kernel"], q
    with pytest.raises(ValueError, match="only a float32 dx"):
        C.plan("layernorm_backward", [8192, 768], "bfloat16", copy_dtype="float16")


def test_known_choices():
    """The dispatch BENCHMARKS.md's measurements chose (src/ops/layernorm.cpp's header)."""
    assert C.plan("layernorm_forward", [8192, 768], "float32")["layout"] == "group"
    assert C.plan("layernorm_forward", [8192, 768], "bfloat16")["layout"] == "warp"
    assert C.plan("layernorm_backward", [8192, 768], "bfloat16")["layout"] == "ring"
    assert C.plan("layernorm_backward", [8192, 768], "float32")["layout"] == "group"
    assert C.plan("layernorm_forward", [8192, 4096], "float32")["layout"] == "block"
    assert C.plan("layernorm_forward", [8192, 768], "bfloat16")["kernel"] == \
        "layernorm_forward_warp_kernel<{T}, true, 3>"
    assert C.plan("softmax_forward", [8192, 768], "bfloat16")["layout"] == "warps"
    assert C.plan("softmax_forward", [8192, 768], "bfloat16", aligned=False)["layout"] == "stream"
    assert C.plan("cross_entropy_backward", [8, 50257], "bfloat16")["chunks"] == 7
    assert C.plan("gelu_forward", [8192, 3072], "bfloat16", approximate="none")["kernel"] == \
        "gelu_forward_kernel<{T}, true>"
    assert C.plan("gelu_backward", [8192, 3072], "float32", aligned=False)["layout"] == "scalar"


def test_plan_bad_input():
    with pytest.raises(ValueError, match="no plan"):
        C.plan("swiglu_forward", [4, 4], "float32")
    with pytest.raises(ValueError, match="dtype"):
        C.plan("softmax_forward", [4, 4], "float64")
    assert C.plan("softmax_forward", [0, 4], "float32")["layout"] is None
    import torch

    assert C.plan("softmax_forward", [4, 4], torch.float32) == C.plan("softmax_forward", [4, 4], "float32")


def test_plans_name_the_launchers_kernels(plans):
    """The kernels a colsum / permute plan names are the ones their launchers instantiate."""
    exprs = {"colsum": set(C.name_expressions("colsum")), "permute": set(C.name_expressions("permute"))}
    ctype = {"float32": "float", "bfloat16": "bf16", "float16": "half"}
    for op in ("colsum_forward", *PERMUTE):
        names = exprs["colsum" if op == "colsum_forward" else "permute"]
        for query, p in plans[op]:
            T = ctype[query[1]]
            assert p["kernel"].replace("{T}", T) in names, (query, p)
            if op == "colsum_forward":
                assert p["final_kernel"].replace("{T}", T) in names, (query, p)


def test_colsum_plans_cover_every_row_and_column(plans):
    """The partial sums: (tiles, G) blocks of rows_per_chunk rows (a multiple of 32) cover the N rows
    with no empty chunk and every column; the fold: final_grid blocks of the same shape over C."""
    for (shape, dtype, aligned, sms, optin, _), p in plans["colsum_forward"]:
        N, C_ = shape[0], shape[-1]
        tiles, G, _z = p["grid"]
        rpc, unit = p["rows_per_chunk"], (4 if dtype == "float32" else 8) if p["vec"] else 1
        assert p["layout"] == ("vec" if p["vec"] else "scalar")
        assert rpc % 32 == 0 and (G - 1) * rpc < N <= G * rpc and G <= p["chunks"], (shape, p)
        assert (tiles - 1) * 32 * unit < C_ <= tiles * 32 * unit, (shape, p)
        assert p["final_block"] == p["block"] == (32, 8, 1), p
        fx, fy, fz = p["final_grid"]
        assert (fx - 1) * 32 < C_ <= fx * 32 and fy == fz == 1, (shape, p)
        if not aligned:
            assert not p["vec"], (shape, p)


def test_permute_plans_cover_every_token(plans):
    """The lanes: K tokens per round in `lanes` lanes of `cols` threads (one 256-thread block per 256
    of them); the tiles: the row's columns over blockIdx.x, 4 tokens per lane and tile."""
    for op, (to_heads, parts) in PERMUTE.items():
        for (shape, dtype, aligned, sms, optin, options), p in plans[op]:
            B, T = shape[0], shape[1] if to_heads else shape[2]
            row = shape[2] if to_heads else parts * shape[1] * shape[3]
            assert p["cols"] == (row // (4 if dtype == "float32" else 8) if p["vec"] else row), (shape, p)
            if not aligned:
                assert not p["vec"], (shape, p)
            if p["layout"] == "lanes":
                assert p["K"] in (1, 2, 4) and p["lanes"] <= B * T, (shape, p)
                assert p["grid"][0] == -(-p["lanes"] * p["cols"] // 256) and p["block"] == (256, 1, 1), p
            else:
                bx, by, _ = p["block"]
                assert (p["grid"][0] - 1) * bx < p["cols"] <= p["grid"][0] * bx, (shape, p)
                assert p["tiles_per_seq"] * 4 * by >= T and p["units"] == B * p["tiles_per_seq"], (shape, p)


def test_permute_tiles_where_lane_strides_pass_4_gib():
    """The lanes' byte strides are 32-bit: a head part of 2^32 elements (bfloat16: 8 GiB) runs the
    tiles, as does a token row past 4 GiB; anything smaller the lanes."""
    heads = [1, 32, 1 << 20, 128]  # (B, NH, T, HS): a head part of 2^32 elements
    assert C.plan("merge_heads_forward", heads, "bfloat16")["layout"] == "tiles"
    assert C.plan("split_qkv_backward", heads, "bfloat16")["layout"] == "tiles"
    assert C.plan("split_qkv_forward", [1, 1 << 20, 3 * 4096], "bfloat16", n_head=32)["layout"] == "tiles"
    assert C.plan("merge_heads_backward", [1, 1 << 20, 4096], "float32", n_head=32)["layout"] == "tiles"
    assert C.plan("split_qkv_forward", [1, 1, 3 << 29], "float32", n_head=1)["layout"] == "tiles"
    assert C.plan("split_qkv_forward", [4, 1, 3 << 20], "bfloat16", n_head=8)["layout"] == "lanes"
    p = C.plan("split_qkv_forward", [8, 1024, 3 * 768], "bfloat16", n_head=12)
    assert p["kernel"] == "permute_lanes_kernel<{T}, true, true, 4>" and p["vec"], p
    p = C.plan("merge_heads_forward", [8, 12, 1024, 64], "bfloat16", aligned=False)
    assert p["kernel"] == "permute_lanes_kernel<{T}, false, false, 4>", p


def test_plan_errors_where_the_launcher_raises():
    # colsum: gridDim.y holds at most 65535 row chunks (about 4 blocks per SM: only past 16383 SMs)
    assert C.plan("colsum_forward", [1 << 22, 1], "float32", sms=16383)["grid"][1] <= 65535
    with pytest.raises(ValueError, match=r"too many row chunks \(65536\)"):
        C.plan("colsum_forward", [1 << 22, 1], "float32", sms=16384)
    with pytest.raises(ValueError, match="last dim C too large"):
        C.plan("colsum_forward", [2, 1 << 30], "float32")
    # permute: the launchers' shape checks and int sizes
    with pytest.raises(ValueError, match="n_head must be given"):
        C.plan("split_qkv_forward", [2, 4, 24], "float32")
    with pytest.raises(ValueError, match=r"not 3 \* n_head"):
        C.plan("split_qkv_forward", [2, 4, 24], "float32", n_head=5)
    with pytest.raises(ValueError, match="not a multiple of n_head"):
        C.plan("merge_heads_backward", [2, 4, 24], "float32", n_head=5)
    with pytest.raises(ValueError, match=r"must be \(B, NH, T, HS\)"):
        C.plan("merge_heads_forward", [2, 4, 24], "float32")
    with pytest.raises(ValueError, match="sizes too large"):
        C.plan("split_qkv_forward", [1 << 16, 1 << 15, 3], "float32", n_head=1)
    with pytest.raises(ValueError, match="sizes too large"):
        C.plan("merge_heads_forward", [1, 1 << 16, 1, 1 << 15], "float32")
    assert C.plan("merge_heads_forward", [1, 1 << 16, 1, (1 << 15) - 1], "float32")["layout"] == "tiles"
    with pytest.raises(ValueError, match="head_strides"):
        C.plan("split_qkv_forward", [2, 4, 24], "float32", n_head=2, head_strides=(96, 4, 8))


# ---- the testing override (variant / max_warps off the public bindings) ------------------------------
def test_public_bindings_take_no_variant_or_max_warps():
    x = torch.zeros(2, 8)
    for name in ("layernorm_forward", "layernorm_backward", "rmsnorm_backward"):
        doc = getattr(C, name).__doc__
        assert "variant" not in doc and "max_warps" not in doc, doc
    with pytest.raises(TypeError):
        C.layernorm_forward(x, None, None, 1e-5, variant=1)
    with pytest.raises(TypeError):
        C.layernorm_forward(x, None, None, 1e-5, max_warps=4)
    with pytest.raises(TypeError):
        C.rmsnorm_backward(x, x, None, torch.zeros(2), variant=1)


def test_testing_override_sets_and_restores():
    from kforge._testing import override

    assert set(C._testing_override_ops()) == {"layernorm_forward", "layernorm_backward", "rmsnorm_backward", "permute"}
    assert C._testing_override("layernorm_backward") == (0, 0)
    with override("layernorm_backward", variant=1, max_warps=6):
        assert C._testing_override("layernorm_backward") == (1, 6)
        assert C._testing_override("layernorm_forward") == (0, 0)
        with override("layernorm_backward"):
            assert C._testing_override("layernorm_backward") == (0, 0)
        assert C._testing_override("layernorm_backward") == (1, 6)
    assert C._testing_override("layernorm_backward") == (0, 0)
    with pytest.raises(RuntimeError):
        with override("rmsnorm_backward", variant=1):
            raise RuntimeError("restored on the way out")
    assert C._testing_override("rmsnorm_backward") == (0, 0)


def test_testing_override_rejects_bad_values():
    from kforge._testing import override

    for op, last in (("layernorm_forward", 1), ("layernorm_backward", 1), ("rmsnorm_backward", 2), ("permute", 1)):
        for v in (-1, last + 1):
            with pytest.raises(kforge.KforgeError, match=rf"{op}: variant must be in \[0, {last}\], got {v}"):
                with override(op, variant=v):
                    pass
        assert C._testing_override(op) == (0, 0)
    with pytest.raises(kforge.KforgeError, match="max_warps must be >= 0"):
        with override("layernorm_forward", max_warps=-1):
            pass
    with pytest.raises(kforge.KforgeError, match="rmsnorm_backward: takes no max_warps"):
        with override("rmsnorm_backward", max_warps=4):
            pass
    with pytest.raises(ValueError, match="no testing override"):
        with override("softmax_forward", variant=1):
            pass

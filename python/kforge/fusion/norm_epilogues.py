"""Additions and conversions around kforge's RMSNorm (and LayerNorm) kernels done by those kernels.

Under autocast (fp32 weights, 16-bit matmuls) a Llama keeps its residual stream in float32, so the
pattern pass's `add_rms_norm` (one dtype on both sides of the add) does not apply, and the norms'
neighbours are separate kernels. The fusion pass hands four of them to the norm kernels:

fold_residual_grads: the backward of `h = x + f(norm(x))` adds the residual's gradient to the norm's
    input gradient. `add(dres, kforge_rmsnorm_backward(dy, x, ...)[0])`, where the norm's dx is read
    by that add alone, becomes `kforge_add_rmsnorm_backward(dy, dres, x, ...)`: the backward kernel
    adds dres before its one store (`dresidual`; in fp32, within an ulp of eager's sum, as the last
    multiply and the add may be one FMA), and no add kernel re-reads dx.
narrow_norm_outputs: the norm of the fp32 stream is read only by a conversion to the matmuls' 16-bit
    type. `convert(kforge_rmsnorm_forward(x, ...)[0], bf16)` becomes `kforge_rmsnorm_forward(x, ...,
    y_dtype=bf16)`: the kernel stores y as bf16, rounded once from its fp32 result as the conversion
    did, so neither the fp32 y nor a conversion kernel's pass over it is left (through a shallow copy
    between them too: Hugging Face's lm_head slice of the last norm's output). LayerNorm's forward
    (GPT-2 under autocast) the same way: `kforge_layernorm_forward(x, weight, bias, eps, bf16)`.
fold_branch_adds: the norm's input is the fp32 stream plus a 16-bit branch (the attention's or the
    MLP's output projection) upcast, `add(h, convert(b16, float32))`. The add and the conversion
    become part of the norm: `kforge_add_rmsnorm_forward(b16, h, ...)` reads the branch as bf16, adds
    it in fp32 (eager's upcast and add, bit for bit) and writes s (the stream) itself, so s is not
    written and read back between two kernels.
copy_norm_grads: the stream's gradient (an fp32 norm backward's dx) is also what the 16-bit matmul
    that wrote the branch needs, `convert(dx, bf16)`: the norm backward (with or without its residual
    gradient) becomes `kforge_rmsnorm_backward_copy(dy, x, weight, rstd, ..., dresidual, bf16)`, whose
    kernel stores dx twice, fp32 and rounded once to bf16 (the conversion's value, bit for bit), so no
    conversion kernel re-reads dx.

drop_zero_dresiduals: a norm backward's residual gradient that is a tensor of zeros made for it alone
    (the last `add_rms_norm`'s s, which nothing else reads, gets a zero gradient from Thunder) is
    passed as None: neither the zeros nor the kernel's read of them (12.6 MB each at 8192 x 768 bf16).
sum_norm_grads: the norm's output is read by two or three 16-bit matmuls (a Llama's q / k / v, or w1
    / w3), so its gradient dy is their input gradients, each upcast, added in fp32:
    `add(add(convert(g1), convert(g2)), convert(g3))`. The norm backward (any of the forms above)
    becomes `kforge_rmsnorm_backward_sum(g1, g2, g3, x, ...)`, whose kernel reads the 16-bit terms
    and adds them in the same order, so the fp32 dy is neither written nor read back (three 16-bit
    terms: 37.7 MB read instead of 37.7 read, 25.2 written and 25.2 read again at 8192 x 768).

LayerNorm (GPT-2 under autocast) takes the first four: its output stored bf16 (`narrow_norm_outputs`), the
branch added before it (`kforge_add_layernorm_forward(b16, h, weight, bias, eps, y_dtype) -> (y,
mean, rstd, s)`), its backward adding the residual's gradient (`kforge_layernorm_backward(...,
dresidual)`, fp32 x) and storing the bf16 copy (`kforge_layernorm_backward_copy`). Its kernel does
them for fp32 rows of up to 1024 columns (the GROUP layout; the add and the backward's two in
16-byte units); other rows get torch's add and conversion around the plain kernel.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

__all__ = ["copy_norm_grads", "drop_zero_dresiduals", "fold_branch_adds", "fold_residual_grads", "narrow_norm_outputs",
           "sum_norm_grads"]


def fold_residual_grads(bsyms: Sequence[Any], devices: Sequence[str] = ("cuda",)) -> tuple[list, int]:
    """`bsyms` (a trace's top-level bound symbols) with each residual gradient added in its RMSNorm
    backward (see the module docstring); returns (new bound symbols, number of adds removed). The new
    call takes the norm's place, so dres must be made before it (it always is in Thunder's backward:
    the residual's gradient comes from the later layers)."""
    from thunder.core import dtypes

    from ..ops.layernorm import layernorm_backward
    from ..ops.rmsnorm import add_rmsnorm_backward, rmsnorm_backward
    from .matmul_acc import _is_add, _Trace, _side, spliced

    tr = _Trace(bsyms)
    replace: dict[int, Any] = {}
    drop: set[int] = set()
    for i, b in enumerate(tr.bsyms):
        if not _is_add(b):
            continue
        for which in (0, 1):
            dx, dres = b.args[which], b.args[1 - which]
            j = tr.producer.get(dx.name)
            if j is None or j in replace:
                continue
            if tr.bsyms[j].sym.id == layernorm_backward.id:  # (dout, x, weight, bias, mean, rstd[, dres])
                norm = tr.bsyms[j]
                if (norm.output[0].name != dx.name or len(norm.args) > 6 and norm.args[6] is not None
                        or not tr.only_reader(dx.name, i) or _side(norm) != _side(b)):
                    continue
                k = tr.producer.get(dres.name)
                x = norm.args[1]
                if ((k is not None and k >= j) or dx.device.type not in devices or x.dtype != dtypes.float32
                        or dres.dtype != x.dtype or tuple(dres.shape) != tuple(x.shape)):
                    continue
                nb = layernorm_backward.bind(*norm.args[:6], dres, output=(b.flat_outs[0], *norm.output[1:]))
                nb.tags.update(norm.tags)
                replace[j] = nb
                drop.add(i)
                break
            if tr.bsyms[j].sym.id != rmsnorm_backward.id:
                continue
            norm = tr.bsyms[j]
            outs = norm.output
            if outs[0].name != dx.name:  # dweight, not dx
                continue
            if not tr.only_reader(dx.name, i) or _side(norm) != _side(b):
                continue
            k = tr.producer.get(dres.name)
            if k is not None and k >= j:  # dres must exist where the norm's backward runs
                continue
            dy, x = norm.args[0], norm.args[1]
            if dx.device.type not in devices or dres.dtype != x.dtype or tuple(dres.shape) != tuple(x.shape):
                continue
            weight, rstd, ndim, cbw = norm.args[2:6]
            nb = add_rmsnorm_backward.bind(dy, dres, x, weight, rstd, ndim, cbw, output=(b.flat_outs[0], outs[1]))
            nb.tags.update(norm.tags)
            replace[j] = nb
            drop.add(i)
            break
    return spliced(tr, replace, drop)


def narrow_norm_outputs(bsyms: Sequence[Any], devices: Sequence[str] = ("cuda",)) -> tuple[list, int]:
    """`bsyms` with each fp32 RMSNorm or LayerNorm whose output only a conversion to bf16 / fp16 reads
    storing that type itself (see the module docstring); returns (new bound symbols, number of
    conversions removed).
    Run after `dedupe_views`, which leaves one conversion of a tensor to a dtype."""
    from thunder.core import dtypes

    from ..ops.layernorm import layernorm_forward
    from ..ops.rmsnorm import rmsnorm_forward
    from .matmul_acc import _Trace, _side, is_conversion, spliced

    # each norm's arguments before y_dtype: rmsnorm (x, weight, eps, ndim, cbw), layernorm (x, weight,
    # bias, eps)
    n_args = {rmsnorm_forward.id: 5, layernorm_forward.id: 4}
    tr = _Trace(bsyms)
    replace: dict[int, Any] = {}
    drop: set[int] = set()
    for j, norm in enumerate(tr.bsyms):
        n = n_args.get(norm.sym.id)
        if n is None or (len(norm.args) > n and norm.args[n] is not None):
            continue
        x, y = norm.args[0], norm.output[0]
        if x.dtype != dtypes.float32 or y.device.type not in devices:
            continue
        readers = tr.readers.get(y.name, set())
        if len(readers) != 1:
            continue
        i = next(iter(readers))
        gone = [i]
        # Hugging Face's lm_head reads the last norm through `hidden_states[:, slice]`, a shallow_copy
        # of the whole tensor: the conversion after it is the norm's too
        if tr.bsyms[i].sym.name == "shallow_copy" and len(tr.bsyms[i].flat_proxy_args) == 1:
            copy_out = tr.bsyms[i].flat_outs[0]
            after = tr.readers.get(copy_out.name, set())
            if len(after) != 1 or _side(tr.bsyms[i]) != _side(norm):
                continue
            i = next(iter(after))
            gone.append(i)
        cast = tr.bsyms[i]
        out = cast.flat_outs[0] if len(cast.flat_outs) == 1 else None
        if (not is_conversion(cast) or out is None or out.dtype not in (dtypes.bfloat16, dtypes.float16)
                or tuple(out.shape) != tuple(y.shape) or _side(cast) != _side(norm)):
            continue
        nb = norm.sym.bind(*norm.args[:n], dtypes.to_torch_dtype(out.dtype), output=(out, *norm.output[1:]))
        nb.tags.update(norm.tags)
        replace[j] = nb
        drop.update(gone)
    return spliced(tr, replace, drop)


def fold_branch_adds(bsyms: Sequence[Any], devices: Sequence[str] = ("cuda",)) -> tuple[list, int]:
    """`bsyms` with each fp32 RMSNorm (LayerNorm) of `stream + upcast 16-bit branch` made one
    `kforge_add_rmsnorm_forward` (`kforge_add_layernorm_forward`) at the add's place (see the module
    docstring); returns (new bound symbols, number of adds and conversions removed). Run after
    `narrow_norm_outputs`: an RMSNorm storing 16-bit y keeps it when that is the branch's type (the
    kernels' pairing); a LayerNorm keeps any."""
    from thunder.core import dtypes

    from ..ops.layernorm import add_layernorm_forward, layernorm_forward
    from ..ops.rmsnorm import add_rmsnorm_forward, rmsnorm_forward
    from .matmul_acc import _is_add, _Trace, _side, is_conversion, spliced

    # per norm: its adding op, the number of its arguments before y_dtype, and whether y must be the
    # branch's type when 16-bit (rmsnorm's kernels pair them; LayerNorm's take any y)
    kinds = {rmsnorm_forward.id: (add_rmsnorm_forward, 5, True),
             layernorm_forward.id: (add_layernorm_forward, 4, False)}
    tr = _Trace(bsyms)
    replace: dict[int, Any] = {}
    drop: set[int] = set()
    for j, norm in enumerate(tr.bsyms):
        if norm.sym.id not in kinds:
            continue
        adding, n_args, paired = kinds[norm.sym.id]
        s = norm.args[0]
        i = tr.producer.get(s.name)
        # Hugging Face's `hidden_states.to(torch.float32)` of the fp32 stream: a shallow_copy between
        # the add and the norm, which stays (reading s from the new call)
        if i is not None and tr.bsyms[i].sym.name == "shallow_copy" and len(tr.bsyms[i].flat_proxy_args) == 1:
            s = tr.bsyms[i].flat_proxy_args[0]
            i = tr.producer.get(s.name)
        if i is None or i in replace or i in drop or not _is_add(tr.bsyms[i]) or s.dtype != dtypes.float32:
            continue
        add = tr.bsyms[i]
        if _side(add) != _side(norm) or s.device.type not in devices:
            continue
        y_dtype = norm.args[n_args] if len(norm.args) > n_args else None
        for which in (0, 1):
            up, h = add.args[which], add.args[1 - which]
            k = tr.producer.get(up.name)
            if k is None or k in drop or not tr.only_reader(up.name, i) or not is_conversion(tr.bsyms[k]):
                continue
            src = tr.bsyms[k].flat_proxy_args
            if len(src) != 1 or src[0].dtype not in (dtypes.bfloat16, dtypes.float16):
                continue
            b16 = src[0]
            if tuple(b16.shape) != tuple(s.shape) or (paired and y_dtype is not None
                                                      and dtypes.to_dtype(y_dtype) != b16.dtype):
                continue
            # the norm's other arguments (its weight) must exist where the add was
            if any((tr.producer.get(p.name, -1) >= i) for p in norm.flat_proxy_args[1:]):
                continue
            nb = adding.bind(b16, h, *norm.args[1:n_args], y_dtype, output=(*norm.output, s))
            nb.tags.update(norm.tags)
            replace[i] = nb
            drop.update((j, k))
            break
    return spliced(tr, replace, drop)  # each fold drops the norm and the conversion


def copy_norm_grads(bsyms: Sequence[Any], devices: Sequence[str] = ("cuda",)) -> tuple[list, int]:
    """`bsyms` with each fp32 RMSNorm backward whose dx a conversion to bf16 / fp16 reads storing that
    copy too (see the module docstring); returns (new bound symbols, number of conversions removed).
    Run after `fold_residual_grads` (whose add_rmsnorm_backward it takes as well) and `dedupe_views`
    (one conversion of a tensor to a dtype)."""
    from thunder.core import dtypes

    from ..ops.layernorm import layernorm_backward, layernorm_backward_copy
    from ..ops.rmsnorm import add_rmsnorm_backward, rmsnorm_backward, rmsnorm_backward_copy
    from .matmul_acc import _Trace, _side, is_conversion, spliced

    tr = _Trace(bsyms)
    replace: dict[int, Any] = {}
    drop: set[int] = set()
    for j, norm in enumerate(tr.bsyms):
        if norm.sym.id == rmsnorm_backward.id:  # (dy, x, weight, rstd, ndim, cbw)
            args, copying = (*norm.args[:6], None), rmsnorm_backward_copy
        elif norm.sym.id == add_rmsnorm_backward.id:  # (dy, dres, s, weight, rstd, ndim, cbw)
            args, copying = (norm.args[0], *norm.args[2:7], norm.args[1]), rmsnorm_backward_copy
        elif norm.sym.id == layernorm_backward.id:  # (dout, x, weight, bias, mean, rstd[, dres])
            args, copying = (*norm.args[:6], norm.args[6] if len(norm.args) > 6 else None), layernorm_backward_copy
        else:
            continue
        dx = norm.output[0]
        if dx.dtype != dtypes.float32 or dx.device.type not in devices:
            continue
        casts = []
        for i in sorted(tr.readers.get(dx.name, ())):
            cast = tr.bsyms[i]
            out = cast.flat_outs[0] if len(cast.flat_outs) == 1 else None
            if (is_conversion(cast) and out is not None and out.dtype in (dtypes.bfloat16, dtypes.float16)
                    and tuple(out.shape) == tuple(dx.shape) and _side(cast) == _side(norm)):
                casts.append(i)
        if not casts:
            continue
        i = casts[0]
        out = tr.bsyms[i].flat_outs[0]
        nb = copying.bind(*args, dtypes.to_torch_dtype(out.dtype), output=(dx, *norm.output[1:], out))
        nb.tags.update(norm.tags)
        replace[j] = nb
        drop.add(i)
    return spliced(tr, replace, drop)


def _grad_terms(tr: Any, p: Any, reader: int, side: bool, drop: list) -> list | None:
    """The 16-bit tensors whose upcasts' fp32 sum `p` (read by bound symbol `reader` alone) is, in the
    order of a left fold ((t0 + t1) + t2) that adds exactly as the trace does; None when `p` is not
    such a sum. Fills `drop` with the bound symbols the sum is made of (adds, conversions, reshapes)."""
    from thunder.core import dtypes

    from .matmul_acc import _is_add, _is_reshape, _side, is_conversion

    j = tr.producer.get(p.name)
    if j is None or not tr.only_reader(p.name, reader) or _side(tr.bsyms[j]) != side:
        return None
    b = tr.bsyms[j]
    if _is_add(b):
        left = _grad_terms(tr, b.args[0], j, side, drop)
        right = _grad_terms(tr, b.args[1], j, side, drop) if left is not None else None
        if right is None or (len(left) > 1 and len(right) > 1):  # (a + b) + (c + d): not a left fold
            return None
        drop.append(j)
        # a + (b + c) = (b + c) + a: fp32 addition commutes, so either side may be the nested sum
        return left + right if len(right) == 1 else right + left
    if _is_reshape(b):  # the conversion before the reshape
        terms = _grad_terms(tr, b.flat_proxy_args[0], j, side, drop)
        if terms is not None:
            drop.append(j)
        return terms
    out = b.flat_outs[0] if len(b.flat_outs) == 1 else None
    src = b.flat_proxy_args
    if (not is_conversion(b) or out is None or out.dtype != dtypes.float32 or len(src) != 1
            or src[0].dtype not in (dtypes.bfloat16, dtypes.float16)):
        return None
    drop.append(j)
    t = src[0]
    k = tr.producer.get(t.name)  # a reshape read by this conversion alone goes too: the kernel reads rows
    if k is not None and _is_reshape(tr.bsyms[k]) and tr.only_reader(t.name, j) and _side(tr.bsyms[k]) == side:
        drop.append(k)
        t = tr.bsyms[k].flat_proxy_args[0]
    return [t]


def sum_norm_grads(bsyms: Sequence[Any], devices: Sequence[str] = ("cuda",)) -> tuple[list, int]:
    """`bsyms` with each fp32 RMSNorm backward whose dy is the fp32 sum of two or three upcast 16-bit
    tensors reading those tensors itself (see the module docstring); returns (new bound symbols,
    number of bound symbols removed). Run after `copy_norm_grads` (it takes all three backward forms
    and keeps their dresidual and copy)."""
    from thunder.core import dtypes

    from ..ops.rmsnorm import add_rmsnorm_backward, rmsnorm_backward, rmsnorm_backward_copy, rmsnorm_backward_sum
    from .matmul_acc import _Trace, _side, spliced

    tr = _Trace(bsyms)
    replace: dict[int, Any] = {}
    drop: set[int] = set()
    for j, norm in enumerate(tr.bsyms):
        if norm.sym.id == rmsnorm_backward.id:  # (dy, x, weight, rstd, ndim, cbw)
            (dy, x, weight, rstd, ndim, cbw), dres, copy_dtype = norm.args[:6], None, None
        elif norm.sym.id == add_rmsnorm_backward.id:  # (dy, dres, s, weight, rstd, ndim, cbw)
            dy, dres, x, weight, rstd, ndim, cbw = norm.args[:7]
            copy_dtype = None
        elif norm.sym.id == rmsnorm_backward_copy.id:  # (dy, x, weight, rstd, ndim, cbw, dres, copy_dtype)
            dy, x, weight, rstd, ndim, cbw, dres, copy_dtype = norm.args[:8]
        else:
            continue
        if x.dtype != dtypes.float32 or x.device.type not in devices:
            continue
        gone: list[int] = []
        terms = _grad_terms(tr, dy, j, _side(norm), gone)
        if (terms is None or not 2 <= len(terms) <= 3 or len({t.dtype for t in terms}) != 1
                or any(math.prod(t.shape) != math.prod(x.shape) for t in terms)
                or any(i in drop or i in replace for i in gone)):
            continue
        outs = norm.output
        copy = outs[2] if len(outs) > 2 else None
        nb = rmsnorm_backward_sum.bind(*terms, *([None] * (3 - len(terms))), x, weight, rstd, ndim, cbw, dres,
                                       copy_dtype, output=(outs[0], outs[1], copy))
        nb.tags.update(norm.tags)
        replace[j] = nb
        drop.update(gone)
    return spliced(tr, replace, drop)


def _is_zeros(b: Any) -> bool:
    """torch.zeros, or torch.full / full_like with the value 0."""
    if b.sym.name == "zeros":
        return True
    if b.sym.name in ("full", "full_like"):
        value = b.args[1] if len(b.args) > 1 else b.kwargs.get("fill_value")
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0
    return False


def drop_zero_dresiduals(bsyms: Sequence[Any]) -> tuple[list, int]:
    """`bsyms` with each norm backward's residual gradient that is zeros read by that norm alone passed
    as None (see the module docstring); returns (new bound symbols, number of bound symbols removed)."""
    from ..ops.layernorm import layernorm_backward, layernorm_backward_copy
    from ..ops.rmsnorm import add_rmsnorm_backward, rmsnorm_backward_copy, rmsnorm_backward_sum
    from .matmul_acc import _Trace, spliced

    # the position of the residual gradient among each norm backward's arguments
    where = {add_rmsnorm_backward.id: 1, rmsnorm_backward_copy.id: 6, rmsnorm_backward_sum.id: 8,
             layernorm_backward.id: 6, layernorm_backward_copy.id: 6}
    tr = _Trace(bsyms)
    replace: dict[int, Any] = {}
    drop: set[int] = set()
    for j, norm in enumerate(tr.bsyms):
        pos = where.get(norm.sym.id)
        if pos is None or len(norm.args) <= pos or norm.args[pos] is None:
            continue
        dres = norm.args[pos]
        k = tr.producer.get(dres.name)
        if k is None or not _is_zeros(tr.bsyms[k]) or not tr.only_reader(dres.name, j):
            continue
        args = list(norm.args)
        args[pos] = None
        nb = norm.sym.bind(*args, output=norm.output)
        nb.tags.update(norm.tags)
        replace[j] = nb
        drop.add(k)
    return spliced(tr, replace, drop)

"""kforge.inplace: in-place ops on tensors only the trace sees are taken out of place before Thunder's
autograd, which otherwise saves the tensor the in-place write overwrites (wrong gradients, silently).
CPU, float64 against eager."""
from __future__ import annotations

import pytest
import torch

import thunder

from kforge.inplace import InPlaceIntermediates, take_out_of_place

F64 = torch.float64


def _jit(fn):
    from kforge.transforms import jit

    return jit(fn)


def _rewrites(jfn) -> int:
    """What the compilation's InPlaceIntermediates rewrote in its (one) computation trace."""
    t = next(t for t in thunder.compile_data(jfn).transforms if isinstance(t, InPlaceIntermediates))
    return t.rewrites[-1]


def _grads(fn, *shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.rand(s, generator=g, dtype=F64) + 0.5 for s in shapes]
    out_shape = fn(*[x.clone() for x in xs]).shape
    c = torch.randn(out_shape, generator=g, dtype=F64)
    ref_in = [x.clone().requires_grad_() for x in xs]
    (fn(*ref_in) * c).sum().backward()
    jfn = _jit(fn)
    got_in = [x.clone().requires_grad_() for x in xs]
    out = jfn(*got_in)
    (out * c).sum().backward()
    return jfn, [r.grad for r in ref_in], [t.grad for t in got_in]


def router(p):  # Hugging Face's MoE routers: the top-k weights renormalised in place
    w, _ = torch.topk(p, 2, dim=-1)
    w /= w.sum(dim=-1, keepdim=True)
    return w


def chain(p, q):
    w = p * q
    w.pow_(2)           # pow's backward needs w's old value
    w /= w.sum(-1, keepdim=True)
    w.mul_(q)
    return w * 3


def clamp_then_scale(p):
    w = p * 2.0
    w.clamp_(max=2.5)
    return w * w


@pytest.mark.parametrize("fn, shapes, want", [(router, [(7, 5)], 1), (chain, [(6, 4), (6, 4)], 3),
                                              (clamp_then_scale, [(3, 9)], 1)])
def test_gradients_match_eager_and_ops_go_out_of_place(fn, shapes, want):
    jfn, ref, got = _grads(fn, *shapes)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    assert _rewrites(jfn) == want
    final = thunder.last_traces(jfn)[-1]
    assert not [b for b in final.bound_symbols if b.sym.name in ("copy_", "copy_with_setitem")], final


def view_target(p):
    w = p * 1.0
    v = w[:, :2]        # a view: the write must reach w
    v /= 2.0
    return w


def earlier_view(p):
    w = p * 2.0
    v = w.view(-1)      # a view of the target exists before the write
    w.add_(1.0)
    return v * w.view(-1)


def converting(p):
    w = p.to(torch.float32)
    w += p              # float64 result copied into float32: the copy converts
    return w


@pytest.mark.parametrize("fn, shape", [(view_target, (4, 3)), (earlier_view, (3, 5)), (converting, (2, 6))])
def test_aliased_or_converting_targets_stay_in_place(fn, shape):
    x = torch.rand(shape, dtype=F64) + 0.5
    jfn = _jit(fn)
    torch.testing.assert_close(jfn(x.clone()), fn(x.clone()))
    assert _rewrites(jfn) == 0


def test_inputs_are_still_written():
    def scale_input(x, y):
        x.mul_(2.0)     # the caller's tensor: eager writes it
        return x + y

    x, y = torch.rand(3, 4, dtype=F64), torch.rand(3, 4, dtype=F64)
    xe = x.clone()
    out = _jit(scale_input)(x, y)
    torch.testing.assert_close(x, xe * 2)
    torch.testing.assert_close(out, xe * 2 + y)


def test_transform_records_its_count_and_keeps_a_trace_without_inplace_ops():
    t = InPlaceIntermediates()
    jfn = thunder.jit(lambda a: a * 2 + 1, transforms=[t])
    jfn(torch.rand(3, dtype=F64))
    assert t.rewrites == [0]
    trace = thunder.last_traces(jfn)[0]
    assert take_out_of_place(trace) == (trace, 0)


def keys_by_slices(nope, rot):  # Hugging Face's DeepSeek-V3 builds its keys this way
    k_nope = nope * 2.0
    k_rot = rot.expand(-1, 3, -1, -1)
    keys = k_nope.new_empty(*k_nope.shape[:-1], 6)
    keys[..., :4].copy_(k_nope)
    keys[..., 4:].copy_(k_rot)
    return keys.sin()


def rows_by_slices(a, b):
    out = torch.empty(5, a.shape[1], dtype=a.dtype)
    out[:2].copy_(a)
    out[2:5].copy_(b.float().exp())  # a float32 source copied into float64: converted
    return out * out


@pytest.mark.parametrize("fn, shapes", [(keys_by_slices, [(2, 3, 7, 4), (2, 1, 7, 2)]),
                                        (rows_by_slices, [(2, 3), (3, 3)])])
def test_tensors_filled_slice_by_slice_become_a_cat(fn, shapes):
    """Thunder 0.2.6 gives the copied tensors no gradient through copy_ into slices of a new tensor."""
    jfn, ref, got = _grads(fn, *shapes)
    for r, g in zip(ref, got):
        assert g is not None
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)
    assert _rewrites(jfn) == 1
    final = thunder.last_traces(jfn)[-1]
    assert "cat" in {b.sym.name for b in final.bound_symbols}
    assert not [b for b in final.bound_symbols if b.sym.name == "copy_"], final


def zeros_in_part(a):
    out = a.new_zeros(4, 6)
    out[:, 1:4].copy_(a * 2.0)  # columns 0, 4 and 5 keep their zeros
    return out * out


def full_in_part(a):
    out = torch.full((5, 3), 0.25, dtype=a.dtype)
    out[1:5].copy_(a.t()[:4] + 1.0)  # row 0 keeps 0.25
    return out.exp()


@pytest.mark.parametrize("fn, shapes", [(zeros_in_part, [(4, 3)]), (full_in_part, [(3, 5)])])
def test_filled_tensors_written_in_part_keep_their_value_elsewhere(fn, shapes):
    """Thunder 0.2.6 gave `a` a zero gradient here."""
    jfn, ref, got = _grads(fn, *shapes)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    assert _rewrites(jfn) == 1


def empty_in_part(a):
    out = a.new_empty(4, 5)
    out[:, :3].copy_(a * 2.0)   # columns 3 and 4 are whatever the memory held: no value to cat
    out[:, 3:].zero_()
    return out + 1.0


def overlapping(a):
    out = a.new_empty(4, 3)
    out[:, :3].copy_(a)
    out[:, 1:].copy_(a[:, :2] * 3.0)
    return out


@pytest.mark.parametrize("fn", [empty_in_part, overlapping])
def test_fills_that_are_not_a_partition_are_left(fn):
    x = torch.rand(4, 3, dtype=F64)
    jfn = _jit(fn)
    torch.testing.assert_close(jfn(x.clone()), fn(x.clone()))
    assert _rewrites(jfn) == 0

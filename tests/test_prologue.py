"""kforge.prologue (CPU): Thunder's per-call input checks batched into one call.

The batched check must accept and reject exactly what Thunder's per-item checks do: the same cache
hits and misses when a module's numbers, strings, parameters or inputs change, the same results, and
for generated values (NaN, 1 / 1.0 / True, shapes, dtypes, devices, requires_grad, strings, tensor
subclasses) the same verdict, in C++ (kforge._C.InputGuard) and in Python. The batched parameter,
buffer and submodule reads return what Thunder's per-name reads return.
"""
from __future__ import annotations

import math
import pickle

import pytest
import thunder
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kforge
from kforge.prologue import BatchedChecks, InputChecks, Unpack, check_all


def _numbers_ok(n, v) -> bool:
    """Thunder 0.2.6's check_number_type_and_value, restated."""
    return type(n) == type(v) and (n == v or (n != n and v != v))


_NUMBER = st.one_of(st.booleans(), st.integers(-3, 3), st.sampled_from([0.0, 1.0, -0.0, 2.5, math.nan, math.inf]))


@settings(max_examples=300, deadline=None)
@given(pairs=st.lists(st.tuples(_NUMBER, _NUMBER), max_size=12))
def test_numbers_accepted_exactly_when_thunder_accepts_them(pairs):
    """Generated (value read, value traced) pairs, equal or not, of mixed types and NaN: check_all
    passes exactly when every pair passes Thunder's own check."""
    numbers, values = [p[0] for p in pairs], [p[1] for p in pairs]
    expected = all(_numbers_ok(n, v) for n, v in pairs)
    if expected:
        check_all(numbers, values, (), ())
    else:
        with pytest.raises(RuntimeError, match="to be equal to and have the type of"):
            check_all(numbers, values, (), ())


def test_distinct_nan_objects_and_lookalike_types():
    nan_a, nan_b = float("nan"), float("nan")
    check_all([nan_a, 1, True, 2.0], [nan_b, 1, True, 2.0], (), ())
    for n, v in ((1, 1.0), (True, 1), (1.0, True), (0, False)):
        with pytest.raises(RuntimeError):
            check_all([n], [v], (), ())


_SPEC = ((2, 3), "cpu", torch.float32, False)


@pytest.mark.parametrize("change", ["none", "shape", "rank", "dtype", "requires_grad", "not a tensor"])
def test_tensor_checks(change):
    t = torch.zeros(2, 3)
    if change == "shape":
        t = torch.zeros(3, 2)
    elif change == "rank":
        t = torch.zeros(6)
    elif change == "dtype":
        t = t.double()
    elif change == "requires_grad":
        t.requires_grad_(True)
    elif change == "not a tensor":
        t = [[0.0] * 3] * 2
    ok = torch.zeros(4)
    args = ([], [], [ok, t], [((4,), "cpu", torch.float32, False), _SPEC])
    if change == "none":
        check_all(*args)
        return
    with pytest.raises(AssertionError, match="expected"):
        check_all(*args)


def test_device_compared_as_thunder_prints_it():
    """'cpu' matches a CPU tensor; a device string no tensor has ('cuda:0' for a CPU tensor) fails."""
    t = torch.zeros(2, 3)
    check_all([], [], [t], [_SPEC])
    with pytest.raises(AssertionError):
        check_all([], [], [t], [((2, 3), "cuda:0", torch.float32, False)])


def _tensor_ok(t, spec) -> bool:
    """Thunder 0.2.6's check_tensor_shape_and_metadata, restated."""
    shape, device, dtype, requires_grad = spec
    return (isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(shape) and str(t.device) == device
            and t.dtype == dtype and t.requires_grad == requires_grad)


class _Sub(torch.Tensor):
    """A tensor subclass: the C++ guard leaves it to the Python checks."""


_BASE_SPEC = ((3, 5), "cpu", torch.float32, False)


def _variant(kind: str):
    t = torch.randn(3, 5)
    return {"same": t, "shape": torch.randn(5, 3), "rank": torch.randn(15), "dtype": t.double(),
            "requires_grad": t.clone().requires_grad_(True), "meta": torch.empty(3, 5, device="meta"),
            "strided view": torch.randn(5, 3).t(), "parameter": torch.nn.Parameter(t, requires_grad=False),
            "subclass": t.as_subclass(_Sub), "empty dim": torch.randn(3, 0), "not a tensor": [[0.0] * 5] * 3}[kind]


_KINDS = ["same", "shape", "rank", "dtype", "requires_grad", "meta", "strided view", "parameter", "subclass",
          "empty dim", "not a tensor"]


@settings(max_examples=300, deadline=None)
@given(pairs=st.lists(st.tuples(_NUMBER, _NUMBER), max_size=6),
       kinds=st.lists(st.sampled_from(_KINDS), max_size=5),
       strings=st.lists(st.tuples(st.sampled_from(["none", "tanh", ""]), st.sampled_from(["none", "tanh", ""])),
                        max_size=3))
def test_input_checks_agree_with_thunders_checks(pairs, kinds, strings):
    """Generated numbers, tensors (changed shape, dtype, device, requires_grad, strides, subclasses,
    non-tensors) and strings: InputChecks, whose common case runs in C++, raises exactly when one of
    Thunder's per-item checks fails, and its C++ guard never says "same" when they would fail."""
    numbers, values = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    tensors = tuple(_variant(k) for k in kinds)
    specs = tuple(_BASE_SPEC for _ in kinds)
    got_s, want_s = tuple(p[0] for p in strings), tuple(p[1] for p in strings)
    checks = InputChecks(values, specs, want_s)
    assert checks._native is not None  # the extension is built: the C++ path is what is tested
    ok = (all(_numbers_ok(n, v) for n, v in pairs) and all(_tensor_ok(t, sp) for t, sp in zip(tensors, specs))
          and all(a == b for a, b in strings))
    if checks._native.matches(numbers, tensors, got_s):
        assert ok
    for c in (checks, pickle.loads(pickle.dumps(checks))):
        if ok:
            c(numbers, tensors, got_s)
        else:
            with pytest.raises((AssertionError, RuntimeError)):
                c(numbers, tensors, got_s)


def test_native_guard_rejects_malformed_specs_and_arguments():
    """kforge._C.InputGuard: a malformed spec is a TypeError / ValueError when it is made; arguments
    that are not tuples of the traced lengths are never "same"."""
    from kforge import _C

    types = (torch.Tensor, torch.nn.Parameter)
    with pytest.raises(ValueError, match="spec"):
        _C.InputGuard((), [((3,), "cpu", torch.float32)], types, ())
    with pytest.raises(TypeError, match="dtype"):
        _C.InputGuard((), [((3,), "cpu", "float32", False)], types, ())
    with pytest.raises(TypeError, match="types"):
        _C.InputGuard((), [], (1,), ())
    with pytest.raises(TypeError, match="str"):
        _C.InputGuard((), [], types, (1,))
    with pytest.raises(RuntimeError):
        _C.InputGuard((), [((3,), "gpu:0", torch.float32, False)], types, ())
    guard = _C.InputGuard((1,), [((3,), "cpu", torch.float32, False)], types, ("a",))
    t = torch.randn(3)
    assert guard.matches((1,), (t,), ("a",))
    for args in (([1], (t,), ("a",)), ((1,), [t], ("a",)), ((1,), (t,), ["a"]), ((), (t,), ("a",)),
                 ((1,), (), ("a",)), ((1,), (t,), ()), ((1, 2), (t,), ("a",))):
        assert not guard.matches(*args)


def test_input_checks_without_the_extension(monkeypatch):
    """Without kforge._C the Python checks alone decide, with the same verdicts."""
    import kforge.prologue as prologue

    monkeypatch.setattr(prologue, "_native_guard", lambda *a: None)
    checks = InputChecks((1, 2.0), (_BASE_SPEC,), ("tanh",))
    assert checks._native is None
    checks((1, 2.0), (torch.randn(3, 5),), ("tanh",))
    for numbers, tensors, strings in (((1, 2), (torch.randn(3, 5),), ("tanh",)),
                                      ((1, 2.0), (torch.randn(3, 4),), ("tanh",)),
                                      ((1, 2.0), (torch.randn(3, 5),), ("none",))):
        with pytest.raises((AssertionError, RuntimeError)):
            checks(numbers, tensors, strings)


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight  # tied: one parameter, two names
        self.register_buffer("offset", torch.randn(8))

    def forward(self, idx):
        return self.head(self.emb(idx) + self.offset)


def test_unpack_reads_what_thunder_reads():
    """Unpack returns the objects ThunderModule.get_parameter / get_buffer / get_submodule return,
    by name, also for the second name of a tied weight (not in the module's dict), after that name
    is added to the dict and after one is taken out; and for a module without those dicts."""
    tm = thunder.jit(_Tied())
    names = ["emb.weight", "head.weight"]
    unpack = Unpack("parameter", names)
    for _ in range(2):
        assert all(a is b for a, b in zip(unpack(tm), [tm.get_parameter(n) for n in names]))
    other = torch.nn.Parameter(torch.randn(11, 8))
    tm._overrides_parameters["head.weight"] = other
    assert unpack(tm)[1] is other
    del tm._overrides_parameters["head.weight"]
    assert unpack(tm)[1] is tm._model.head.weight
    assert Unpack("buffer", ["offset"])(tm)[0] is tm.get_buffer("offset")
    mods = Unpack("submodule", ["emb", "head"])
    assert mods(tm) == (tm._model.emb, tm._model.head)
    assert pickle.loads(pickle.dumps(mods))(tm) == mods(tm)
    plain = _Tied()  # an nn.Module: per-name reads
    assert Unpack("parameter", names)(plain) == (plain.emb.weight, plain.emb.weight)
    with pytest.raises(ValueError, match="kind"):
        Unpack("attribute", names)


def test_tied_weights_and_buffers_through_batched_reads():
    """A model with a tied weight and a buffer under kforge.jit: one batched read per kind in the
    prologue, eager's output and the tied weight's gradient (both uses summed)."""
    torch.manual_seed(0)
    net = _Tied()
    jfn = kforge.jit(net)
    idx = torch.randint(0, 11, (4, 5))
    out = jfn(idx)
    out.square().sum().backward()
    grad = net.emb.weight.grad.clone()
    net.zero_grad()
    ref = net(idx)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grad, net.emb.weight.grad)
    names = _prologue_names(jfn)
    assert names.count("kforge_unpack_parameters") == 1 and names.count("kforge_unpack_buffers") == 1
    assert "unpack_parameter" not in names and "unpack_buffer" not in names


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8, eps=1e-5)
        self.act = torch.nn.GELU()
        self.scale, self.use_norm = 0.5, True

    def forward(self, x):
        y = self.act(self.lin(x)) * self.scale
        return self.norm(y) if self.use_norm else y


def _prologue_names(jfn) -> list[str]:
    return [b.sym.name for b in thunder.last_prologue_traces(jfn)[-1].bound_symbols]


def test_kforge_jit_prologue_has_one_check_call():
    jfn = kforge.jit(_Net())
    jfn(torch.randn(4, 8))
    names = _prologue_names(jfn)
    assert names.count("kforge_check_inputs") == 1
    for batched in ("check_number_type_and_value", "check_tensor_metadata", "check_string_value",
                    "unpack_parameter", "unpack_buffer", "unpack_submodule"):
        assert batched not in names, batched
    for kind in ("parameters", "submodules"):
        assert names.count(f"kforge_unpack_{kind}") == 1, kind


def test_same_cache_hits_and_misses_as_thunders_checks():
    """A module and its input changed step by step (a number attribute, a bool, eps, a parameter's
    requires_grad and dtype, the input's shape and requires_grad): after every change the jitted
    function with batched checks misses / hits Thunder's cache exactly when plain thunder.jit does,
    and both give eager's result."""
    torch.manual_seed(0)
    plain_net, batched_net = _Net(), _Net()
    batched_net.load_state_dict(plain_net.state_dict())
    plain = thunder.jit(plain_net)
    batched = thunder.jit(batched_net, transforms=[BatchedChecks()])
    x = torch.randn(4, 8)

    def change(fn):
        fn(plain_net), fn(batched_net)

    steps = [
        ("first call", lambda m: None, x),
        ("same again", lambda m: None, x),
        ("number attribute", lambda m: setattr(m, "scale", 0.25), x),
        ("same value again", lambda m: setattr(m, "scale", 0.25), x),
        ("bool attribute", lambda m: setattr(m, "use_norm", False), x),
        ("bool back", lambda m: setattr(m, "use_norm", True), x),
        ("eps", lambda m: setattr(m.norm, "eps", 1e-3), x),
        ("string attribute", lambda m: setattr(m.act, "approximate", "tanh"), x),
        ("string back", lambda m: setattr(m.act, "approximate", "none"), x),
        ("requires_grad", lambda m: m.lin.weight.requires_grad_(False), x),
        ("input shape", lambda m: None, torch.randn(5, 8)),
        ("input requires_grad", lambda m: None, torch.randn(5, 8).requires_grad_(True)),
        ("training flag", lambda m: m.eval(), x),
        ("dtype", lambda m: m.double(), x.double()),
    ]
    for what, fn, inp in steps:
        change(fn)
        out_p, out_b = plain(inp), batched(inp)
        ref = batched_net(inp)
        assert (thunder.cache_misses(plain), thunder.cache_hits(plain)) == \
               (thunder.cache_misses(batched), thunder.cache_hits(batched)), what
        torch.testing.assert_close(out_b, ref, msg=what)
        torch.testing.assert_close(out_p, out_b, msg=what)
    assert thunder.cache_misses(batched) >= 8  # the changes above did reach the cache
    assert "kforge_check_inputs" in _prologue_names(batched)


def test_symbolic_values_cache_keeps_its_own_checks():
    """With cache="symbolic values" shapes and numbers are proxies: those checks stay Thunder's own
    (nothing to batch, or only what is constant), and calls with new sizes and scalars match eager
    and plain thunder.jit, hit for hit."""
    def fn(x, s):
        return torch.nn.functional.gelu(x * s).sum(-1)

    plain = thunder.jit(fn, cache="symbolic values")
    batched = thunder.jit(fn, transforms=[BatchedChecks()], cache="symbolic values")
    for n, s in ((4, 0.5), (6, 0.5), (6, 2.0), (4, 0.5)):
        x = torch.randn(n, 8)
        torch.testing.assert_close(batched(x, s), fn(x, s))
        torch.testing.assert_close(plain(x, s), fn(x, s))
        assert (thunder.cache_misses(plain), thunder.cache_hits(plain)) == \
               (thunder.cache_misses(batched), thunder.cache_hits(batched))


def test_kforge_compile_pieces_batch_their_checks():
    """kforge.compile (Thunder's Dynamo path): the Thunder piece's prologue checks its tensors in one
    call too, and the result matches eager, again after an input shape change (a new graph)."""
    net = _Net()
    compiled = kforge.compile(net)
    for n in (4, 5):
        x = torch.randn(n, 8)
        torch.testing.assert_close(compiled(x), net(x))
    prologues = [thunder.last_prologue_traces(fn)[-1]
                 for info in compiled.backend.subgraph_infos for fn in info.thunder_compiled_fns]
    names = [b.sym.name for p in prologues for b in p.bound_symbols]
    assert prologues and "kforge_check_inputs" in names and "check_tensor_metadata" not in names

"""Finding the regions of a trace that become generated kernels.

1. Greedy producer-to-consumer merging in trace order: each fusible bound symbol joins the group of
   one of its fusible producers (the nearest first, then the others) when both are forward or both
   backward (Thunder splits the trace there afterwards), the merge creates no cycle between groups,
   and the merged group is still one kernel (`legal`).
2. Absorption: a group recomputes cheap producers of its inputs instead of reading their results:
   views (free in a kernel), casts and other elementwise ops, when that reads no more bytes than the
   input it replaces (cos / sin tables cast and broadcast per layer; a forward fp32 upcast the
   backward needs, recomputed from the bf16 tensor it came from, so the fp32 copy is neither written
   nor saved). The producer stays where it was for its other readers, or goes if none is left.
   Only producers whose own inputs are already available outside their groups are absorbed, so no
   group has to export anything new.
3. Tail views leave their group: a view (broadcast, reshape, transpose, squeeze) whose result is only
   read outside the group runs as a torch view of the group's output instead of a materialised copy.
   A group left with views only is dissolved: views are free in torch, unless it ends in a reshape
   torch would have to copy (a transposed or expanded view), which a region copies vectorised. A view
   read both inside and outside its group is done both ways: a torch view for the outside, recomputed
   inside (the region writes its input once, not the values twice).
4. Groups and the remaining bound symbols are put in a topological order that keeps each unit close
   to where its last symbol was.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

__all__ = ["Group", "partition", "is_view_bsym"]

# Prims that are views in torch (free), by name, as they appear in bound symbols (also composites).
_VIEW_PRIMS = {"broadcast_in_dim", "reshape", "transpose", "squeeze", "view", "shallow_copy"}
# Ops that do not count as work: a group of only these is not worth a kernel.
_SHAPE_PRIMS = _VIEW_PRIMS | {"slice_prim", "flip"}
# Cheap enough to recompute in a consumer (besides views): no reductions, no transcendental chains.
_CHEAP_PRIMS = _SHAPE_PRIMS | {"convert_element_type", "neg", "abs", "add", "sub", "mul", "clone", "where",
                               "broadcast_in_dim", "full", "iota"}
_MAX_ABSORB = 16  # bound symbols a group may absorb in all


def _prim_names(bsym: Any) -> list[str]:
    if not bsym.subsymbols:
        return [bsym.sym.name]
    out = []
    for s in bsym.subsymbols:
        out.extend(_prim_names(s))
    return out


def is_view_bsym(bsym: Any) -> bool:
    """A bound symbol that is a torch view of its input: only view prims inside."""
    names = _prim_names(bsym)
    return bool(names) and all(n in _VIEW_PRIMS for n in names)


def _only(bsym: Any, names: set) -> bool:
    ns = _prim_names(bsym)
    return bool(ns) and all(n in names for n in ns)


def _prims(bsym: Any) -> list:
    if not bsym.subsymbols:
        return [bsym]
    out = []
    for sub in bsym.subsymbols:
        out.extend(_prims(sub))
    return out


def _replay(t: Any, prim: Any) -> Any:
    """Apply a view prim to meta tensor `t` as torch would (None when it is not one we know)."""
    name, a = prim.sym.name, prim.args
    if name in ("reshape", "view"):
        return t.reshape(tuple(prim.flat_outs[0].shape))
    if name == "transpose":
        return t.permute(tuple(a[1]))
    if name == "broadcast_in_dim":
        shape, bdims = tuple(a[1]), tuple(a[2])
        src = [1] * len(shape)
        for j, d in enumerate(bdims):
            src[d] = t.shape[j]
        return t.reshape(src).expand(shape)
    if name == "squeeze":
        return t.reshape(tuple(prim.flat_outs[0].shape))
    if name == "shallow_copy":
        return t
    return None


@dataclass
class Group:
    """A region: its bound symbols (trace order), inputs and outputs (proxies)."""

    bsyms: list
    inputs: list
    outputs: list
    backward: bool = False


@dataclass
class _Node:
    i: int
    bsym: Any
    preds: set = field(default_factory=set)
    succs: set = field(default_factory=set)
    fusible: bool = False
    backward: bool = False


def _is_backward(bsym: Any) -> bool:
    from thunder.core.symbol import BoundSymbolTag

    return BoundSymbolTag.BACKWARD in bsym.tags


def _nbytes(p: Any) -> int:
    shape = getattr(p, "shape", None)
    if shape is None:
        return 0
    n = 1
    for s in shape:
        n *= int(s)
    return n * int(getattr(p.dtype, "bytes", 4))


class _Partitioner:
    def __init__(self, bsyms: Sequence[Any], fusible: Callable[[Any], bool],
                 legal: Callable[[list, list, list], str | None]):
        self.bsyms = list(bsyms)
        self.legal = legal
        n = len(self.bsyms)
        self.nodes = [_Node(i, b) for i, b in enumerate(self.bsyms)]
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = {}
        for node in self.nodes:
            b = node.bsym
            args = {p.name for p in b.flat_proxy_args}
            for p in b.flat_proxy_args:
                self.consumers.setdefault(p.name, []).append(node.i)
                j = self.producer.get(p.name)
                if j is not None and j != node.i:
                    node.preds.add(j)
                    self.nodes[j].succs.add(node.i)
            for o in b.flat_proxy_outs:
                if o.name not in args:
                    self.producer.setdefault(o.name, node.i)
            node.backward = _is_backward(b)
            node.fusible = fusible(b)
        self.home = list(range(n))                       # node -> home group id
        self.members: dict[int, list[int]] = {i: [i] for i in range(n)}   # home members
        self.absorbed: dict[int, list[int]] = {}         # group -> duplicated producers
        self.reasons: dict[int, str] = {}
        # Per node, computed once: merging asks them of the same nodes for every candidate region.
        self._is_view: dict[int, bool] = {}
        self._copies: dict[int, bool] = {}

    # -- regions ------------------------------------------------------------------------------------
    def all_members(self, g: int) -> list[int]:
        return sorted(set(self.members.get(g, [])) | set(self.absorbed.get(g, [])))

    def region(self, ms: Sequence[int], home: Sequence[int] | None = None) -> tuple[list, list, list]:
        """(bound symbols, inputs, outputs) of members `ms`; `home` (default all of `ms`) are those
        whose results can be exported."""
        ms = sorted(set(ms))
        inside = set(ms)
        home_set = inside if home is None else set(home)
        ins, outs, seen_in, seen_out = [], [], set(), set()
        for i in ms:
            b = self.nodes[i].bsym
            for p in b.flat_proxy_args:
                j = self.producer.get(p.name)
                if (j is None or j not in inside) and p.name not in seen_in:
                    seen_in.add(p.name)
                    ins.append(p)
        for i in ms:
            if i not in home_set:
                continue
            for o in self.nodes[i].bsym.flat_proxy_outs:
                if o.name in seen_out or self.producer.get(o.name) != i:
                    continue
                # (a recomputed view of a home member's result also runs outside: split_shared_views)
                if any(self._needs_from_outside(c, i, inside) or (c in inside and c not in home_set)
                       for c in self.consumers.get(o.name, ())):
                    seen_out.add(o.name)
                    outs.append(o)
        return [self.nodes[i].bsym for i in ms], ins, outs

    def _needs_from_outside(self, c: int, producer: int, inside: set) -> bool:
        """Consumer node `c` reads the result of `producer` from outside a group holding `inside`."""
        if c in inside:
            return False
        g = self.home[c]
        if g in self._final and c in self.members.get(g, ()):
            return producer not in self.absorbed.get(g, ())
        return True

    # -- 1. greedy merging ------------------------------------------------------------------------------
    def creates_cycle(self, a: list[int], b: list[int]) -> bool:
        union = set(a) | set(b)
        hi = max(union)
        stack = [s for i in union for s in self.nodes[i].succs if s not in union]
        seen: set[int] = set()
        while stack:
            x = stack.pop()
            if x in seen or x > hi:
                continue
            seen.add(x)
            for y in self.members.get(self.home[x], [x]):
                if y in union:
                    return True
                if y not in seen and y <= hi:
                    seen.add(y)
                    stack.extend(s for s in self.nodes[y].succs if s not in seen)
            stack.extend(s for s in self.nodes[x].succs if s not in seen)
        return False

    def check(self, ms: list[int]) -> str | None:
        keep = self.peel(ms)
        if not keep:
            return None  # views only: nothing to lower, merging is harmless
        return self.legal(*self.region(keep))

    def merge(self) -> None:
        nodes = self.nodes
        for node in nodes:
            if not node.fusible:
                continue
            g = self.home[node.i]
            cands = sorted({self.home[p] for p in node.preds if nodes[p].fusible and nodes[p].backward == node.backward},
                           key=lambda c: -max(self.members[c]))
            for c in cands:
                if c == g:
                    continue
                if self.creates_cycle(self.members[c], self.members[g]):
                    continue
                merged = self.members[c] + self.members[g]
                why = self.check(merged)
                if why is not None:
                    self.reasons.setdefault(node.i, why)
                    continue
                for i in self.members[g]:
                    self.home[i] = c
                self.members[c] = sorted(merged)
                del self.members[g]
                g = c

    # -- 2. absorption ------------------------------------------------------------------------------------
    def _exported(self, q: Any, g: int) -> bool:
        """Proxy `q` can be read by group `g` without any group exporting something new."""
        k = self.producer.get(q.name)
        if k is None or not self.nodes[k].fusible or k in self.all_members(g):
            return True
        hg = self.home[k]
        if hg not in self._final or k not in self.members[hg]:
            return True  # a top-level bound symbol
        _, _, outs = self.region(self.all_members(hg), self.members[hg])
        return q.name in {o.name for o in outs}

    def _cone(self, p: Any, g: int, back: bool) -> list[int] | None:
        """The cheap bound symbols group `g` would duplicate to compute `p` itself, down to values it
        can read; None when one of them is not cheap or the cone grows too large."""
        cone: list[int] = []
        stack = [p]
        seen: set[str] = set()
        while stack:
            q = stack.pop()
            if q.name in seen:
                continue
            seen.add(q.name)
            if q is not p and self._exported(q, g):
                continue
            j = self.producer.get(q.name)
            if j is None:
                continue
            node = self.nodes[j]
            if (not node.fusible or (node.backward and not back) or not _only(node.bsym, _CHEAP_PRIMS)
                    or j in cone):
                return None
            cone.append(j)
            if len(cone) > 8:
                return None
            stack.extend(node.bsym.flat_proxy_args)
        return cone

    def absorb(self) -> None:
        for g in sorted(self._final):
            budget = _MAX_ABSORB
            back = self.nodes[self.members[g][0]].backward
            changed = True
            while changed and budget > 0:
                changed = False
                ms = self.all_members(g)
                _, ins, _ = self.region(ms, self.members[g])
                have = {q.name for q in ins}
                for p in ins:
                    j = self.producer.get(p.name)
                    if j is None or j in ms:
                        continue
                    cone = self._cone(p, g, back)
                    if not cone or len(cone) > budget:
                        continue
                    _, cins, _ = self.region(cone)
                    if sum(_nbytes(q) for q in cins if q.name not in have) > _nbytes(p):
                        continue
                    trial = ms + cone
                    if self.legal(*self.region(self.peel(trial), self.members[g])) is not None:
                        continue
                    self.absorbed.setdefault(g, []).extend(cone)
                    budget -= len(cone)
                    changed = True
                    break

    # -- 3. peeling ---------------------------------------------------------------------------------------
    def is_view(self, i: int) -> bool:
        v = self._is_view.get(i)
        if v is None:
            v = self._is_view[i] = is_view_bsym(self.nodes[i].bsym)
        return v

    def copies(self, i: int) -> bool:
        """Node i is a reshape torch would have to copy (of a transposed or expanded view): as a
        kernel of ours it is a vectorised copy, or better, part of a region. Depends on the node and
        the views feeding it only, so it is answered once per node."""
        c = self._copies.get(i)
        if c is None:
            c = self._copies[i] = self._replays_as_copy(i)
        return c

    def _replays_as_copy(self, i: int) -> bool:
        import torch

        b = self.nodes[i].bsym
        ps = _prims(b)
        if not ps or ps[-1].sym.name not in ("reshape", "view"):
            return False
        chain, j = [], i
        while True:  # the views feeding it, back to a tensor torch holds contiguous
            node = self.nodes[j]
            if not self.is_view(j):
                break
            chain = _prims(node.bsym) + chain
            src = node.bsym.flat_proxy_args[0] if node.bsym.flat_proxy_args else None
            k = self.producer.get(src.name) if src is not None else None
            if k is None:
                break
            j = k
        try:
            src = chain[0].flat_proxy_args[0]
            t = torch.empty(tuple(int(x) for x in src.shape), device="meta")
            for prim in chain[:-1]:
                t = _replay(t, prim)
                if t is None:
                    return False
            out = _replay(t, chain[-1])
        except Exception:
            return False
        return out is not None and not out._is_view()


    def peel(self, ms: Sequence[int], home: Sequence[int] | None = None) -> list[int]:
        """`ms` without tail views (views whose results are read only outside the group). Slices stay:
        exporting the whole tensor instead would move more bytes."""
        keep = sorted(set(ms))
        changed = True
        while changed:
            changed = False
            inside = set(keep)
            for i in list(keep):
                if not self.is_view(i) or self.copies(i):
                    continue
                b = self.nodes[i].bsym
                read_inside = any(c in inside and c != i
                                  for o in b.flat_proxy_outs for c in self.consumers.get(o.name, ()))
                if not read_inside:
                    keep.remove(i)
                    changed = True
        return keep

    def split_shared_views(self) -> None:
        """A view read both inside its group and outside: the outside readers get a torch view of the
        group's result and the group recomputes the view for its own readers (free in a kernel), so the
        region does not write the same values twice. (HF's Conv1D backward: the (B*T, C) view of the
        residual gradient is summed inside for the bias and read outside by the GEMMs.)"""
        for g in sorted(self._final):
            ms = self.members[g]
            for i in list(ms):
                if len(ms) < 2 or not self.is_view(i) or self.copies(i):
                    continue
                outs = self.nodes[i].bsym.flat_proxy_outs
                readers = [c for o in outs for c in self.consumers.get(o.name, ()) if c != i]
                inside = [c for c in readers if c in ms]
                if not inside or len(inside) == len(readers):
                    continue
                ms.remove(i)
                self.absorbed.setdefault(g, []).append(i)
                if self.legal(*self.region(self.peel(self.all_members(g)), ms)) is not None:
                    self.absorbed[g].remove(i)  # not one kernel that way: export the view as before
                    ms.append(i)
                    ms.sort()

    # -- the whole pass -----------------------------------------------------------------------------------
    def run(self) -> tuple[list, list[Group], dict]:
        self._final: set[int] = set()
        self.merge()
        self._final = {g for g, ms in self.members.items() if self.nodes[ms[0]].fusible}
        # Tail views leave their groups and run as torch views of the groups' results.
        for g in sorted(self._final):
            keep = set(self.peel(self.members[g]))
            for i in list(self.members[g]):
                if i not in keep:
                    self.members[g].remove(i)
                    self.reasons.setdefault(i, "view of a region's result: a torch view outside the region")
            if not self.members[g]:
                self._final.discard(g)
        self.split_shared_views()
        self.absorb()
        for g in sorted(self._final):
            keep = set(self.peel(self.all_members(g)))
            if g in self.absorbed:
                self.absorbed[g] = [i for i in self.absorbed[g] if i in keep]
        # Dissolve groups without work; each remaining group must still be one kernel.
        groups: list[Group] = []
        unit_of: dict[int, int] = {}
        for g in sorted(self._final, key=lambda g: min(self.members[g]) if self.members[g] else 0):
            ms = self.members[g]
            allm = self.all_members(g)
            why = None
            if not ms or all(_only(self.nodes[i].bsym, _SHAPE_PRIMS) and not self.copies(i) for i in allm):
                why = "views only: left to torch (free views, no kernel)"
            else:
                bs, ins, outs = self.region(allm, ms)
                if not outs:
                    why = "nothing of it is read (dead)"
                else:
                    why = self.legal(bs, ins, outs)
            if why is not None:
                for i in ms:
                    self.reasons.setdefault(i, why)
                self._final.discard(g)
                self.absorbed.pop(g, None)
                continue
        for g in sorted(self._final, key=lambda g: min(self.members[g])):
            bs, ins, outs = self.region(self.all_members(g), self.members[g])
            for i in self.members[g]:
                unit_of[i] = len(groups)
            groups.append(Group(bs, ins, outs, any(self.nodes[i].backward for i in self.all_members(g))))
        reasons = {i: r for i, r in self.reasons.items() if self.nodes[i].fusible and i not in unit_of}
        return self.order(groups, unit_of), groups, reasons

    # -- 4. order -----------------------------------------------------------------------------------------
    def order(self, groups: list[Group], unit_of: dict[int, int]) -> list:
        n = len(self.nodes)
        key_of = {i: (("g", unit_of[i]) if i in unit_of else ("b", i)) for i in range(n)}
        unit_members: dict[Any, list[int]] = {}
        for i in range(n):
            unit_members.setdefault(key_of[i], []).append(i)
        preds: dict[Any, set] = {u: set() for u in unit_members}
        succs: dict[Any, set] = {u: set() for u in unit_members}

        def depend(u: Any, on: Any) -> None:
            if on != u:
                preds[u].add(on)
                succs[on].add(u)

        for i in range(n):
            if i in unit_of:
                continue
            for p in self.nodes[i].preds:
                depend(key_of[i], key_of[p])
        for gi, grp in enumerate(groups):
            u = ("g", gi)
            for p in grp.inputs:
                j = self.producer.get(p.name)
                if j is not None:
                    depend(u, key_of[j])
        indeg = {u: len(ps) for u, ps in preds.items()}
        prio = {u: max(ms) for u, ms in unit_members.items()}
        heap = [(prio[u], str(u), u) for u, d in indeg.items() if d == 0]
        heapq.heapify(heap)
        order: list = []
        while heap:
            _, _, u = heapq.heappop(heap)
            order.append(groups[u[1]] if u[0] == "g" else self.bsyms[u[1]])
            for s in succs[u]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(heap, (prio[s], str(s), s))
        if len(order) != len(unit_members):
            raise AssertionError("kforge.fusion: the region graph has a cycle")
        return order


def partition(bsyms: Sequence[Any], fusible: Callable[[Any], bool],
              legal: Callable[[list, list, list], str | None]) -> tuple[list, list[Group], dict]:
    """Regions of `bsyms` (a trace's top-level bound symbols, in order).

    fusible(bsym): the fusion executor can take it. legal(bsyms, inputs, outputs): None when the
    region is one kernel, else why not.
    Returns (new order: bound symbols and Groups, the groups, {bsym index: reason it stayed out}).
    """
    return _Partitioner(bsyms, fusible, legal).run()

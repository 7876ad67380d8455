"""Where the GPU waits in a profiled training step: the idle gaps of a Chrome trace and the host code
that launched the kernel after each gap.

    python -m kforge profile --model kforge.zoo.plain_llama:make --size bench --batch 8 --seq 1024 \
        --steps 3 --trace trace.json
    python3 dev/step_gaps.py trace.json [--min-us 2] [--top 25]

A gap is time with no kernel, memcpy or memset on the GPU. It is charged to the kernel that ends it:
if that kernel's launch call started after the gap began, the GPU waited for the host ("host");
otherwise the launch was queued in time and the gap is the device's own (dependency, launch latency).
Host gaps are grouped by the innermost CPU range (aten op, record_function range such as
"kforge.rmsnorm.forward" or Thunder's symbol names when annotated) around the launch call, and by
the kernel before and after the gap.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
RANGE_CATS = ("cpu_op", "user_annotation", "python_function")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def analyse(events: list[dict], min_us: float, top: int) -> str:
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    ranges_by_tid: dict = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in RANGE_CATS:
            ranges_by_tid[(e.get("pid"), e.get("tid"))].append(e)
    starts_by_tid = {}
    for k, rs in ranges_by_tid.items():
        rs.sort(key=lambda e: e["ts"])
        starts_by_tid[k] = [r["ts"] for r in rs]

    def innermost(launch: dict) -> str:
        k = (launch.get("pid"), launch.get("tid"))
        rs, starts = ranges_by_tid.get(k, []), starts_by_tid.get(k, [])
        best = None
        # ranges starting before the launch; the innermost is the latest-starting one that contains it
        for i in range(bisect.bisect_right(starts, launch["ts"]) - 1, max(-1, bisect.bisect_right(starts, launch["ts"]) - 400), -1):
            r = rs[i]
            if r["ts"] + r.get("dur", 0) >= launch["ts"] + launch.get("dur", 0):
                best = r
                break
        return best["name"] if best else "(no range)"

    if not gpu:
        return "no GPU events in the trace"
    busy_end = gpu[0]["ts"] + gpu[0].get("dur", 0)
    prev = gpu[0]
    span0 = gpu[0]["ts"]
    host = collections.Counter()
    host_n = collections.Counter()
    pairs = collections.Counter()
    device_gap = 0.0
    host_gap = 0.0
    gaps = []
    for e in gpu[1:]:
        gap = e["ts"] - busy_end
        if gap >= min_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            if launch is not None and launch["ts"] > busy_end:
                where = innermost(launch)
                host[where] += gap
                host_n[where] += 1
                pairs[(prev["name"][:60], e["name"][:60])] += gap
                host_gap += gap
                gaps.append((gap, where, prev["name"][:50], e["name"][:50]))
            else:
                device_gap += gap
        end = e["ts"] + e.get("dur", 0)
        if end > busy_end:
            busy_end, prev = end, e
    span = busy_end - span0
    busy = sum(e.get("dur", 0) for e in gpu)
    lines = [f"GPU span {span / 1e3:.2f} ms, kernel time {busy / 1e3:.2f} ms (overlaps counted twice), "
             f"gaps >= {min_us} us: host {host_gap / 1e3:.2f} ms, device {device_gap / 1e3:.2f} ms", "",
             "host gaps by the innermost CPU range around the launch that ended them:",
             "| range | gaps | total us |", "|---|---|---|"]
    lines += [f"| {k} | {host_n[k]} | {v:.0f} |" for k, v in host.most_common(top)]
    lines += ["", "host gaps by (kernel before, kernel after):", "| before | after | total us |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {v:.0f} |" for (a, b), v in pairs.most_common(top)]
    lines += ["", "largest host gaps:", "| us | range | before | after |", "|---|---|---|---|"]
    lines += [f"| {g:.0f} | {w} | {a} | {b} |" for g, w, a, b in sorted(gaps, reverse=True)[:top]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--min-us", type=float, default=2.0)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    print(analyse(load(a.trace), a.min_us, a.top))


if __name__ == "__main__":
    main()

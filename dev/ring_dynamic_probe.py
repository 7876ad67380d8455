"""Does the RMSNorm ring backward lose time to its static schedule? A timing probe.

The ring kernel gives each block a fixed set of row groups (blockIdx.x, + gridDim.x, ...), and its
blocks finish them at very different times (dev/ring_timeline.py: 32 to 52 us at 8192 x 4096
bf16, the same SMs fast in every call). This writes two patched copies of kernels_src whose ring
kernel runs the same restructured loop, differing only in where the row groups come from:

  <out>/dynamic: positions 0 .. S + A of a block static, later ones claimed from a global counter
                 A iterations ahead (lane 0 of warp t % A claims at iteration t and hands the index
                 on at t + A), so fast SMs take more row groups. dweight then depends on the
                 schedule: NOT deterministic, a probe only (dx is still bitwise the default's).
  <out>/static:  the same code with the static row groups (the counter replaced by the formula).

Time them on the GPU machine against the default (no rebuild: the kernel cache is keyed by source):

  python dev/ring_dynamic_probe.py /tmp/probe [A, default 3]
  python scripts/ab.py rmsnorm:bwd
  KFORGE_KERNEL_DIR=/tmp/probe/dynamic python scripts/ab.py rmsnorm:bwd
  KFORGE_KERNEL_DIR=/tmp/probe/static python scripts/ab.py rmsnorm:bwd
  python dev/ring_timeline.py /tmp/probe/dynamic

The patched loop assumes row groups of more than one warp (blockDim.x > 32), as the bench cases
have (8192 x 4096, fp32 and bf16); do not run the test suite against it.
"""
import pathlib
import shutil
import sys

SRC = pathlib.Path(__file__).resolve().parent.parent / "kernels_src"
HEAD = ("template <typename T, int K, int S, bool CBW, int NT, bool RES = false>\n"
        "__global__ void __launch_bounds__(NT, 1)\n"
        "    rmsnorm_backward_ring_kernel(")
COUNTERS = "__device__ unsigned long long kf_dyn_next;\n__device__ unsigned kf_dyn_done;\n"
SETUP = r"""  const long long ngroups = (rows + G - 1) / G;
  const long long grid = gridDim.x;
  __shared__ long long nxt[2];
  long long pidx[S + 1];  // row group of positions t .. t + S
  const u64 gdelta = reinterpret_cast<u64>(dy) - reinterpret_cast<u64>(x);
  auto request = [&](long long idx, int s, u32 dep) {
    const u32 sa = my + (u32)s * stage_bytes + dep;
    const u32 ra = rslot + (u32)s * rstage + dep;
    const long long row = idx * G + threadIdx.y;
    if (idx < ngroups && row < rows) {
      const char* lx = reinterpret_cast<const char*>(x + row * D + threadIdx.x * V);
#pragma unroll
      for (int k = 0; k < K; ++k)
        if (ok[k]) {
          cp_async16(sa + (u32)k * kstep, lx + k * kstep);
          cp_async16(sa + dyoff + (u32)k * kstep, plus(lx, gdelta + k * kstep));
        }
      if (leader) cp_async4(ra, rstd + row);
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k)
        if (ok[k]) {
          sts16_zero(sa + (u32)k * kstep);
          sts16_zero(sa + dyoff + (u32)k * kstep);
        }
      if (leader) sts_f32(ra, 0.0f);
    }
  };
  // Positions 0 .. S + A static (row groups blockIdx.x + p * grid), later ones claimed A iterations
  // ahead: lane 0 of warp t % A claims at iteration t (position t + S + A + 1) and hands the index on
  // at iteration t + A (one register a warp, never moved while the atomic is in flight).
  constexpr int A = DYN_AHEAD;
  unsigned long long pending = 0;
#pragma unroll
  for (int s = 0; s < S; ++s) {
    pidx[s] = blockIdx.x + s * grid;
    request(pidx[s], s, 0u);
    cp_async_commit();
  }
  long long after = blockIdx.x + S * grid;  // position t + S at t = 0
"""
LOOP = r"""  int s = 0;  // the stage of position t
  u32 set = 0u;  // reduction slot set
#pragma unroll 1
  for (int t = 0; pidx[0] < ngroups; ++t) {
    cp_async_wait<S - 1>();
    const u32 sa = my + (u32)s * stage_bytes;
    Vec16<T> xc[K], gc[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      xc[k] = lds16<T>(sa + (u32)k * kstep);
      gc[k] = lds16<T>(sa + dyoff + (u32)k * kstep);
    }
    float r = leader ? lds_f32(rslot + (u32)s * rstage) : 0.0f;
    r = __shfl_sync(0xffffffffu, r, src);

    float g[K][V], dot = 0.0f;
    rn_row_terms<T, K, CBW>(xc, gc, w, r, g, dot, acc);
    pidx[S] = after;
    request(after, s, __float_as_uint(dot) & (u32)zero);
    cp_async_commit();
    if (lane == 0 && (tid >> 5) == t % A) {
      nxt[t & 1] = t < A ? (long long)(blockIdx.x + (t + S + 1) * grid)
                         : (long long)((S + A + 1) * grid) + (long long)pending;
      pending = atomicAdd(&kf_dyn_next, 1ull);
    }

    dot = warp_sum(dot);
    float* slots = &red[0][0] + set + threadIdx.y * 16;
    if (lane == 0) slots[threadIdx.x >> 5] = dot;
    __syncthreads();
    dot = slots[lane & 15];
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    set ^= NT / 4;
    const float a = -(dot * inv_d) * r * r;
    const long long row = pidx[0] * G + threadIdx.y;
    if (row < rows) {
      char* cdx = reinterpret_cast<char*>(dx + row * D + threadIdx.x * V);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        float o[V];
#pragma unroll
        for (int i = 0; i < V; ++i) o[i] = r * fmaf(a, xc[k].f(i), g[k][i]);
        if (ok[k]) store_chunk<T, true>(reinterpret_cast<T*>(cdx + k * kstep), 0, D, E::from(o));
      }
    }
    after = nxt[t & 1];
#pragma unroll
    for (int i = 0; i < S; ++i) pidx[i] = pidx[i + 1];
    s = s + 1 == S ? 0 : s + 1;
  }
  cp_async_wait<0>();
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(&kf_dyn_done, 1u) == gridDim.x - 1) {
      kf_dyn_next = 0;
      kf_dyn_done = 0;
      __threadfence();
    }
  }
"""
STATIC_CLAIM = (
    """      nxt[t & 1] = t < A ? (long long)(blockIdx.x + (t + S + 1) * grid)
                         : (long long)((S + A + 1) * grid) + (long long)pending;
      pending = atomicAdd(&kf_dyn_next, 1ull);""",
    """      nxt[t & 1] = t < A ? (long long)(blockIdx.x + (t + S + 1) * grid) : (long long)pending;
      pending = blockIdx.x + (t + S + A + 1) * grid;""",
)


def patched_source(text: str, ahead: int = 3, dynamic: bool = True) -> str:
    """rmsnorm.cu with the ring kernel's row loop replaced (see the module docstring)."""
    if text.count(HEAD) != 1:
        raise SystemExit("ring_dynamic_probe: the ring kernel's declaration changed")
    text = text.replace(HEAD, COUNTERS + HEAD)
    k0 = text.index("rmsnorm_backward_ring_kernel(const T*")
    spans = [("  const long long row0 = (long long)blockIdx.x * G + threadIdx.y;",
              "  int s = 0;  // the stage of row group t", SETUP),
             ("  int s = 0;  // the stage of row group t",
              "  if (dw_partial == nullptr) return;  // no weight", LOOP)]
    for begin, end, new in spans:
        a, b = text.find(begin, k0), text.find(end, k0)
        if a < 0 or b < a:
            raise SystemExit(f"ring_dynamic_probe: the ring kernel changed, anchor not found:\n{begin}")
        text = text[:a] + new + text[b:]
    text = text.replace("DYN_AHEAD", str(ahead))
    if not dynamic:
        assert text.count(STATIC_CLAIM[0]) == 1
        text = text.replace(*STATIC_CLAIM)
    return text


def write(out: pathlib.Path, ahead: int = 3) -> list[pathlib.Path]:
    """Writes <out>/dynamic and <out>/static (copies of kernels_src, rmsnorm.cu patched)."""
    dirs = []
    for name, dynamic in (("dynamic", True), ("static", False)):
        d = out / name
        shutil.copytree(SRC, d, dirs_exist_ok=True)
        (d / "rmsnorm.cu").write_text(patched_source((SRC / "rmsnorm.cu").read_text(), ahead, dynamic))
        dirs.append(d)
    return dirs


if __name__ == "__main__":
    for d in write(pathlib.Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3):
        print(d)

// softmax: y = softmax(scale * x) over the last dim, and its backward dx = scale * y * (dy - <dy, y>).
//
// Rows of length C. Plain softmax: scale = 1, causal = 0, every element counts. Fused causal attention
// (causal = 1): the rows are the (T, T) score matrices of preatt (B, NH, T, T) flattened, C = T, and
// row r, query position i = r % T, normalises its first i + 1 entries; the rest are written as exact
// zeros (NaN in the forward where the row's sum is NaN, as torch's masked softmax has them), in both
// directions, and never read. Forward saves only its output y for backward; backward
// recomputes nothing. fp32 math throughout, whatever the storage type.
//
// Layouts, chosen by the launcher from the row length (capacities in 16-byte packs):
// - softmax_{forward,backward}_kernel<T, P, true>:  one warp per row, P packs per lane in registers
//   (rows up to 32 * P packs): each lane issues all its loads first, then shuffle-only reductions;
// - softmax_forward_warps_kernel<T, P, S>: plain 16-bit rows of 33..128 packs that all start 16-byte
//   aligned: persistent warps on a grid sized to the GPU, each a balanced range of rows staged
//   through S row slots of shared memory by cp.async, packed 16-bit max, ~8 instructions per element;
// - softmax_{forward,backward}_kernel<T, P, false>: one block per row, P packs per thread in
//   registers (rows up to blockDim.x * P packs): per-warp reductions, then one __syncthreads to
//   combine the warps' (max, sum) or <dy, y> partials;
//   both read the row once, take exp2 once per element (x pre-scaled by scale * log2e) and keep the
//   results in registers until the normalised row is written. They need x, y (and dy) to share
//   their address modulo 16 (`vec` in the launcher).
// - softmax_{forward,backward}_stream_kernel<T>: one block per row for rows too long for registers,
//   and for any row when `vec` does not hold: pass 1 reads the row once (online max and sum, or
//   <dy, y>), pass 2 reads it again back to front, so the part pass 1 read last (most likely still in
//   L1/L2) is read first, and writes with streaming stores that do not push the rest of the row out
//   of L2.
// Rows need not start 16-byte aligned (C = 50257): each row is split into up to V-1 leading scalars,
// aligned packs, and up to V-1 trailing scalars; x, y (and dy) rows share one alignment because the
// launcher checks their base pointers agree modulo 16 (`vec`; else packs are moved element-wise).
//
// Causal rows in the register kernels: the packs of a row are handled in slots of W (lanes or
// threads) packs, k * W + lane; a slot is classified for the whole warp / block as fully counted (no
// per-element checks), partly counted (the diagonal: per-element selects), or past the diagonal
// (zeros written, nothing read or computed).
#include "common.cuh"

// Rows split around 16-byte boundaries by split_row (common.cuh): head scalars, packs, tail scalars.

// Pack moves: 16-byte accesses when `vec`, else element-wise (no alignment needed).
template <typename T>
KF_DEVICE Pack128<T> load_pack(const T* p, int vec) {
  if (vec) return load128(p);
  Pack128<T> r;
#pragma unroll
  for (int i = 0; i < Pack128<T>::size; ++i) r[i] = p[i];
  return r;
}
template <typename T>
KF_DEVICE Pack128<T> load_pack_cs(const T* p, int vec) {
  return vec ? load128cs(p) : load_pack(p, 0);
}
// Streaming store: the stream kernels' outputs must not evict the row that pass 2 re-reads from L2.
template <typename T>
KF_DEVICE void store_pack_cs(T* p, const Pack128<T>& x, int vec) {
  if (vec) {
    store128cs(p, x);
    return;
  }
#pragma unroll
  for (int i = 0; i < Pack128<T>::size; ++i) p[i] = x[i];
}

// Online softmax state: running max m and sum s of exp(v - m). Adding n values with maximum vmax
// rescales s at most once. Values of -inf add nothing (also while m is still -inf, where exp(v - m)
// would be NaN); a NaN makes s NaN, so the row's output is NaN as in PyTorch.
template <int N>
KF_DEVICE void online_add(float& m, float& s, const float (&v)[N], float vmax) {
  if (vmax > m) {
    s *= __expf(m - vmax);  // m = -inf: s is 0 and stays 0
    m = vmax;
  }
  if (m > -KF_INF) {
#pragma unroll
    for (int i = 0; i < N; ++i) s += __expf(v[i] - m);
  }
}

// ---- register-resident rows: helpers ------------------------------------------------------------
#define SM_LOG2E 1.4426950408889634f

KF_DEVICE float sm_ex2(float x) {  // 2^x; -inf -> +0, NaN -> NaN
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// unpack128 / pack128 (common.cuh): a pack's values as floats and back, two per conversion.

// Where the counted part of a row ends, in packs of its aligned middle: packs [0, full) are fully
// counted, packs [full, some) partly (at most one: the diagonal), packs [some, npk) not at all.
struct RowSlots {
  int full, some;
};
KF_DEVICE RowSlots row_slots(const RowSplit<int>& s, int L, int V) {
  if (L <= s.head) return {0, 0};
  return {min(s.npk, (L - s.head) / V), min(s.npk, (L - s.head + V - 1) / V)};
}

// One __syncthreads: every thread gets the sum over the block of the per-warp sums `v` (lane 0's).
KF_DEVICE float block_sum_of_warps(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_sum(lane < nwarps ? scratch[lane] : 0.0f);
}

// ---- forward ------------------------------------------------------------------------------------
// Register-resident rows. WarpRow: one warp per row, blockDim.x / 32 rows per block; else one block
// per row. Lane `lane` of the W threads of a row holds packs lane, lane + W, ..., lane + (P-1) W.
// scale2 = scale * log2(e): y = 2^(x * scale2 - max) / sum.
template <typename T, int P, bool WarpRow>
__global__ void __launch_bounds__(WarpRow ? 128 : 512)
    softmax_forward_kernel(const T* __restrict__ x, T* __restrict__ y, int rows, int C, int causal,
                           float scale2) {
  kf_wait_prior_grids();
  constexpr int V = Pack128<T>::size;
  __shared__ float scratch[2][32];
  const int W = WarpRow ? 32 : blockDim.x;
  const int lane = WarpRow ? (threadIdx.x & 31) : threadIdx.x;
  const int row = WarpRow ? blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5) : blockIdx.x;
  if (row >= rows) return;  // WarpRow only (the whole warp leaves; no block barriers there)
  const T* xr = x + (i64)row * C;
  T* yr = y + (i64)row * C;
  const int L = causal ? row % C + 1 : C;  // elements of the row that count
  const RowSplit<int> s = split_row(xr, C, 1);
  const RowSlots sl = row_slots(s, L, V);

  // All loads first: the packs holding counted elements, then the scalar head and tail.
  Pack128<T> buf[P];
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int pk = k * W + lane;
    if (pk < sl.some) buf[k] = load128(xr + s.head + pk * V);
  }
  const int he = lane, te = s.head + s.npk * V + lane;
  const bool hv = lane < s.head && he < L, tv = lane < s.tail && te < L;
  const float hx = hv ? to_float(xr[he]) : 0.0f, tx = tv ? to_float(xr[te]) : 0.0f;

  // The row as floats, and this thread's max of x * scale2 over the counted elements.
  float v[P][V];
  float m = fmaxf(hv ? hx * scale2 : -KF_INF, tv ? tx * scale2 : -KF_INF);
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int pk = k * W + lane, e = s.head + pk * V;
    if ((k + 1) * W <= sl.full) {  // the whole slot counts
      unpack128(buf[k], v[k]);
#pragma unroll
      for (int i = 0; i < V; ++i) m = fmaxf(m, v[k][i] * scale2);
    } else if (k * W < sl.some) {  // the diagonal slot
      unpack128(buf[k], v[k]);
#pragma unroll
      for (int i = 0; i < V; ++i) m = fmaxf(m, pk < sl.some && e + i < L ? v[k][i] * scale2 : -KF_INF);
    }
  }
  m = warp_max(m);
  // Exponents relative to the warp's max (for a block row, 0 when the warp saw only -inf, so that
  // its exps are 0 rather than NaN; a row of only -inf still comes out NaN, as in PyTorch). The
  // fma keeps x * scale2 exact, so the only rounding is of the (small) difference to the max.
  const float r = WarpRow || m > -KF_INF ? m : 0.0f;
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int pk = k * W + lane, e = s.head + pk * V;
    if ((k + 1) * W <= sl.full) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        v[k][i] = sm_ex2(fmaf(v[k][i], scale2, -r));
        sum += v[k][i];
      }
    } else if (k * W < sl.some) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        v[k][i] = pk < sl.some && e + i < L ? sm_ex2(fmaf(v[k][i], scale2, -r)) : 0.0f;
        sum += v[k][i];
      }
    }
  }
  const float eh = sm_ex2(fmaf(hx, scale2, -r)), et = sm_ex2(fmaf(tx, scale2, -r));
  if (hv) sum += eh;
  if (tv) sum += et;
  sum = warp_sum(sum);

  float f;  // output = exp * f
  if (WarpRow) {
    f = 1.0f / sum;
  } else {  // combine the warps' (max, sum) pairs: one barrier
    const int wl = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if (wl == 0) {
      scratch[0][warp] = m;
      scratch[1][warp] = sum;
    }
    __syncthreads();
    const float mw = wl < nwarps ? scratch[0][wl] : -KF_INF;
    const float sw = wl < nwarps ? scratch[1][wl] : 0.0f;
    const float M = warp_max(mw);
    const float S = warp_sum(mw > -KF_INF ? sw * sm_ex2(mw - M) : 0.0f * sw);
    const float inv = 1.0f / S;
    f = m > -KF_INF ? sm_ex2(m - M) * inv : 0.0f * inv;  // all -inf row: 0 * inf = NaN
  }

#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int pk = k * W + lane, e = s.head + pk * V;
    if ((k + 1) * W <= sl.full) {
      float o[V];
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] = v[k][i] * f;
      store128(yr + e, pack128<T>(o));
    } else if (k * W < sl.some) {
      if (pk < s.npk) {
        float o[V];
#pragma unroll
        for (int i = 0; i < V; ++i) o[i] = pk < sl.some && e + i < L ? v[k][i] * f : 0.0f * f;
        store128(yr + e, pack128<T>(o));
      }
    } else if (k * W < s.npk) {  // past the diagonal: zeros
      if (pk < s.npk) {
        float z[V];
#pragma unroll
        for (int i = 0; i < V; ++i) z[i] = 0.0f * f;
        store128(yr + e, pack128<T>(z));
      }
    }
  }
  if (lane < s.head) yr[he] = from_float<T>(hv ? eh * f : 0.0f * f);
  if (lane < s.tail) yr[te] = from_float<T>(tv ? et * f : 0.0f * f);
}

// Persistent warps for plain 16-bit rows (no causal mask) of 33..128 packs, all on 16-byte boundaries:
// the launcher sizes the grid to the GPU (blocks of 16 warps, a few per SM) and each warp takes a
// contiguous range of rows (counts differ by at most one across warps, the longer ranges spread
// over the blocks, so the SMs finish together). Rows are staged by cp.async through a ring of S row
// slots per warp in shared memory (S = 2: the launcher's kWarpSlots): the first S rows are requested up front, and a slot is refilled with row i + S as soon as row i's
// packs are in registers (after its max), so up to S rows per warp are in flight behind the math.
// Each lane reads back only the packs it copied itself: cp.async.wait_group alone orders it.
// Few instructions per element: the max is taken on the packed 16-bit pairs (max.bf16x2 /
// max.f16x2, exact, NaN-ignoring like fmaxf), each pair is widened once, exp2 of x * scale2 - max
// (one FFMA + one MUFU.EX2), the sum in P independent chains, one reciprocal per row, and the
// outputs packed two per cvt. Slots 0..P/2-1 of a row are always full (npk > 16 P); the others are
// checked per lane, their missing packs read as -inf (they add 0; an all -inf row gives NaN).
template <typename T>
KF_DEVICE u32 max2(u32 a, u32 b);
template <>
KF_DEVICE u32 max2<bf16>(u32 a, u32 b) {
  u32 r;
  asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
template <>
KF_DEVICE u32 max2<half>(u32 a, u32 b) {
  u32 r;
  asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
template <typename T>
KF_DEVICE u32 ninf2();  // a pair of -inf
template <>
KF_DEVICE u32 ninf2<bf16>() { return 0xff80ff80u; }
template <>
KF_DEVICE u32 ninf2<half>() { return 0xfc00fc00u; }
KF_DEVICE float sm_rcp(float x) {  // 1/x, rel. error <= 1 ulp; 0 -> inf, NaN -> NaN
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}


// Rows: tw = gridDim.x * warps per block warps take rows = q * tw + rem rows, q or q + 1 each (the
// launcher divides). Warp `warp` of block b is number o = warp * gridDim.x + b in row order, so the
// rem warps with an extra row (o < rem) are spread over all blocks, and SMs get equal row counts
// within one row per block. No division in the kernel: the first copies go out at once.
template <typename T, int P, int S>
__global__ void __launch_bounds__(512, 2)
    softmax_forward_warps_kernel(const T* __restrict__ x, T* __restrict__ y, int q, int rem, int C,
                                 float scale2) {
  kf_wait_prior_grids();
  constexpr int V = 8;  // 16-bit elements per pack
  extern __shared__ uint4 ring[];  // per warp: S slots of P * 32 packs, pack k of lane at k * 32 + lane
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int o = warp * gridDim.x + blockIdx.x;
  const int r0 = o * q + min(o, rem), n = q + (o < rem ? 1 : 0);  // r0 + n <= rows < 2^31
  if (n <= 0) return;  // the whole warp leaves (no block barriers here)
  const int npk = C / V;
  bool has[P];  // this lane's pack of slot k exists
#pragma unroll
  for (int k = 0; k < P; ++k) has[k] = k < P / 2 || k * 32 + lane < npk;
  const uint4* mine = ring + warp * (S * P * 32) + lane;
  const u32 smine = smem_u32(mine);
  const T* xw = x + (long long)r0 * C + lane * V;
  T* yw = y + (long long)r0 * C + lane * V;

#pragma unroll
  for (int s = 0; s < S; ++s) {
    if (s < n) {
#pragma unroll
      for (int k = 0; k < P; ++k)
        if (has[k]) cp_async16_after(smine + (s * P + k) * 512, xw + (long long)s * C + k * 32 * V, 0.0f);
    }
    cp_async_commit();  // always: wait_group counts groups
  }

  int s = 0;  // ring slot of row i
  for (int i = 0; i < n; ++i) {
    cp_async_wait<S - 1>();  // row i's group has landed
    u32 w[P][4];
#pragma unroll
    for (int k = 0; k < P; ++k) {
      uint4 v = make_uint4(ninf2<T>(), ninf2<T>(), ninf2<T>(), ninf2<T>());
      if (has[k]) v = mine[(s * P + k) * 32];
      w[k][0] = v.x;
      w[k][1] = v.y;
      w[k][2] = v.z;
      w[k][3] = v.w;
    }
    // Max over the packed pairs (a tree), then the two halves, then the warp.
    u32 mk[P];
#pragma unroll
    for (int k = 0; k < P; ++k) mk[k] = max2<T>(max2<T>(w[k][0], w[k][1]), max2<T>(w[k][2], w[k][3]));
#pragma unroll
    for (int h = 1; h < P; h *= 2)
#pragma unroll
      for (int k = 0; k + h < P; k += 2 * h) mk[k] = max2<T>(mk[k], mk[k + h]);
    float mlo, mhi;
    Word<T>::widen(mk[0], mlo, mhi);
    const float m = warp_max(fmaxf(mlo, mhi)) * scale2;  // all -inf row: -inf, outputs NaN

    // Row i is in registers: refill its slot with row i + S. The copies take m as an (unused)
    // operand, so they issue only once every value read from the slot has arrived.
    if (i + S < n) {
      const T* xr = xw + (long long)(i + S) * C;
#pragma unroll
      for (int k = 0; k < P; ++k)
        if (has[k]) cp_async16_after(smine + (s * P + k) * 512, xr + k * 32 * V, m);
    }
    cp_async_commit();

    float e[P][V], sk[P];
#pragma unroll
    for (int k = 0; k < P; ++k) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float lo, hi;
        Word<T>::widen(w[k][j], lo, hi);
        e[k][2 * j] = sm_ex2(fmaf(lo, scale2, -m));
        e[k][2 * j + 1] = sm_ex2(fmaf(hi, scale2, -m));
      }
      sk[k] = ((e[k][0] + e[k][1]) + (e[k][2] + e[k][3])) + ((e[k][4] + e[k][5]) + (e[k][6] + e[k][7]));
    }
#pragma unroll
    for (int h = 1; h < P; h *= 2)
#pragma unroll
      for (int k = 0; k + h < P; k += 2 * h) sk[k] += sk[k + h];
    const float f = sm_rcp(warp_sum(sk[0]));

    T* yr = yw + (long long)i * C;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      if (has[k]) {
        uint4 o;
        o.x = Word<T>::pack2(e[k][0] * f, e[k][1] * f);
        o.y = Word<T>::pack2(e[k][2] * f, e[k][3] * f);
        o.z = Word<T>::pack2(e[k][4] * f, e[k][5] * f);
        o.w = Word<T>::pack2(e[k][6] * f, e[k][7] * f);
        *reinterpret_cast<uint4*>(yr + k * 32 * V) = o;
      }
    }
    if (++s == S) s = 0;
  }
}

// Streaming rows: one block per row, U packs in flight per thread per step.
template <typename T>
__global__ void __launch_bounds__(512, 2)
    softmax_forward_stream_kernel(const T* __restrict__ x, T* __restrict__ y, long long rows, int C,
                                  int causal, float scale, int vec) {
  kf_wait_prior_grids();
  constexpr int V = Pack128<T>::size, U = 4;
  __shared__ float scratch[32];
  const int W = blockDim.x, lane = threadIdx.x;
  const long long row = blockIdx.x;
  const T* xr = x + row * C;
  T* yr = y + row * C;
  const int L = causal ? (int)(row % C) + 1 : C;
  const RowSplit<int> s = split_row(xr, C, vec);
  // Packs holding at least one counted element.
  const int nv = L <= s.head ? 0 : min(s.npk, (L - s.head + V - 1) / V);

  // Pass 1: per-thread online (max, sum), then combined across the block.
  float m = -KF_INF, sum = 0.f;
  for (int base = lane; base < nv; base += U * W) {
    Pack128<T> b[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (base + u * W < nv) b[u] = load_pack(xr + s.head + (base + u * W) * V, vec);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int pk = base + u * W, e = s.head + pk * V;
      if (pk < nv) {
        float v[V], vmax = -KF_INF;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          v[i] = e + i < L ? scale * b[u].f(i) : -KF_INF;
          vmax = fmaxf(vmax, v[i]);
        }
        online_add(m, sum, v, vmax);
      }
    }
  }
  const int he = lane, te = s.head + s.npk * V + lane;
  const bool hv = lane < s.head && he < L, tv = lane < s.tail && te < L;
  const float hx = hv ? scale * to_float(xr[he]) : -KF_INF;
  const float tx = tv ? scale * to_float(xr[te]) : -KF_INF;
  {
    const float v[2] = {hx, tx};
    online_add(m, sum, v, fmaxf(hx, tx));
  }
  const float M = block_max(m, scratch);
  sum = m == -KF_INF ? 0.f : sum * __expf(m - M);  // a thread that saw nothing adds nothing
  const float inv = 1.f / block_sum(sum, scratch);

  // Pass 2, back to front: j counts packs from the end of the row.
  for (int base = lane; base < s.npk; base += U * W) {
    Pack128<T> b[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = base + u * W, e = s.head + (s.npk - 1 - j) * V;
      if (j < s.npk && e < L) b[u] = load_pack_cs(xr + e, vec);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = base + u * W, e = s.head + (s.npk - 1 - j) * V;
      if (j < s.npk) {
        Pack128<T> o;
#pragma unroll
        for (int i = 0; i < V; ++i) o.set(i, e + i < L ? __expf(scale * b[u].f(i) - M) * inv : 0.f * inv);
        store_pack_cs(yr + e, o, vec);
      }
    }
  }
  if (lane < s.head) yr[he] = from_float<T>(hv ? __expf(hx - M) * inv : 0.f * inv);
  if (lane < s.tail) yr[te] = from_float<T>(tv ? __expf(tx - M) * inv : 0.f * inv);
}

// ---- backward -----------------------------------------------------------------------------------
// dx = scale * y * (dy - <dy, y>) over the counted elements, 0 elsewhere. Same layouts as forward.
template <typename T, int P, bool WarpRow>
__global__ void __launch_bounds__(WarpRow ? 128 : 512)
    softmax_backward_kernel(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                            int rows, int C, int causal, float scale) {
  kf_wait_prior_grids();
  constexpr int V = Pack128<T>::size;
  __shared__ float scratch[32];
  const int W = WarpRow ? 32 : blockDim.x;
  const int lane = WarpRow ? (threadIdx.x & 31) : threadIdx.x;
  const int row = WarpRow ? blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5) : blockIdx.x;
  if (row >= rows) return;  // WarpRow only
  const i64 off = (i64)row * C;
  const int L = causal ? row % C + 1 : C;
  const RowSplit<int> s = split_row(y + off, C, 1);
  const RowSlots sl = row_slots(s, L, V);

  Pack128<T> by[P], bg[P];
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int pk = k * W + lane, e = s.head + pk * V;
    if (pk < sl.some) {
      by[k] = load128(y + off + e);
      bg[k] = load128(dy + off + e);
    }
  }
  const int he = lane, te = s.head + s.npk * V + lane;
  const bool hv = lane < s.head && he < L, tv = lane < s.tail && te < L;
  const float hy = hv ? to_float(y[off + he]) : 0.f, hg = hv ? to_float(dy[off + he]) : 0.f;
  const float ty = tv ? to_float(y[off + te]) : 0.f, tg = tv ? to_float(dy[off + te]) : 0.f;

  float dot = hy * hg + ty * tg;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int pk = k * W + lane, e = s.head + pk * V;
    if ((k + 1) * W <= sl.full || k * W < sl.some) {
      float fy[V], fg[V];
      unpack128(by[k], fy);
      unpack128(bg[k], fg);
      if ((k + 1) * W <= sl.full) {
#pragma unroll
        for (int i = 0; i < V; ++i) dot = fmaf(fy[i], fg[i], dot);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) dot += pk < sl.some && e + i < L ? fy[i] * fg[i] : 0.0f;
      }
    }
  }
  dot = warp_sum(dot);
  if (!WarpRow) dot = block_sum_of_warps(dot, scratch);

#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int pk = k * W + lane, e = s.head + pk * V;
    if ((k + 1) * W <= sl.full) {
      float fy[V], fg[V], o[V];
      unpack128(by[k], fy);
      unpack128(bg[k], fg);
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] = scale * fy[i] * (fg[i] - dot);
      store128(dx + off + e, pack128<T>(o));
    } else if (k * W < sl.some) {
      if (pk < s.npk) {
        float fy[V], fg[V], o[V];
        unpack128(by[k], fy);
        unpack128(bg[k], fg);
#pragma unroll
        for (int i = 0; i < V; ++i) o[i] = pk < sl.some && e + i < L ? scale * fy[i] * (fg[i] - dot) : 0.0f;
        store128(dx + off + e, pack128<T>(o));
      }
    } else if (k * W < s.npk) {
      if (pk < s.npk) {
        const float z[V] = {};
        store128(dx + off + e, pack128<T>(z));
      }
    }
  }
  if (lane < s.head) dx[off + he] = from_float<T>(hv ? scale * hy * (hg - dot) : 0.f);
  if (lane < s.tail) dx[off + te] = from_float<T>(tv ? scale * ty * (tg - dot) : 0.f);
}

template <typename T>
__global__ void __launch_bounds__(512, 2)
    softmax_backward_stream_kernel(const T* __restrict__ dy, const T* __restrict__ y,
                                   T* __restrict__ dx, long long rows, int C, int causal,
                                   float scale, int vec) {
  kf_wait_prior_grids();
  // U packs of y and of dy in flight per thread per step; 16-bit types hold them as 2x more
  // fp32 values, so fewer packs keep two 512-thread blocks per SM without spills.
  constexpr int V = Pack128<T>::size, U = sizeof(T) == 4 ? 4 : 2;
  __shared__ float scratch[32];
  const int W = blockDim.x, lane = threadIdx.x;
  const long long off = (long long)blockIdx.x * C;
  const int L = causal ? (int)(blockIdx.x % C) + 1 : C;
  const RowSplit<int> s = split_row(y + off, C, vec);
  const int nv = L <= s.head ? 0 : min(s.npk, (L - s.head + V - 1) / V);

  // Pass 1: <dy, y>.
  float dot = 0.f;
  for (int base = lane; base < nv; base += U * W) {
    Pack128<T> by[U], bg[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int e = s.head + (base + u * W) * V;
      if (base + u * W < nv) {
        by[u] = load_pack(y + off + e, vec);
        bg[u] = load_pack(dy + off + e, vec);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int pk = base + u * W, e = s.head + pk * V;
      if (pk < nv) {
#pragma unroll
        for (int i = 0; i < V; ++i)
          if (e + i < L) dot += by[u].f(i) * bg[u].f(i);
      }
    }
  }
  const int he = lane, te = s.head + s.npk * V + lane;
  const bool hv = lane < s.head && he < L, tv = lane < s.tail && te < L;
  const float hy = hv ? to_float(y[off + he]) : 0.f, hg = hv ? to_float(dy[off + he]) : 0.f;
  const float ty = tv ? to_float(y[off + te]) : 0.f, tg = tv ? to_float(dy[off + te]) : 0.f;
  dot = block_sum(dot + hy * hg + ty * tg, scratch);

  // Pass 2, back to front.
  for (int base = lane; base < s.npk; base += U * W) {
    Pack128<T> by[U], bg[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = base + u * W, e = s.head + (s.npk - 1 - j) * V;
      if (j < s.npk && e < L) {
        by[u] = load_pack_cs(y + off + e, vec);
        bg[u] = load_pack_cs(dy + off + e, vec);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = base + u * W, e = s.head + (s.npk - 1 - j) * V;
      if (j < s.npk) {
        Pack128<T> o;
#pragma unroll
        for (int i = 0; i < V; ++i)
          o.set(i, e + i < L ? scale * by[u].f(i) * (bg[u].f(i) - dot) : 0.f);
        store_pack_cs(dx + off + e, o, vec);
      }
    }
  }
  if (lane < s.head) dx[off + he] = from_float<T>(hv ? scale * hy * (hg - dot) : 0.f);
  if (lane < s.tail) dx[off + te] = from_float<T>(tv ? scale * ty * (tg - dot) : 0.f);
}

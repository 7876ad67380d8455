// softmax: y = softmax(scale * x) over the last dim, and its backward dx = scale * y * (dy - <dy, y>).
//
// Rows of length C. Plain softmax: scale = 1, causal = 0, every element counts. Fused causal attention
// (causal = 1): the rows are the (T, T) score matrices of preatt (B, NH, T, T) flattened, C = T, and
// row r, query position i = r % T, normalises its first i + 1 entries; the rest are written as exact
// zeros, in both directions, and never read. Forward saves only its output y for backward; backward
// recomputes nothing. fp32 math throughout, whatever the storage type.
//
// Layouts, chosen by the launcher from the row length (capacities in 16-byte packs):
// - softmax_{forward,backward}_kernel<T, P, true>:  one warp per row, P packs per lane in registers
//   (rows up to 32 * P packs);
// - softmax_{forward,backward}_kernel<T, P, false>: one block per row, P packs per thread in
//   registers (rows up to blockDim.x * P packs);
// - softmax_{forward,backward}_stream_kernel<T>: one block per row for rows too long for registers:
//   pass 1 reads the row once (online max and sum, or <dy, y>), pass 2 reads it again back to front,
//   so the part pass 1 read last (most likely still in L1/L2) is read first, and writes with
//   streaming stores that do not push the rest of the row out of L2.
// Rows need not start 16-byte aligned (C = 50257): each row is split into up to V-1 leading scalars,
// aligned packs, and up to V-1 trailing scalars; x, y (and dy) rows share one alignment because the
// launcher checks their base pointers agree modulo 16 (`vec`; else packs are moved element-wise).
#include "common.cuh"

// How a row of n elements splits around 16-byte boundaries.
struct RowSplit {
  int head;  // leading scalars before the first 16-byte boundary
  int npk;   // whole packs after them
  int tail;  // trailing scalars
};

template <typename T>
KF_DEVICE RowSplit split_row(const T* row, int n, int vec) {
  constexpr int V = Pack128<T>::size;
  RowSplit s;
  s.head = 0;
  if (vec) {
    const int mis = (int)((reinterpret_cast<u64>(row) & 15) / sizeof(T));
    s.head = min(n, (V - mis) % V);
  }
  s.npk = (n - s.head) / V;
  s.tail = n - s.head - s.npk * V;
  return s;
}

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
  if (vec) return load128cs(p);
  Pack128<T> r;
#pragma unroll
  for (int i = 0; i < Pack128<T>::size; ++i) r[i] = p[i];
  return r;
}
template <typename T>
KF_DEVICE void store_pack(T* p, const Pack128<T>& x, int vec) {
  if (vec) {
    store128(p, x);
    return;
  }
#pragma unroll
  for (int i = 0; i < Pack128<T>::size; ++i) p[i] = x[i];
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

template <bool WarpRow>
KF_DEVICE float row_max(float v, float* scratch) {
  return WarpRow ? warp_max(v) : block_max(v, scratch);
}
template <bool WarpRow>
KF_DEVICE float row_sum(float v, float* scratch) {
  return WarpRow ? warp_sum(v) : block_sum(v, scratch);
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

// ---- forward ------------------------------------------------------------------------------------
// Register-resident rows. WarpRow: one warp per row, blockDim.x / 32 rows per block; else one block
// per row. Lane `lane` of the W threads of a row holds packs lane, lane + W, ..., lane + (P-1) W.
template <typename T, int P, bool WarpRow>
__global__ void __launch_bounds__(WarpRow ? 256 : 512)
    softmax_forward_kernel(const T* __restrict__ x, T* __restrict__ y, long long rows, int C,
                           int causal, float scale, int vec) {
  constexpr int V = Pack128<T>::size;
  __shared__ float scratch[32];
  const int W = WarpRow ? 32 : blockDim.x;
  const int lane = WarpRow ? (threadIdx.x & 31) : threadIdx.x;
  const long long row =
      WarpRow ? (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5) : (long long)blockIdx.x;
  if (row >= rows) return;  // WarpRow only (the whole warp leaves; no block barriers there)
  const T* xr = x + row * C;
  T* yr = y + row * C;
  const int L = causal ? (int)(row % C) + 1 : C;  // elements of the row that count
  const RowSplit s = split_row(xr, C, vec);

  Pack128<T> buf[P];
  float m = -KF_INF;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int pk = k * W + lane, e = s.head + pk * V;
    if (pk < s.npk && e < L) {
      buf[k] = load_pack(xr + e, vec);
#pragma unroll
      for (int i = 0; i < V; ++i)
        if (e + i < L) m = fmaxf(m, scale * buf[k].f(i));
    }
  }
  const int he = lane, te = s.head + s.npk * V + lane;
  const bool hv = lane < s.head && he < L, tv = lane < s.tail && te < L;
  const float hx = hv ? scale * to_float(xr[he]) : -KF_INF;
  const float tx = tv ? scale * to_float(xr[te]) : -KF_INF;
  m = row_max<WarpRow>(fmaxf(m, fmaxf(hx, tx)), scratch);

  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int pk = k * W + lane, e = s.head + pk * V;
    if (pk < s.npk && e < L) {
#pragma unroll
      for (int i = 0; i < V; ++i)
        if (e + i < L) sum += __expf(scale * buf[k].f(i) - m);
    }
  }
  if (hv) sum += __expf(hx - m);
  if (tv) sum += __expf(tx - m);
  const float inv = 1.f / row_sum<WarpRow>(sum, scratch);

#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int pk = k * W + lane, e = s.head + pk * V;
    if (pk < s.npk) {
      Pack128<T> o;
#pragma unroll
      for (int i = 0; i < V; ++i) o.set(i, e + i < L ? __expf(scale * buf[k].f(i) - m) * inv : 0.f);
      store_pack(yr + e, o, vec);
    }
  }
  if (lane < s.head) yr[he] = from_float<T>(hv ? __expf(hx - m) * inv : 0.f);
  if (lane < s.tail) yr[te] = from_float<T>(tv ? __expf(tx - m) * inv : 0.f);
}

// Streaming rows: one block per row, U packs in flight per thread per step.
template <typename T>
__global__ void __launch_bounds__(512, 2)
    softmax_forward_stream_kernel(const T* __restrict__ x, T* __restrict__ y, long long rows, int C,
                                  int causal, float scale, int vec) {
  constexpr int V = Pack128<T>::size, U = 4;
  __shared__ float scratch[32];
  const int W = blockDim.x, lane = threadIdx.x;
  const long long row = blockIdx.x;
  const T* xr = x + row * C;
  T* yr = y + row * C;
  const int L = causal ? (int)(row % C) + 1 : C;
  const RowSplit s = split_row(xr, C, vec);
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
        for (int i = 0; i < V; ++i) o.set(i, e + i < L ? __expf(scale * b[u].f(i) - M) * inv : 0.f);
        store_pack_cs(yr + e, o, vec);
      }
    }
  }
  if (lane < s.head) yr[he] = from_float<T>(hv ? __expf(hx - M) * inv : 0.f);
  if (lane < s.tail) yr[te] = from_float<T>(tv ? __expf(tx - M) * inv : 0.f);
}

// ---- backward -----------------------------------------------------------------------------------
// dx = scale * y * (dy - <dy, y>) over the counted elements, 0 elsewhere. Same layouts as forward.
template <typename T, int P, bool WarpRow>
__global__ void __launch_bounds__(WarpRow ? 256 : 512)
    softmax_backward_kernel(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dx,
                            long long rows, int C, int causal, float scale, int vec) {
  constexpr int V = Pack128<T>::size;
  __shared__ float scratch[32];
  const int W = WarpRow ? 32 : blockDim.x;
  const int lane = WarpRow ? (threadIdx.x & 31) : threadIdx.x;
  const long long row =
      WarpRow ? (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5) : (long long)blockIdx.x;
  if (row >= rows) return;  // WarpRow only
  const long long off = row * C;
  const int L = causal ? (int)(row % C) + 1 : C;
  const RowSplit s = split_row(y + off, C, vec);

  Pack128<T> by[P], bg[P];
  float dot = 0.f;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int pk = k * W + lane, e = s.head + pk * V;
    if (pk < s.npk && e < L) {
      by[k] = load_pack(y + off + e, vec);
      bg[k] = load_pack(dy + off + e, vec);
#pragma unroll
      for (int i = 0; i < V; ++i)
        if (e + i < L) dot += by[k].f(i) * bg[k].f(i);
    }
  }
  const int he = lane, te = s.head + s.npk * V + lane;
  const bool hv = lane < s.head && he < L, tv = lane < s.tail && te < L;
  const float hy = hv ? to_float(y[off + he]) : 0.f, hg = hv ? to_float(dy[off + he]) : 0.f;
  const float ty = tv ? to_float(y[off + te]) : 0.f, tg = tv ? to_float(dy[off + te]) : 0.f;
  dot = row_sum<WarpRow>(dot + hy * hg + ty * tg, scratch);

#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int pk = k * W + lane, e = s.head + pk * V;
    if (pk < s.npk) {
      Pack128<T> o;
#pragma unroll
      for (int i = 0; i < V; ++i)
        o.set(i, e + i < L ? scale * by[k].f(i) * (bg[k].f(i) - dot) : 0.f);
      store_pack(dx + off + e, o, vec);
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
  // U packs of y and of dy in flight per thread per step; 16-bit types hold them as 2x more
  // fp32 values, so fewer packs keep two 512-thread blocks per SM without spills.
  constexpr int V = Pack128<T>::size, U = sizeof(T) == 4 ? 4 : 2;
  __shared__ float scratch[32];
  const int W = blockDim.x, lane = threadIdx.x;
  const long long off = (long long)blockIdx.x * C;
  const int L = causal ? (int)(blockIdx.x % C) + 1 : C;
  const RowSplit s = split_row(y + off, C, vec);
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

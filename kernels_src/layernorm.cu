// layernorm over the last dim C of N = numel / C rows: y = (x - mean) * rstd * weight + bias,
// rstd = 1 / sqrt(var + eps) (biased variance); weight and bias are optional (nullptr).
// Forward saves mean and rstd (fp32, one per row). Backward recomputes xhat = (x - mean) * rstd from
// x and the saved stats, writes dx, and leaves per-block fp32 partial sums of dweight (dout * xhat)
// and dbias (dout) in a scratch tensor; a second kernel adds those partials in a fixed order, so
// dweight / dbias are bitwise reproducible (no float atomics).
//
// A unit is a 16-byte pack when VEC (C % pack == 0 and 16-byte aligned pointers), else one element.
// Two layouts, chosen by the launcher (src/ops/layernorm.cpp):
// - WARP (short rows: at most 32 * P units, P a template parameter): one warp per row, lane l owning
//   units l, l + 32, ... (at most P), held in registers, so x / dout are read from DRAM once and
//   every load of a row is issued before its first use; row sums by warp shuffles only (no shared
//   memory, no __syncthreads). Forward: blockDim (32, kFwdWarps), one row per warp (grid-stride
//   beyond). Backward: a persistent grid, each warp looping over rows (the next row's loads issued
//   before the current row is processed where registers allow) and keeping its dweight / dbias
//   column sums in registers; at the end the block's warps are added in warp order into one partial
//   row per block.
// - BLOCK (longer rows): blockDim.x threads (a multiple of 32) share one row, thread t owning the
//   row's units t, t + blockDim.x, ...; blockDim.y rows per block; blocks stride over groups of
//   blockDim.y rows. FITS: a thread owns at most kRegElems elements, so its part of the row stays in
//   registers and x / dout are read from DRAM once; otherwise (very long rows) the later passes
//   re-read them, mostly from L2.
#include "common.cuh"

// Elements one thread keeps in registers per row on the FITS path. src/ops/layernorm.cpp sizes
// blocks with the same constant.
constexpr int kRegElems = 8;
// Most rows one block works on at once (blockDim.y); sizes the reduction scratch.
constexpr int kMaxRowsPerBlock = 16;
// Largest block per path: FITS kernels hold more registers, so they are capped at 512 threads
// (<= 128 registers each); the others at 1024. The launcher respects both.
#define KF_LN_BOUNDS __launch_bounds__(FITS ? 512 : 1024)

// One element viewed as a unit of size 1, so the scalar and the 16-byte paths share their code.
template <typename T>
struct Elem1 {
  static constexpr int size = 1;
  T v[1];
  KF_DEVICE float f(int) const { return to_float(v[0]); }
  KF_DEVICE void set(int, float x) { v[0] = from_float<T>(x); }
};
template <bool VEC, typename T> struct UnitOf { using type = Elem1<T>; };
template <typename T> struct UnitOf<true, T> { using type = Pack128<T>; };
template <typename T, bool VEC> using Unit = typename UnitOf<VEC, T>::type;

template <typename T> KF_DEVICE void load_unit(Pack128<T>& r, const T* p) { r = load128(p); }
template <typename T> KF_DEVICE void load_unit(Elem1<T>& r, const T* p) { r.v[0] = *p; }
// Last read of data that is not needed again soon (evict-first for the 16-byte path).
template <typename T> KF_DEVICE void load_unit_last(Pack128<T>& r, const T* p) { r = load128cs(p); }
template <typename T> KF_DEVICE void load_unit_last(Elem1<T>& r, const T* p) { r.v[0] = *p; }
template <typename T> KF_DEVICE void store_unit(T* p, const Pack128<T>& r) { store128(p, r); }
template <typename T> KF_DEVICE void store_unit(T* p, const Elem1<T>& r) { *p = r.v[0]; }
// Hides a unit's bits from common-subexpression elimination (emits no instruction): fp32 values
// derived from it before must be recomputed after, so they need not stay live in between; only the
// unit (packed, for 16-bit types) does.
template <typename T> KF_DEVICE void opaque(Pack128<T>& r) {
  int4& q = *reinterpret_cast<int4*>(&r);
  asm("" : "+r"(q.x), "+r"(q.y), "+r"(q.z), "+r"(q.w));
}
KF_DEVICE void opaque(Elem1<float>& r) { asm("" : "+f"(r.v[0])); }
KF_DEVICE void opaque(Elem1<bf16>& r) { asm("" : "+h"(r.v[0].bits)); }
KF_DEVICE void opaque(Elem1<half>& r) { asm("" : "+h"(r.v[0].bits)); }

// Sum of (a, b) over the blockDim.x threads sharing this row (threadIdx.y). Every one of them gets
// the same bits: warp butterflies, then the per-warp sums added in warp order. Contains
// __syncthreads, so every thread of the block must call it the same number of times.
KF_DEVICE void row_sum2(float& a, float& b, float (*red)[kMaxRowsPerBlock][32]) {
  a = warp_sum(a);
  b = warp_sum(b);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (lane == 0) {
    red[0][threadIdx.y][warp] = a;
    red[1][threadIdx.y][warp] = b;
  }
  __syncthreads();
  a = 0.0f;
  b = 0.0f;
  for (int w = 0; w < nwarps; ++w) {
    a += red[0][threadIdx.y][w];
    b += red[1][threadIdx.y][w];
  }
  __syncthreads();  // red is reused by the next call
}
KF_DEVICE float row_sum(float a, float (*red)[kMaxRowsPerBlock][32]) {
  float unused = 0.0f;
  row_sum2(a, unused, red);
  return a;
}

// ---- WARP layout -------------------------------------------------------------------------------
// Rows (warps) per forward block; src/ops/layernorm.cpp launches blockDim (32, kFwdWarps).
constexpr int kFwdWarps = 4;
// Forward: where a lane's x, weight and bias units fit in 48 registers (bf16 C <= 768, fp32
// C <= 384), weight / bias are loaded before the variance is reduced (their latency hidden behind
// it); otherwise each just before its use (fewer registers, more warps).
template <typename T, bool VEC, int P>
struct LnFwdWarp {
  static constexpr int R = P * (((int)sizeof(Unit<T, VEC>) + 3) / 4);  // registers for P units
  static constexpr bool hoist = 3 * R <= 48;
};

// Backward configuration per instantiation: warps per block (= rows in flight per block; the
// launcher launches blockDim (32, warps) and one block per SM, which the register budget below
// keeps resident) and whether each warp issues the next row's loads before working on the current
// one (prefetch). A lane keeps in registers: 2 J fp32 column sums (J = P * V columns), its weight
// units, its x / dout units (twice with prefetch), R registers per P units of one tensor, plus about
// 32 others (an estimate: ptxas needs up to ~25 more). Prefetch wherever that fits (two rows in
// flight per warp beat more warps with one); then 16 / 12 / 8 warps for up to 128 / 168 / 255
// registers. src/ops/layernorm.cpp mirrors this (ln_bwd_warps).
template <typename T, bool VEC, int P>
struct LnBwdWarp {
  static constexpr int J = P * Unit<T, VEC>::size;
  static constexpr int R = P * (((int)sizeof(Unit<T, VEC>) + 3) / 4);
  static constexpr bool prefetch = 2 * J + 5 * R + 32 <= 224;
  static constexpr int regs = 2 * J + (prefetch ? 5 : 3) * R + 32;
  static constexpr int warps = regs <= 128 ? 16 : regs <= 168 ? 12 : 8;
};

// Loads this lane's units of one row (units lane, lane + 32, ... below `units`): load_row keeps
// them cached (weight, bias), load_row_last reads data used once (evict-first).
template <int P, typename U, typename T>
KF_DEVICE void load_row(U (&r)[P], const T* __restrict__ p, int lane, int units) {
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int u = lane + 32 * k;
    if (u < units) load_unit(r[k], p + u * U::size);
  }
}
template <int P, typename U, typename T>
KF_DEVICE void load_row_last(U (&r)[P], const T* __restrict__ p, int lane, int units) {
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int u = lane + 32 * k;
    if (u < units) load_unit_last(r[k], p + u * U::size);
  }
}

// Forward, one warp per row: mean and variance (around the mean) from registers by warp shuffles.
template <typename T, bool VEC, int P>
__global__ void __launch_bounds__(32 * kFwdWarps)
    layernorm_forward_warp_kernel(const T* __restrict__ x, const T* __restrict__ weight,
                                  const T* __restrict__ bias, T* __restrict__ out,
                                  float* __restrict__ mean, float* __restrict__ rstd, long long N,
                                  int C, float eps) {
  using U = Unit<T, VEC>;
  constexpr int V = U::size;
  constexpr bool HOIST = LnFwdWarp<T, VEC, P>::hoist;
  const int lane = threadIdx.x, units = C / V;
  for (i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y; row < N;
       row += (i64)gridDim.x * blockDim.y) {
    U xs[P];
    load_row_last<P>(xs, x + row * C, lane, units);

    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      if (lane + 32 * k < units) {
#pragma unroll
        for (int i = 0; i < V; ++i) s += xs[k].f(i);
      }
    }
    const float mu = warp_sum(s) / (float)C;
    // weight / bias units (L1 / L2 hits): for short slices all in flight while the variance is
    // reduced; otherwise each read just before its use (registers for more warps instead).
    U ws[P], bs[P];
    if constexpr (HOIST) {
      if (weight) load_row<P>(ws, weight, lane, units);
      if (bias) load_row<P>(bs, bias, lane, units);
    }
    float q = 0.0f;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      if (lane + 32 * k < units) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float d = xs[k].f(i) - mu;
          q += d * d;
        }
      }
    }
    const float rs = rsqrtf(warp_sum(q) / (float)C + eps);

    T* orow = out + row * C;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int u = lane + 32 * k;
      if (u < units) {
        U w, b, o;
        if constexpr (HOIST) {
          w = ws[k];
          b = bs[k];
        } else {
          if (weight) load_unit(w, weight + u * V);
          if (bias) load_unit(b, bias + u * V);
        }
#pragma unroll
        for (int i = 0; i < V; ++i) {
          float y = (xs[k].f(i) - mu) * rs;
          if (weight) y *= w.f(i);
          if (bias) y += b.f(i);
          o.set(i, y);
        }
        store_unit(orow + u * V, o);
      }
    }
    if (lane == 0) {
      mean[row] = mu;
      rstd[row] = rs;
    }
  }
}

// Backward, one warp per row, persistent: warp g of the grid (blockIdx.x * blockDim.y + threadIdx.y)
// takes rows g, g + G, g + 2G, ... (G = gridDim.x * blockDim.y), accumulating dout*xhat and dout for
// its columns in registers in row order. At the end the block's warps are added in warp order
// (shared memory: blockDim.y * C floats, dynamic) into partial[blockIdx.x] = [dweight | dbias].
// Every column's sum has a fixed order (rows of a warp, then warps): the result is reproducible.
template <typename T, bool VEC, int P>
__global__ void __launch_bounds__(32 * LnBwdWarp<T, VEC, P>::warps, 1)
    layernorm_backward_warp_kernel(const T* __restrict__ dout, const T* __restrict__ x,
                                   const T* __restrict__ weight, const float* __restrict__ mean,
                                   const float* __restrict__ rstd, T* __restrict__ dx,
                                   float* __restrict__ partial, long long N, int C,
                                   int need_dweight, int need_dbias) {
  using U = Unit<T, VEC>;
  constexpr int V = U::size, J = P * V;  // J: columns per lane
  constexpr bool PF = LnBwdWarp<T, VEC, P>::prefetch;
  const int lane = threadIdx.x, warp = threadIdx.y, units = C / V;
  const i64 stride = (i64)gridDim.x * blockDim.y;

  float acc_w[J], acc_b[J];
#pragma unroll
  for (int j = 0; j < J; ++j) acc_w[j] = acc_b[j] = 0.0f;
  U ws[P];  // this lane's weight units, for every row
  if (weight) load_row<P>(ws, weight, lane, units);

  i64 row = (i64)blockIdx.x * blockDim.y + warp;
  U xa[P], ga[P];
  float mu = 0.0f, rs = 0.0f;
  if (PF && row < N) {
    load_row_last<P>(xa, x + row * C, lane, units);
    load_row_last<P>(ga, dout + row * C, lane, units);
    mu = mean[row];
    rs = rstd[row];
  }
  for (; row < N; row += stride) {
    U xn[P], gn[P];
    float mun = 0.0f, rsn = 0.0f;
    if constexpr (PF) {
      // Issue the next row's loads now; they are in flight while this row is reduced and stored.
      const i64 next = row + stride;
      if (next < N) {
        load_row_last<P>(xn, x + next * C, lane, units);
        load_row_last<P>(gn, dout + next * C, lane, units);
        mun = mean[next];
        rsn = rstd[next];
      }
    } else {
      load_row_last<P>(xa, x + row * C, lane, units);
      load_row_last<P>(ga, dout + row * C, lane, units);
      mu = mean[row];
      rs = rstd[row];
    }
    // Only the units stay live between the two passes (and weight across rows), not their fp32
    // values: hiding them from the compiler makes it convert again (cheap) instead of holding twice
    // the registers.
#pragma unroll
    for (int k = 0; k < P; ++k) {
      if (weight && lane + 32 * k < units) opaque(ws[k]);
    }

    float s_gw = 0.0f, s_gwx = 0.0f;  // row sums of dout*w and dout*w*xhat
#pragma unroll
    for (int k = 0; k < P; ++k) {
      if (lane + 32 * k < units) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float xh = (xa[k].f(i) - mu) * rs, gi = ga[k].f(i);
          const float gw = weight ? gi * ws[k].f(i) : gi;
          s_gw += gw;
          s_gwx += gw * xh;
          acc_w[k * V + i] += gi * xh;
          acc_b[k * V + i] += gi;
        }
      }
    }
#pragma unroll
    for (int k = 0; k < P; ++k) {
      if (lane + 32 * k < units) {
        opaque(xa[k]);
        opaque(ga[k]);
        if (weight) opaque(ws[k]);
      }
    }
    const float m_gw = warp_sum(s_gw) / (float)C, m_gwx = warp_sum(s_gwx) / (float)C;

    T* drow = dx + row * C;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int u = lane + 32 * k;
      if (u < units) {
        U o;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float xh = (xa[k].f(i) - mu) * rs, gi = ga[k].f(i);
          const float gw = weight ? gi * ws[k].f(i) : gi;
          o.set(i, rs * (gw - m_gw - xh * m_gwx));
        }
        store_unit(drow + u * V, o);
      }
    }
    if constexpr (PF) {
#pragma unroll
      for (int k = 0; k < P; ++k) {
        xa[k] = xn[k];
        ga[k] = gn[k];
      }
      mu = mun;
      rs = rsn;
    }
  }

  if (partial == nullptr) return;  // the same for the whole block
  // Add the warps' column sums in warp order: each warp stores its sums at their columns
  // (fold[warp * C + c], 16-byte stores for packs), then thread t of the block sums columns
  // t, t + 32 * blockDim.y, ... over the warps and writes them to the block's partial row, coalesced.
  extern __shared__ float4 fold16[];  // 16-byte aligned
  float* fold = reinterpret_cast<float*>(fold16);
  float* prow = partial + (i64)blockIdx.x * 2 * C;
  const int tid = warp * 32 + lane, nthreads = 32 * blockDim.y;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 0 ? !need_dweight : !need_dbias) continue;  // the same for the whole block
    float* mine = fold + warp * C;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int u = lane + 32 * k;
      if (u < units) {
        if constexpr (V % 4 == 0) {
#pragma unroll
          for (int i = 0; i < V; i += 4) {
            const int j = k * V + i;
            float4 v;
            v.x = pass == 0 ? acc_w[j] : acc_b[j];
            v.y = pass == 0 ? acc_w[j + 1] : acc_b[j + 1];
            v.z = pass == 0 ? acc_w[j + 2] : acc_b[j + 2];
            v.w = pass == 0 ? acc_w[j + 3] : acc_b[j + 3];
            *reinterpret_cast<float4*>(mine + u * V + i) = v;
          }
        } else {
#pragma unroll
          for (int i = 0; i < V; ++i) mine[u * V + i] = pass == 0 ? acc_w[k * V + i] : acc_b[k * V + i];
        }
      }
    }
    __syncthreads();
    for (int c = tid; c < C; c += nthreads) {
      float t = 0.0f;
      for (int w = 0; w < (int)blockDim.y; ++w) t += fold[w * C + c];
      prow[pass * C + c] = t;
    }
    __syncthreads();  // fold is reused by the next pass
  }
}

// ---- BLOCK layout ------------------------------------------------------------------------------
// Forward: two-pass mean / variance from registers (FITS) or re-reads, then normalise and store.
template <typename T, bool VEC, bool FITS>
__global__ void KF_LN_BOUNDS layernorm_forward_kernel(const T* __restrict__ x, const T* __restrict__ weight,
                                         const T* __restrict__ bias, T* __restrict__ out,
                                         float* __restrict__ mean, float* __restrict__ rstd,
                                         long long N, int C, float eps) {
  using U = Unit<T, VEC>;
  constexpr int V = U::size;
  // Units a thread keeps in registers: 1 bf16/half pack, 2 fp32 packs or 8 scalars (FITS).
  constexpr int KR = FITS ? kRegElems / V : 1;
  static_assert(kRegElems % V == 0, "a thread's registers hold whole units");
  __shared__ float red[2][kMaxRowsPerBlock][32];
  const int units = C / V, tpr = blockDim.x, tx = threadIdx.x;
  const int K = FITS ? KR : (units + tpr - 1) / tpr;  // FITS: the launcher ensured units <= KR * tpr
  // The loop bound is the same for the whole block, so every thread reaches every __syncthreads;
  // row slots past N just contribute nothing.
  for (i64 base = (i64)blockIdx.x * blockDim.y; base < N; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool active = row < N;
    const T* xr = x + (active ? row : 0) * C;
    U xs[KR];

    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int u = tx + k * tpr;
      if (active && u < units) {
        U a;
        if constexpr (FITS) {
          load_unit_last(a, xr + u * V);
          xs[k] = a;
        } else {
          load_unit(a, xr + (i64)u * V);
        }
#pragma unroll
        for (int i = 0; i < V; ++i) s += a.f(i);
      }
    }
    const float mu = row_sum(s, red) / (float)C;

    // Variance around the mean (not E[x^2] - mean^2, which cancels badly when |mean| >> std).
    float q = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int u = tx + k * tpr;
      if (active && u < units) {
        U a;
        if constexpr (FITS) a = xs[k]; else load_unit(a, xr + (i64)u * V);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float d = a.f(i) - mu;
          q += d * d;
        }
      }
    }
    const float rs = rsqrtf(row_sum(q, red) / (float)C + eps);

#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int u = tx + k * tpr;
      if (active && u < units) {
        U a, w, b, o;
        if constexpr (FITS) a = xs[k]; else load_unit_last(a, xr + (i64)u * V);
        if (weight) load_unit(w, weight + (i64)u * V);
        if (bias) load_unit(b, bias + (i64)u * V);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          float y = (a.f(i) - mu) * rs;
          if (weight) y *= w.f(i);
          if (bias) y += b.f(i);
          o.set(i, y);
        }
        store_unit(out + row * C + (i64)u * V, o);
      }
    }
    if (active && tx == 0) {
      mean[row] = mu;
      rstd[row] = rs;
    }
  }
}

// Backward: dx = rstd * (dout*w - mean(dout*w) - xhat * mean(dout*w*xhat)) per row, and this
// block's sums of dout*xhat / dout per column into partial[blockIdx.x] = [dweight part | dbias part]
// (2C floats; partial is nullptr when neither is needed). FITS keeps the column sums in registers
// and folds the row slots in slot order at the end (dynamic shared memory: 2C floats); otherwise the
// launcher uses one row slot per block and each thread accumulates its own columns of the partial
// row in place.
// Either way each column is summed by one thread in row order: the result is reproducible.
template <typename T, bool VEC, bool FITS>
__global__ void KF_LN_BOUNDS layernorm_backward_kernel(const T* __restrict__ dout, const T* __restrict__ x,
                                          const T* __restrict__ weight,
                                          const float* __restrict__ mean,
                                          const float* __restrict__ rstd, T* __restrict__ dx,
                                          float* __restrict__ partial, long long N, int C,
                                          int need_dweight, int need_dbias) {
  using U = Unit<T, VEC>;
  constexpr int V = U::size;
  // Units a thread keeps in registers: 1 bf16/half pack, 2 fp32 packs or 8 scalars (FITS).
  constexpr int KR = FITS ? kRegElems / V : 1;
  static_assert(kRegElems % V == 0, "a thread's registers hold whole units");
  __shared__ float red[2][kMaxRowsPerBlock][32];
  const int units = C / V, tpr = blockDim.x, tx = threadIdx.x;
  const int K = FITS ? KR : (units + tpr - 1) / tpr;
  float* prow = partial ? partial + (i64)blockIdx.x * 2 * C : nullptr;

  float acc_w[KR * V], acc_b[KR * V];  // FITS: this thread's columns, summed over its rows
#pragma unroll
  for (int j = 0; j < KR * V; ++j) acc_w[j] = acc_b[j] = 0.0f;
  if constexpr (!FITS) {
    if (prow) {
      for (int k = 0; k < K; ++k) {
        const int u = tx + k * tpr;
        if (u < units) {
          for (int i = 0; i < V; ++i) {
            if (need_dweight) prow[u * V + i] = 0.0f;
            if (need_dbias) prow[C + u * V + i] = 0.0f;
          }
        }
      }
    }
  }

  for (i64 base = (i64)blockIdx.x * blockDim.y; base < N; base += (i64)gridDim.x * blockDim.y) {
    const i64 row = base + threadIdx.y;
    const bool active = row < N;
    const i64 off = (active ? row : 0) * C;
    const float mu = active ? mean[row] : 0.0f, rs = active ? rstd[row] : 0.0f;
    U xs[KR], gs[KR];

    float s_gw = 0.0f, s_gwx = 0.0f;  // row sums of dout*w and dout*w*xhat
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int u = tx + k * tpr;
      if (active && u < units) {
        U a, g, w;
        if constexpr (FITS) {
          load_unit_last(a, x + off + u * V);
          load_unit_last(g, dout + off + u * V);
          xs[k] = a;
          gs[k] = g;
        } else {
          load_unit(a, x + off + (i64)u * V);
          load_unit(g, dout + off + (i64)u * V);
        }
        if (weight) load_unit(w, weight + (i64)u * V);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float xh = (a.f(i) - mu) * rs, gi = g.f(i);
          const float gw = weight ? gi * w.f(i) : gi;
          s_gw += gw;
          s_gwx += gw * xh;
          if constexpr (FITS) {
            acc_w[k * V + i] += gi * xh;
            acc_b[k * V + i] += gi;
          } else if (prow) {
            if (need_dweight) prow[u * V + i] += gi * xh;
            if (need_dbias) prow[C + u * V + i] += gi;
          }
        }
      }
    }
    row_sum2(s_gw, s_gwx, red);
    const float m_gw = s_gw / (float)C, m_gwx = s_gwx / (float)C;

#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int u = tx + k * tpr;
      if (active && u < units) {
        U a, g, w, o;
        if constexpr (FITS) {
          a = xs[k];
          g = gs[k];
        } else {
          load_unit_last(a, x + off + (i64)u * V);
          load_unit_last(g, dout + off + (i64)u * V);
        }
        if (weight) load_unit(w, weight + (i64)u * V);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float xh = (a.f(i) - mu) * rs, gi = g.f(i);
          const float gw = weight ? gi * w.f(i) : gi;
          o.set(i, rs * (gw - m_gw - xh * m_gwx));
        }
        store_unit(dx + off + (i64)u * V, o);
      }
    }
  }

  if constexpr (FITS) {
    if (prow) {
      // Fold the row slots' column sums in slot order through shared memory (2C floats, dynamic),
      // then write the block's partial row with the whole block, coalesced.
      extern __shared__ float fold[];
      for (int y = 0; y < (int)blockDim.y; ++y) {
        if ((int)threadIdx.y == y) {
#pragma unroll
          for (int k = 0; k < KR; ++k) {
            const int u = tx + k * tpr;
            if (u < units) {
#pragma unroll
              for (int i = 0; i < V; ++i) {
                const int c = u * V + i;
                fold[c] = (y ? fold[c] : 0.0f) + acc_w[k * V + i];
                fold[C + c] = (y ? fold[C + c] : 0.0f) + acc_b[k * V + i];
              }
            }
          }
        }
        __syncthreads();
      }
      const int nthreads = blockDim.x * blockDim.y;
      for (int c = threadIdx.y * blockDim.x + tx; c < 2 * C; c += nthreads)
        if (c < C ? need_dweight : need_dbias) prow[c] = fold[c];
    }
  }
}

// dweight / dbias = column sums of the G per-block partial rows, always in the same order.
// Layout: blockDim (32, 32): threadIdx.x is a column of a 32-wide tile of [dweight | dbias] (2C
// columns), threadIdx.y strides over the partial rows (a few loads each, all in flight at once);
// the 32 strided sums are then added in order.
template <typename T>
__global__ void layernorm_param_grad_kernel(const float* __restrict__ partial,
                                            T* __restrict__ dweight, T* __restrict__ dbias, int G,
                                            int C) {
  __shared__ float red[32][33];
  const int j = blockIdx.x * 32 + threadIdx.x;
  T* dst = j < C ? dweight : dbias;
  const bool valid = j < 2 * C && dst != nullptr;
  float s = 0.0f;
  if (valid) {
#pragma unroll 8
    for (int b = threadIdx.y; b < G; b += blockDim.y) s += partial[(i64)b * 2 * C + j];
  }
  red[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && valid) {
    float t = 0.0f;
    for (int y = 0; y < (int)blockDim.y; ++y) t += red[y][threadIdx.x];
    dst[j < C ? j : j - C] = from_float<T>(t);
  }
}

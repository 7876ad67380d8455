// layernorm over the last dim C of N = numel / C rows: y = (x - mean) * rstd * weight + bias,
// rstd = 1 / sqrt(var + eps) (biased variance); weight and bias are optional (nullptr).
// Forward saves mean and rstd (fp32, one per row). Backward recomputes xhat = (x - mean) * rstd from
// x and the saved stats, writes dx, and leaves per-block fp32 partial sums of dweight (dout * xhat)
// and dbias (dout) in a scratch tensor (one row per block, blocks persistent: about one per SM); a
// second kernel adds those partials in a fixed order, so dweight / dbias are bitwise reproducible (no
// float atomics; a single-kernel "last block folds" scheme would need a zeroed counter per call,
// i.e. a memset node as well, or a persistent counter shared by concurrent streams).
//
// A unit is 16 bytes when VEC (C % pack == 0 and 16-byte aligned pointers), else one element.
// Four layouts; src/ops/layernorm.cpp picks one by dtype, C and N:
// - GROUP (rows of up to 1024 columns: the fp32 forward, the fp32 16-byte and every scalar
//   backward): a row over 32 NW threads (NW warps), 8 columns a thread, row sums by shuffles plus
//   one shared-memory step behind a barrier of the row's own warps; a thread's few columns leave
//   room for many warps per SM.
// - WARP (the bf16 / half forward of up to 32 * P units, P a template parameter; otherwise only
//   rows past the GROUP / RING kernels' int row index): one warp per row, lane l owning units l,
//   l + 32, ... (at most P), held in registers (16-bit data stays packed until used), so x / dout
//   are read from DRAM once and every load of a row is issued before its first use; row sums by
//   warp shuffles only (no shared memory, no __syncthreads). A warp takes several rows at once (all
//   their loads in flight together) and loops over row groups; the grid never exceeds the resident
//   warps, so there is no second wave. Backward: one block per SM, each warp keeping its weight
//   units in registers and its dweight / dbias column sums in its own slice of shared memory; at
//   the end the block's warps are added in warp order into one partial row per block.
// - RING (the bf16 / half backward with 16-byte units, up to 1024 columns): persistent groups of
//   32 NW threads, one 16-byte unit a thread, streaming their rows through a few shared-memory
//   row slots by cp.async; column sums in registers.
// - BLOCK (longer rows): blockDim.x threads (a multiple of 32) share one row, thread t owning the
//   row's units t, t + blockDim.x, ...; blockDim.y rows per block; blocks stride over groups of
//   blockDim.y rows. FITS: a thread owns at most kRegElems elements, so its part of the row stays in
//   registers and x / dout are read from DRAM once; otherwise (very long rows) the later passes
//   re-read them, mostly from L2.
#include "common.cuh"
#include "launch_params.cuh"

// Block shapes, launch bounds and per-instantiation limits (kRegElems, kMaxRowsPerBlock, the WARP /
// GROUP / RING numbers): launch_params.cuh, shared with src/ops/layernorm.cpp.
using namespace kf_layernorm;
// Largest block per path: FITS kernels hold more registers, so they are capped at 512 threads
// (<= 128 registers each); the others at 1024. The launcher respects both.
#define KF_LN_BOUNDS __launch_bounds__(FITS ? 512 : 1024)

// Units (common.cuh): Unit<T, VEC> is a 16-byte unit held as four words, or Elem1<T> (one element).
// The ring backward stores dx evict-first (store_unit_last): 0.3 us faster so (bf16, 8192 x 768),
// its stream then leaves more of L2 to the partial rows the parameter-gradient kernel reads next.

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
// Per instantiation (T, VEC, P units per lane), with R registers for one row's P units of a tensor:
// - forward: a warp takes FR consecutive rows at once (as many as keep their x units within 24
//   registers, at most 4), so FR * P units per lane are in flight before the first reduction;
//   blocks of kFwdWarps warps, launch-bounded to fwd_blocks resident blocks per SM (the launcher
//   caps the grid at that: every warp resident, no second wave; warps loop beyond).
// - backward: a warp takes BR consecutive rows at once (x and dout units within 48 registers, at
//   most 4) and keeps its weight units in registers; its dweight / dbias column sums live in its
//   own slice of shared memory (not registers), so bwd_warps warps per SM (one block per SM) fit.
// FR, BR, fwd_blocks and bwd_warps per instantiation: launch_params.cuh (ln_fwd_rows, ...).
template <typename T, bool VEC, int P>
struct LnWarpCfg {
  static_assert(ln_unit_regs(VEC) == ((int)sizeof(Unit<T, VEC>) + 3) / 4, "registers a unit");
  static constexpr int FR = ln_fwd_rows(VEC, P);
  static constexpr int BR = ln_bwd_rows(VEC, P);
  static constexpr int fwd_blocks = ln_fwd_blocks(VEC, P);
  static constexpr int bwd_warps = ln_bwd_warps(VEC, P, (int)sizeof(T));
};

// opaque() / after() (common.cuh) keep fp32 values converted from packed units from living across
// the reductions: converted again after them instead (half the registers).
template <int P, typename U> KF_DEVICE void opaque_row(U (&r)[P], int lane, int units, u32 zero) {
#pragma unroll
  for (int k = 0; k < P; ++k)
    if (lane + 32 * k < units) opaque(r[k], zero);
}

// Warp sums of n independent values, their shuffles interleaved.
template <int n> KF_DEVICE void warp_sum_n(float (&v)[n]) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int j = 0; j < n; ++j) v[j] += __shfl_xor_sync(0xffffffffu, v[j], o);
}

// Loads this lane's units of one row (units lane, lane + 32, ... below `units`; p points at the
// row's unit `lane`, so the units are at constant offsets from it): load_row keeps them cached
// (weight, bias), load_row_last reads data used once (evict-first).
template <int P, typename U, typename T>
KF_DEVICE void load_row(U (&r)[P], const T* __restrict__ p, int lane, int units) {
#pragma unroll
  for (int k = 0; k < P; ++k)
    if (lane + 32 * k < units) load_unit(r[k], p + 32 * k * U::size);
}
template <int P, typename U, typename T>
KF_DEVICE void load_row_last(U (&r)[P], const T* __restrict__ p, int lane, int units) {
#pragma unroll
  for (int k = 0; k < P; ++k)
    if (lane + 32 * k < units) load_unit_last(r[k], p + 32 * k * U::size);
}

// Forward: warp g of the grid takes rows [FR q, FR q + FR) for q = g, g + G, ... (G warps in the
// grid). All of their x units are loaded first (a row past N loads the last row again and is not
// stored), then the FR rows' statistics by interleaved warp shuffles (no shared memory; one
// butterfly when every lane holds P units, else the means and then the variances around them);
// weight / bias units are read (L1) one at a time while the output is written and serve all FR
// rows.
template <typename T, bool VEC, int P>
__global__ void __launch_bounds__(32 * kFwdWarps, LnWarpCfg<T, VEC, P>::fwd_blocks)
    layernorm_forward_warp_kernel(const T* __restrict__ x, const T* __restrict__ weight,
                                  const T* __restrict__ bias, T* __restrict__ out,
                                  float* __restrict__ mean, float* __restrict__ rstd, long long N,
                                  int C, float eps, int zero) {
  kf_wait_prior_grids();
  using U = Unit<T, VEC>;
  constexpr int V = U::size, FR = LnWarpCfg<T, VEC, P>::FR;
  const int lane = threadIdx.x, units = C / V;
  const i64 chunks = (N + FR - 1) / FR;
  for (i64 q = (i64)blockIdx.x * blockDim.y + threadIdx.y; q < chunks;
       q += (i64)gridDim.x * blockDim.y) {
    const i64 row0 = q * FR;
    U xs[FR][P];
#pragma unroll
    for (int j = 0; j < FR; ++j) {
      const i64 row = row0 + j < N ? row0 + j : N - 1;
      load_row_last<P>(xs[j], x + row * C + lane * V, lane, units);
    }

    float mu[FR], rs[FR];
    if (units == 32 * P) {  // the same for the whole grid
      // Every lane holds P units: its own mean and M2 (squared deviations from that mean), then
      // the lanes' merged pairwise (Chan et al.) in one butterfly, halves of equal counts: one
      // reduction's latency rather than a mean's and then a variance's. Both lanes of a pair
      // compute the same bits (the merge is symmetric in them).
      float m2[FR];
#pragma unroll
      for (int j = 0; j < FR; ++j) {
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < P; ++k)
#pragma unroll
          for (int i = 0; i < V; ++i) s += xs[j][k].f(i);
        mu[j] = s * (1.0f / (float)(P * V));
        // From P = 4 units a lane (32+ elements in 16-bit) ptxas would keep the fp32 values for the
        // second pass and spill: they are converted again instead. Below that, keeping them
        // measured 0.2 us faster (bf16, 768 columns: 7.4 vs 7.6 us).
        if constexpr (P >= 4) opaque_row<P>(xs[j], lane, units, after(s, zero));
        float q = 0.0f;
#pragma unroll
        for (int k = 0; k < P; ++k)
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const float d = xs[j][k].f(i) - mu[j];
            q = fmaf(d, d, q);
          }
        m2[j] = q;
      }
      // Two halves of n elements each: mean = (mean_a + mean_b) / 2, M2 = M2_a + M2_b + d^2 n / 2.
      float half_n = 0.5f * (float)(P * V);
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
#pragma unroll
        for (int j = 0; j < FR; ++j) {
          const float mb = __shfl_xor_sync(0xffffffffu, mu[j], o);
          const float qb = __shfl_xor_sync(0xffffffffu, m2[j], o);
          const float d = mb - mu[j];
          mu[j] = 0.5f * (mu[j] + mb);
          m2[j] = fmaf(half_n * d, d, m2[j] + qb);
        }
        half_n *= 2.0f;
      }
      const u32 z2 = after(m2[FR - 1], zero);
#pragma unroll
      for (int j = 0; j < FR; ++j) {
        rs[j] = rsqrtf(m2[j] / (float)C + eps);
        opaque_row<P>(xs[j], lane, units, z2);
      }
    } else {  // lanes hold different counts: the mean, then the variance around it
#pragma unroll
      for (int j = 0; j < FR; ++j) {
        mu[j] = 0.0f;
#pragma unroll
        for (int k = 0; k < P; ++k) {
          if (lane + 32 * k < units) {
#pragma unroll
            for (int i = 0; i < V; ++i) mu[j] += xs[j][k].f(i);
          }
        }
      }
      warp_sum_n(mu);
      const u32 z1 = after(mu[FR - 1], zero);
#pragma unroll
      for (int j = 0; j < FR; ++j) {
        mu[j] = mu[j] / (float)C;
        opaque_row<P>(xs[j], lane, units, z1);
      }

      // Variance around the mean (not E[x^2] - mean^2, which cancels badly when |mean| >> std).
#pragma unroll
      for (int j = 0; j < FR; ++j) {
        rs[j] = 0.0f;
#pragma unroll
        for (int k = 0; k < P; ++k) {
          if (lane + 32 * k < units) {
#pragma unroll
            for (int i = 0; i < V; ++i) {
              const float d = xs[j][k].f(i) - mu[j];
              rs[j] += d * d;
            }
          }
        }
      }
      warp_sum_n(rs);
      const u32 z2 = after(rs[FR - 1], zero);
#pragma unroll
      for (int j = 0; j < FR; ++j) {
        rs[j] = rsqrtf(rs[j] / (float)C + eps);
        opaque_row<P>(xs[j], lane, units, z2);
      }
    }

#pragma unroll
    for (int k = 0; k < P; ++k) {
      if (lane + 32 * k < units) {
        U w = U::fill(1.0f), b = U::fill(0.0f);
        if (weight) load_unit(w, (weight + lane * V) + 32 * k * V);
        if (bias) load_unit(b, (bias + lane * V) + 32 * k * V);
#pragma unroll
        for (int j = 0; j < FR; ++j) {
          if (row0 + j < N) {
            float y[V];
#pragma unroll
            for (int i = 0; i < V; ++i) y[i] = fmaf((xs[j][k].f(i) - mu[j]) * rs[j], w.f(i), b.f(i));
            store_unit((out + (row0 + j) * C + lane * V) + 32 * k * V, U::from(y));
          }
        }
      }
    }
    // Lane j writes row0 + j's statistics: FR consecutive floats, one store each.
#pragma unroll
    for (int j = 0; j < FR; ++j) {
      if (lane == j && row0 + j < N) {
        mean[row0 + j] = mu[j];
        rstd[row0 + j] = rs[j];
      }
    }
  }
}

// Where the backward keeps a lane's column sums: per warp two arrays (dweight, then dbias) of
// 32 P V floats; this lane's element i of unit k at float4 (k V/4 + i/4) * 32 + lane (16-byte
// units: consecutive lanes hit consecutive float4s, no bank conflicts) or float k * 32 + lane.
template <int V>
KF_DEVICE int acc_index(int k, int i, int lane) {
  if constexpr (V >= 4) {
    return ((k * (V / 4) + (i >> 2)) * 32 + lane) * 4 + (i & 3);
  } else {
    return k * 32 + lane;
  }
}
// Adds t[0..V) to this lane's sums of unit k in `a` (one float4 read-modify-write per 4 floats).
template <int V>
KF_DEVICE void acc_add(float* a, int k, int lane, const float (&t)[V]) {
  if constexpr (V >= 4) {
#pragma unroll
    for (int h = 0; h < V / 4; ++h) {
      float4* p = reinterpret_cast<float4*>(a + acc_index<V>(k, 4 * h, lane));
      float4 s = *p;
      s.x += t[4 * h];
      s.y += t[4 * h + 1];
      s.z += t[4 * h + 2];
      s.w += t[4 * h + 3];
      *p = s;
    }
  } else {
    a[acc_index<V>(k, 0, lane)] += t[0];
  }
}

// Backward, persistent: one block of blockDim (32, W) per SM (at most; W <= bwd_warps, sized by the
// launcher to the rows and the shared memory), warp g of the grid taking rows [BR q, BR q + BR)
// for q = g, g + G, ... (G warps in the grid): x and dout units of all BR rows loaded first (a row
// past N loads the last row again and is skipped), the 2 BR row sums reduced together by warp
// shuffles, then dx written and the rows' dout * xhat and dout added to the warp's column sums in
// shared memory (dynamic: W * 2 * 32 P V floats), in row order. At the end the block's warps are
// added in warp order into partial[blockIdx.x] = [dweight | dbias] (2C floats; partial is nullptr
// when neither is needed). Every column's sum has a fixed order: the result is reproducible.
template <typename T, bool VEC, int P>
__global__ void __launch_bounds__(32 * LnWarpCfg<T, VEC, P>::bwd_warps, 1)
    layernorm_backward_warp_kernel(const T* __restrict__ dout, const T* __restrict__ x,
                                   const T* __restrict__ weight, const float* __restrict__ mean,
                                   const float* __restrict__ rstd, T* __restrict__ dx,
                                   float* __restrict__ partial, long long N, int C,
                                   int need_dweight, int need_dbias, int zero) {
  kf_wait_prior_grids();
  using U = Unit<T, VEC>;
  constexpr int V = U::size, BR = LnWarpCfg<T, VEC, P>::BR;
  constexpr int SPAN = 32 * P * V;  // floats of one warp's dweight (or dbias) sums
  const int lane = threadIdx.x, warp = threadIdx.y, units = C / V;
  extern __shared__ float4 smem16[];  // 16-byte aligned
  float* const acc_w = reinterpret_cast<float*>(smem16) + warp * 2 * SPAN;
  float* const acc_b = acc_w + SPAN;
  const bool acc = partial != nullptr;  // the same for the whole block
  if (acc) {
    for (int e = lane; e < 2 * SPAN; e += 32) acc_w[e] = 0.0f;  // this warp's own slice
    __syncwarp();
  }

  U ws[P];  // this lane's weight units (ones without weight), for every row
#pragma unroll
  for (int k = 0; k < P; ++k) ws[k] = U::fill(1.0f);
  if (weight) load_row<P>(ws, weight + lane * V, lane, units);

  const i64 chunks = (N + BR - 1) / BR;
  for (i64 q = (i64)blockIdx.x * blockDim.y + warp; q < chunks; q += (i64)gridDim.x * blockDim.y) {
    const i64 row0 = q * BR;
    U xs[BR][P], gs[BR][P];
    float mu[BR], rs[BR];
#pragma unroll
    for (int j = 0; j < BR; ++j) {
      const i64 row = row0 + j < N ? row0 + j : N - 1;
      load_row_last<P>(xs[j], x + row * C + lane * V, lane, units);
      load_row_last<P>(gs[j], dout + row * C + lane * V, lane, units);
      mu[j] = mean[row];
      rs[j] = rstd[row];
    }
    opaque_row<P>(ws, lane, units, zero);  // converted per row, not kept as fp32

    // Per row, with d = x - mean and gw = dout * w: sum of gw and sum of gw * d.
    float sums[2 * BR];
#pragma unroll
    for (int j = 0; j < BR; ++j) {
      sums[2 * j] = sums[2 * j + 1] = 0.0f;
#pragma unroll
      for (int k = 0; k < P; ++k) {
        if (lane + 32 * k < units) {
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const float gw = gs[j][k].f(i) * ws[k].f(i);
            sums[2 * j] += gw;
            sums[2 * j + 1] += gw * (xs[j][k].f(i) - mu[j]);
          }
        }
      }
    }
    warp_sum_n(sums);
    {
      const u32 z = after(sums[2 * BR - 1], zero);
#pragma unroll
      for (int j = 0; j < BR; ++j) {
        opaque_row<P>(xs[j], lane, units, z);
        opaque_row<P>(gs[j], lane, units, z);
      }
      opaque_row<P>(ws, lane, units, z);
    }

    // dx = rs * (gw - mean(gw) - xhat * mean(gw * xhat)) with xhat = d * rs
    //    = rs * gw + c1 + d * c2, c1 = -rs * mean(gw), c2 = -rs^2 * mean(gw * xhat).
#pragma unroll
    for (int j = 0; j < BR; ++j) {
      if (row0 + j < N) {
        const float c1 = -rs[j] * (sums[2 * j] / (float)C);
        const float c2 = -rs[j] * rs[j] * (rs[j] * (sums[2 * j + 1] / (float)C));
        T* drow = dx + (row0 + j) * C + lane * V;
#pragma unroll
        for (int k = 0; k < P; ++k) {
          if (lane + 32 * k < units) {
            float o[V], tw[V], tb[V];
#pragma unroll
            for (int i = 0; i < V; ++i) {
              const float d = xs[j][k].f(i) - mu[j], gi = gs[j][k].f(i);
              o[i] = fmaf(d, c2, fmaf(rs[j], gi * ws[k].f(i), c1));
              tw[i] = gi * (d * rs[j]);
              tb[i] = gi;
            }
            store_unit(drow + 32 * k * V, U::from(o));
            if (acc) {
              if (need_dweight) acc_add<V>(acc_w, k, lane, tw);
              if (need_dbias) acc_add<V>(acc_b, k, lane, tb);
            }
          }
        }
      }
    }
  }

  if (!acc) return;
  // Add the warps' sums in warp order: thread t of the block takes entries t, t + 32 W, ... of
  // [dweight | dbias] and writes them to the block's partial row, coalesced.
  __syncthreads();
  const float* all = reinterpret_cast<const float*>(smem16);
  float* prow = partial + (i64)blockIdx.x * 2 * C;
  const int nthreads = 32 * blockDim.y;
  for (int t = warp * 32 + lane; t < 2 * C; t += nthreads) {
    const int which = t >= C, c = t - which * C;
    if (which ? !need_dbias : !need_dweight) continue;
    const int u = c / V;
    const int idx = which * SPAN + acc_index<V>(u >> 5, c - u * V, u & 31);
    float s = 0.0f;
    for (int w = 0; w < (int)blockDim.y; ++w) s += all[w * 2 * SPAN + idx];
    prow[t] = s;
  }
}

// ---- GROUP layout ------------------------------------------------------------------------------
// A row is shared by a group of blockDim.x = 32 NW threads (NW warps; the launcher takes the fewest
// that cover the row), thread t of the group owning the row's units t, t + 32 NW, ... (at most P,
// where P V = kGroupCols columns: two fp32 units or eight scalars). So a thread holds few columns
// whatever C is (a row's values in few registers, 2 kGroupCols column sums in the backward) and many
// warps fit per SM. A group takes one row at a time and loops over rows; blockDim.y groups per block.
// Row sums: warp shuffles, then (NW > 1) the warps' sums through shared memory behind a barrier of
// the group's own threads (bar.sync 1 + group, 32 NW: the other groups of the block run on), added in
// warp order, so every thread of the group gets the same bits. The scratch is double-buffered: one
// barrier per reduction (a warp can only overwrite a buffer after every warp of its group has passed
// the next barrier, i.e. finished reading it).
constexpr int kMaxBlockWarps = 32;  // 1024 threads
// Launch bounds (launch_params.cuh: kGroupCols columns a thread). Backward: one block per SM
// (persistent; the block folds its groups' column sums into one partial row) of at most
// ln_group_bwd_warps warps: 24 (80 registers) for fp32 16-byte units, 20 (96) for scalars
// (registers are split over the SM's 4 quarters, so n warps per quarter get at most 16384 / (32 n)
// each), the most that compile without spills (ptxas, sm_80 / sm_90). Forward: blocks of at most
// kGroupFwdWarps warps, kGroupFwdBlocks of them resident per SM (56 registers; the launcher caps the
// grid there, groups loop beyond).

// Warp sums of v[0..n) (n a power of two <= 32) by halving butterflies: at offset 16 a lane keeps
// one half of its values (the lower half if its bit 4 is clear), adds the partner's copy of that half
// and sends the other half; then offset 8 with the remaining half, ... After log2 n steps a lane holds
// one value, a plain butterfly over the remaining offsets finishes it. Returns the warp sum of
// v[lane / (32 / n)]: n - 1 + 5 - log2 n shuffles instead of 5 n.
template <int n>
KF_DEVICE float warp_sum_spread(float (&v)[n], int lane) {
  static_assert(n >= 1 && n <= 32 && (n & (n - 1)) == 0, "n: a power of two <= 32");
#pragma unroll
  for (int m = n, o = 16; m > 1; m >>= 1, o >>= 1) {
    const bool upper = (lane & o) != 0;
#pragma unroll
    for (int i = 0; i < m / 2; ++i) {
      const float send = upper ? v[i] : v[i + m / 2];
      const float keep = upper ? v[i + m / 2] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
  }
  float s = v[0];
#pragma unroll
  for (int o = 16 / n; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// v[i] += r[i], i < n (n = 1 or 2: the mean / variance, or the backward's two row sums; 8-byte
// shared memory reads for two).
template <int n>
KF_DEVICE void warp_sums_add(float (&v)[n], const float* r) {
  static_assert(n == 1 || n == 2, "one or two sums");
  if constexpr (n == 2) {
    const float2 t = *reinterpret_cast<const float2*>(r);
    v[0] += t.x;
    v[1] += t.y;
  } else {
    v[0] += r[0];
  }
}
// Sums of v[0..n) over the nw warps of this thread's group (its warps are first .. first + nw - 1
// of the block, its barrier is 1 + group), every thread of the group getting the same bits:
// warp_sum_spread, the warp's n sums to red (lane (32 / n) i writes sum i), a barrier of the group (a
// warp sync when nw == 1), then each thread adds the warps' sums in warp order. red: this
// reduction's buffer, kMaxBlockWarps * n floats, 8-byte aligned.
template <int n>
KF_DEVICE void group_sum_n(float (&v)[n], float* red, int first, int nw, int group) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float s = warp_sum_spread(v, lane);
  if ((lane & (32 / n - 1)) == 0) red[(first + warp) * n + lane / (32 / n)] = s;
  if (nw == 1) {  // the same for the whole group
    __syncwarp();
  } else {
    named_barrier(group + 1, 32 * nw);
  }
  const float* r = red + first * n;
#pragma unroll
  for (int i = 0; i < n; ++i) v[i] = 0.0f;
#pragma unroll 1
  for (int w = 0; w < nw; ++w, r += n) warp_sums_add(v, r);
}

// Loads this thread's units of one row (units t, t + tpr, ... below `units`; p points at unit t).
template <int P, typename U, typename T>
KF_DEVICE void load_strided_last(U (&r)[P], const T* __restrict__ p, int t, int tpr, int units) {
#pragma unroll
  for (int k = 0; k < P; ++k)
    if (t + k * tpr < units) load_unit_last(r[k], p + k * tpr * U::size);
}

// An fp32 unit's V results stored as the 16-bit Y, each rounded once: one 8-byte store for a 16-byte
// unit (4 elements), else one element.
template <typename Y, int V>
KF_DEVICE void store_narrow_unit(Y* p, const float (&y)[V]) {
  static_assert(sizeof(Y) == 2 && (V == 4 || V == 1), "a 16-bit y of an fp32 unit of 4 or 1 elements");
  if constexpr (V == 4) {
    *reinterpret_cast<uint2*>(p) = make_uint2(Word<Y>::pack2(y[0], y[1]), Word<Y>::pack2(y[2], y[3]));
  } else {
    *p = from_float<Y>(y[0]);
  }
}

// Forward: group g = y * gridDim.x + blockIdx.x of the grid takes rows g, g + G, ... (G groups in
// the grid), software-pipelined: the next row's x units are loaded before the current row's are
// used, so every group keeps a row in flight while it works. A row's x is converted to fp32 once and
// kept (8 floats a thread), then the mean (one group reduction), the variance around it (a second
// one) and the output. Weight and bias stay in registers as fp32 for all rows.
// Y: out's type. A 16-bit Y of fp32 T (autocast's fp32 residual stream, whose norm only a cast to
// the matmuls' type reads) stores y rounded once from the fp32 result: the cast's value.
// X: x's type. A 16-bit X of fp32 T (16-byte units only) is autocast's branch added to the fp32
// stream before the norm: s = float(x) + residual (eager's upcast and add) is stored in s_out and
// normalised. Those rows are not pipelined (the next row's x and residual would not fit the
// registers); the other groups of the SM cover their loads.
template <typename T, bool VEC, typename Y = T, typename X = T>
__global__ void __launch_bounds__(32 * kGroupFwdWarps, kGroupFwdBlocks)
    layernorm_forward_group_kernel(const X* __restrict__ x, const T* __restrict__ weight,
                                   const T* __restrict__ bias, Y* __restrict__ out,
                                   float* __restrict__ mean, float* __restrict__ rstd, long long N,
                                   int C, float eps, const T* __restrict__ residual, T* __restrict__ s_out) {
  kf_wait_prior_grids();
  constexpr bool RES = sizeof(X) != sizeof(T);
  static_assert(!RES || (VEC && sizeof(T) == 4 && sizeof(X) == 2), "a 16-bit x: fp32 16-byte rows only");
  using U = Unit<T, VEC>;
  constexpr int V = U::size, P = kGroupCols / V;
  static_assert(kGroupCols % V == 0, "whole units per thread");
  __shared__ float red[2][kMaxBlockWarps];  // mean, variance
  const int tx = threadIdx.x, ty = threadIdx.y, tpr = blockDim.x, nw = tpr >> 5, first = ty * nw;
  const int units = C / V;
  const float inv_c = 1.0f / (float)C;

  float wf[kGroupCols], bf[kGroupCols];
#pragma unroll
  for (int k = 0; k < P; ++k) {
    U w = U::fill(1.0f), b = U::fill(0.0f);
    if (tx + k * tpr < units) {
      if (weight) load_unit(w, weight + (tx + k * tpr) * V);
      if (bias) load_unit(b, bias + (tx + k * tpr) * V);
    }
#pragma unroll
    for (int i = 0; i < V; ++i) {
      wf[k * V + i] = w.f(i);
      bf[k * V + i] = b.f(i);
    }
  }

  const int n = (int)N, stride = gridDim.x * blockDim.y;
  auto load_x = [&](U (&xs)[P], int row) {
    if constexpr (!RES) load_strided_last<P>(xs, x + (i64)row * C + tx * V, tx, tpr, units);
  };
  auto process = [&](const U (&xs)[P], int row) {
    float xf[kGroupCols], mu[1] = {0.0f};
#pragma unroll
    for (int k = 0; k < P; ++k)
#pragma unroll
      for (int i = 0; i < V; ++i) xf[k * V + i] = xs[k].f(i);
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (tx + k * tpr < units) {
#pragma unroll
        for (int i = 0; i < V; ++i) mu[0] += xf[k * V + i];
      }
    group_sum_n(mu, red[0], first, nw, ty);

    // Variance around the mean (not E[x^2] - mean^2, which cancels badly when |mean| >> std).
    float rs[1] = {0.0f};
    mu[0] *= inv_c;
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (tx + k * tpr < units) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          xf[k * V + i] -= mu[0];
          rs[0] = fmaf(xf[k * V + i], xf[k * V + i], rs[0]);
        }
      }
    group_sum_n(rs, red[1], first, nw, ty);

    rs[0] = rsqrtf(fmaf(rs[0], inv_c, eps));
    Y* orow = out + (i64)row * C + tx * V;
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (tx + k * tpr < units) {
        float y[V];
#pragma unroll
        for (int i = 0; i < V; ++i) y[i] = fmaf(xf[k * V + i] * rs[0], wf[k * V + i], bf[k * V + i]);
        if constexpr (sizeof(Y) == sizeof(T))
          store_unit(orow + k * tpr * V, U::from(y));
        else
          store_narrow_unit<Y, V>(orow + k * tpr * V, y);
      }
    if (tx == 0) {
      mean[row] = mu[0];
      rstd[row] = rs[0];
    }
  };

  int row = ty * gridDim.x + blockIdx.x;  // groups numbered across blocks first
  if constexpr (RES) {
    for (; row < n; row += stride) {
      const i64 base = (i64)row * C + tx * V;
      U res[P];  // the residual, then s in place
      uint2 xw[P];
      load_strided_last<P>(res, residual + base, tx, tpr, units);
#pragma unroll
      for (int k = 0; k < P; ++k)
        if (tx + k * tpr < units) xw[k] = __ldcs(reinterpret_cast<const uint2*>(x + base + k * tpr * V));
#pragma unroll
      for (int k = 0; k < P; ++k)
        if (tx + k * tpr < units) {
          float sv[V];
          static_assert(V == 4, "an fp32 16-byte unit");
          sv[0] = Word<X>::get(xw[k].x, 0) + res[k].f(0);
          sv[1] = Word<X>::get(xw[k].x, 1) + res[k].f(1);
          sv[2] = Word<X>::get(xw[k].y, 0) + res[k].f(2);
          sv[3] = Word<X>::get(xw[k].y, 1) + res[k].f(3);
          res[k] = U::from(sv);
          store_unit(s_out + base + k * tpr * V, res[k]);
        }
      process(res, row);
    }
    return;
  }
  // The next row's loads are issued as soon as the current row's units are copied out (two buffers
  // used in turn need more registers than the copy's moves cost).
  U next[P];
  if (row < n) load_x(next, row);
  for (; row < n; row += stride) {
    U cur[P];
#pragma unroll
    for (int k = 0; k < P; ++k) cur[k] = next[k];
    if (row + stride < n) load_x(next, row + stride);  // in flight during this row
    process(cur, row);
  }
}

// Backward, persistent: one block of blockDim (32 NW, G) per SM (at most); group g = y * gridDim.x +
// blockIdx.x of the grid (numbered across blocks first, so the groups that get one row more are
// spread over the SMs) takes rows g, g + G', ... (G' groups in the grid). Per row, with d = x - mean,
// xhat = d * rstd and gw = dout * w: the row sums of gw and gw * xhat, and this thread's column sums
// of dout * xhat (dweight) and dout (dbias); the 2 row sums in one group reduction; then dx from d
// and gw, kept as fp32 across the reduction (the packed units are dead by then).
// Column sums: in the thread's own slots of the block's dynamic shared memory (not registers: 16
// floats a thread would cost a quarter of the register budget; a 16-byte read-modify-write per 4
// columns and row instead), per group 2 kGroupCols floats per thread: float4 s (s = 0, 1: dweight
// columns 4s..4s+3 of the thread; 2, 3: dbias) of thread t at float4 s * blockDim.x + t
// (consecutive threads, consecutive float4s: no bank conflicts). At the end the block's groups are
// added in group order into partial[blockIdx.x] = [dweight | dbias] (2C floats; partial is nullptr
// when neither is needed). Every column's sum has a fixed order: the result is reproducible.
// 16-byte units are fp32 only (bf16 / half rows with 16-byte units take the RING layout).
// RES (fp32 T; autocast's residual stream): dres, the stream's gradient from its other consumers, is
// added to dx before the store (its units loaded after the row's reduction, so no registers are held
// through it), as the separate add did. NZ (fp32 T: 1 bf16, 2 half): dx (with dres) is also stored
// rounded once to that type in dz, the value of autocast's cast of it for the next 16-bit matmul.
template <typename T, bool VEC, bool RES = false, int NZ = 0>
__global__ void __launch_bounds__(32 * ln_group_bwd_warps(VEC), 1)
    layernorm_backward_group_kernel(const T* __restrict__ dout, const T* __restrict__ x,
                                    const T* __restrict__ weight, const float* __restrict__ mean,
                                    const float* __restrict__ rstd, T* __restrict__ dx,
                                    float* __restrict__ partial, long long N, int C,
                                    int need_dweight, int need_dbias, const T* __restrict__ dres,
                                    void* __restrict__ dz) {
  kf_wait_prior_grids();
  static_assert((!RES && NZ == 0) || sizeof(T) == 4, "dres and the 16-bit copy: fp32 rows only");
  using Z = typename CopyOf<NZ>::type;
  using U = Unit<T, VEC>;
  constexpr int V = U::size, P = kGroupCols / V;
  static_assert(kGroupCols == 8 && kGroupCols % V == 0, "whole units, two float4 per thread");
  static_assert(!VEC || sizeof(T) == 4, "16-byte units: fp32 (the launch bound is sized for it)");
  __shared__ __align__(16) float red[2][2 * kMaxBlockWarps];  // double-buffered row sums
  extern __shared__ float4 acc16[];  // blockDim.y groups of 4 blockDim.x float4
  const int tx = threadIdx.x, ty = threadIdx.y, tpr = blockDim.x, nw = tpr >> 5, first = ty * nw;
  const int units = C / V;
  const float inv_c = 1.0f / (float)C;
  const bool acc = partial != nullptr;  // the same for the whole block
  float4* const mine = acc16 + ty * 4 * tpr + tx;  // this thread's float4 s at mine[s * tpr]

  float wf[kGroupCols];  // this thread's weights (ones without weight), for every row
#pragma unroll
  for (int k = 0; k < P; ++k) {
    U w = U::fill(1.0f);
    if (weight && tx + k * tpr < units) load_unit(w, weight + (tx + k * tpr) * V);
#pragma unroll
    for (int i = 0; i < V; ++i) wf[k * V + i] = w.f(i);
  }
  if (acc) {
#pragma unroll
    for (int s = 0; s < 4; ++s) mine[s * tpr] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }

  const int n = (int)N, stride = gridDim.x * blockDim.y;
  auto load = [&](U (&xs)[P], U (&gs)[P], float& mu, float& rs, int row) {
    load_strided_last<P>(xs, x + (i64)row * C + tx * V, tx, tpr, units);
    load_strided_last<P>(gs, dout + (i64)row * C + tx * V, tx, tpr, units);
    mu = mean[row];
    rs = rstd[row];
  };
  auto process = [&](const U (&xs)[P], const U (&gs)[P], float mu, float rs, int row, int buf) {
    float d[kGroupCols], gw[kGroupCols], sums[2] = {0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < P; ++k) {
      if (tx + k * tpr < units) {
        float gv[V], xh[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const int e = k * V + i;
          gv[i] = gs[k].f(i);
          d[e] = xs[k].f(i) - mu;
          gw[e] = gv[i] * wf[e];
          xh[i] = d[e] * rs;
          sums[0] += gw[e];
          sums[1] = fmaf(gw[e], xh[i], sums[1]);
        }
        if (acc) {  // dweight += dout * xhat, dbias += dout
          if constexpr (V >= 4) {
#pragma unroll
            for (int h = 0; h < V / 4; ++h) {
              const int s = (k * V) / 4 + h;
              float4 a = mine[s * tpr], b = mine[(2 + s) * tpr];
              a.x = fmaf(gv[4 * h], xh[4 * h], a.x);
              a.y = fmaf(gv[4 * h + 1], xh[4 * h + 1], a.y);
              a.z = fmaf(gv[4 * h + 2], xh[4 * h + 2], a.z);
              a.w = fmaf(gv[4 * h + 3], xh[4 * h + 3], a.w);
              b.x += gv[4 * h], b.y += gv[4 * h + 1], b.z += gv[4 * h + 2], b.w += gv[4 * h + 3];
              mine[s * tpr] = a;
              mine[(2 + s) * tpr] = b;
            }
          } else {
            float* const a = reinterpret_cast<float*>(mine + (k / 4) * tpr) + k % 4;
            float* const b = reinterpret_cast<float*>(mine + (2 + k / 4) * tpr) + k % 4;
            *a = fmaf(gv[0], xh[0], *a);
            *b += gv[0];
          }
        }
      }
    }
    group_sum_n(sums, red[buf], first, nw, ty);

    // dx = rs * (gw - mean(gw) - xhat * mean(gw * xhat)) = rs * gw + c1 + d * c2 with
    // c1 = -rs * mean(gw), c2 = -rs^2 * mean(gw * xhat).
    const float c1 = -rs * (sums[0] * inv_c);
    const float c2 = -rs * rs * (sums[1] * inv_c);
    T* drow = dx + (i64)row * C + tx * V;
    U rc[P];
    if constexpr (RES) load_strided_last<P>(rc, dres + (i64)row * C + tx * V, tx, tpr, units);
#pragma unroll
    for (int k = 0; k < P; ++k) {
      if (tx + k * tpr < units) {
        float o[V];
#pragma unroll
        for (int i = 0; i < V; ++i) o[i] = fmaf(d[k * V + i], c2, fmaf(rs, gw[k * V + i], c1));
        if constexpr (RES) {
#pragma unroll
          for (int i = 0; i < V; ++i) o[i] = o[i] + rc[k].f(i);
        }
        store_unit(drow + k * tpr * V, U::from(o));
        if constexpr (NZ != 0)
          store_narrow_unit<Z, V>(static_cast<Z*>(dz) + (i64)row * C + (tx + k * tpr) * V, o);
      }
    }
  };

  int row = ty * gridDim.x + blockIdx.x, buf = 0;
  U xs[P], gs[P];
  float mu, rs;
  for (; row < n; row += stride, buf ^= 1) {
    load(xs, gs, mu, rs, row);
    process(xs, gs, mu, rs, row, buf);
  }

  if (!acc) return;
  __syncthreads();
  // Entry t of [dweight | dbias]: column c of unit u = tx' + k tpr, element i, i.e. the owner's
  // column e = k V + i; added over the groups in group order.
  const float* const all = reinterpret_cast<const float*>(acc16);
  float* const prow = partial + (i64)blockIdx.x * 2 * C;
  const int nthreads = tpr * blockDim.y;
  for (int t = ty * tpr + tx; t < 2 * C; t += nthreads) {
    const int which = t >= C, c = t - which * C;
    if (which ? !need_dbias : !need_dweight) continue;
    const int u = c / V, k = u / tpr, e = k * V + (c - u * V);
    const int idx = ((2 * which + (e >> 2)) * tpr + (u - k * tpr)) * 4 + (e & 3);
    float s = all[idx];
    for (int g = 1; g < (int)blockDim.y; ++g) s += all[g * 16 * tpr + idx];
    prow[t] = s;
  }
}

// ---- BLOCK layout ------------------------------------------------------------------------------
// Units of V elements a thread keeps in registers: 1 bf16/half pack, 2 fp32 packs or 8 scalars (FITS).
template <int V, bool FITS>
KF_DEVICE constexpr int block_reg_units() {
  static_assert(kRegElems % V == 0, "a thread's registers hold whole units");
  return FITS ? kRegElems / V : 1;
}

// Forward: two-pass mean / variance from registers (FITS) or re-reads, then normalise and store.
template <typename T, bool VEC, bool FITS>
__global__ void KF_LN_BOUNDS layernorm_forward_kernel(const T* __restrict__ x, const T* __restrict__ weight,
                                         const T* __restrict__ bias, T* __restrict__ out,
                                         float* __restrict__ mean, float* __restrict__ rstd,
                                         long long N, int C, float eps) {
  kf_wait_prior_grids();
  using U = Unit<T, VEC>;
  constexpr int V = U::size, KR = block_reg_units<V, FITS>();
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
        U a, w, b;
        float y[V];
        if constexpr (FITS) a = xs[k]; else load_unit_last(a, xr + (i64)u * V);
        if (weight) load_unit(w, weight + (i64)u * V);
        if (bias) load_unit(b, bias + (i64)u * V);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          y[i] = (a.f(i) - mu) * rs;
          if (weight) y[i] *= w.f(i);
          if (bias) y[i] += b.f(i);
        }
        store_unit(out + row * C + (i64)u * V, U::from(y));
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
  kf_wait_prior_grids();
  using U = Unit<T, VEC>;
  constexpr int V = U::size, KR = block_reg_units<V, FITS>();
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
        U a, g, w;
        float o[V];
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
          o[i] = rs * (gw - m_gw - xh * m_gwx);
        }
        store_unit(dx + off + (i64)u * V, U::from(o));
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

// dweight / dbias = column sums of the G per-block partial rows, in a fixed order (any C; the
// launcher takes it for odd C, layernorm_param_grad_vec_kernel below otherwise): blockDim (32, 32),
// threadIdx.x a column of a 32-wide tile of [dweight | dbias], threadIdx.y taking partial rows y,
// y + 32, ... (8 per round, loaded before they are added); then warp w adds the 32 strided sums of
// tile column w by a fixed shuffle tree. Fixed order throughout: reproducible.
template <typename T>
__global__ void __launch_bounds__(1024)
    layernorm_param_grad_kernel(const float* __restrict__ partial, T* __restrict__ dweight,
                                T* __restrict__ dbias, int G, int C) {
  kf_wait_prior_grids();
  constexpr int kLoads = 8;
  __shared__ float red[32][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int j = blockIdx.x * 32 + tx;
  const bool valid = j < 2 * C && (j < C ? dweight != nullptr : dbias != nullptr);
  float s = 0.0f;
  if (valid) {
    const float* p = partial + j;
    const i64 step = 2 * (i64)C;
    for (int b0 = ty; b0 < G; b0 += 32 * kLoads) {
      float v[kLoads];
#pragma unroll
      for (int k = 0; k < kLoads; ++k) v[k] = b0 + 32 * k < G ? p[(b0 + 32 * k) * step] : 0.0f;
#pragma unroll
      for (int k = 0; k < kLoads; ++k) s += v[k];
    }
  }
  red[ty][tx] = s;
  __syncthreads();
  const float t = warp_sum(red[tx][ty]);
  const int jj = blockIdx.x * 32 + ty;
  if (tx == 0 && jj < 2 * C) {
    T* dst = jj < C ? dweight : dbias;
    if (dst) dst[jj < C ? jj : jj - C] = from_float<T>(t);
  }
}

// ---- RING layout (backward) --------------------------------------------------------------------
// bf16 / half rows with 16-byte units, up to 1024 columns. Persistent groups whose rows are all
// requested as early as the shared memory allows. A row is shared by a group of blockDim.x = tpr =
// 32 NW threads (the fewest warps covering the row's C / 8 units), thread t owning unit t (8
// columns), blockDim.y = G groups per block, one block per SM. Group o = y * gridDim.x + blockIdx.x
// of the grid (numbered across blocks first) takes the contiguous rows [r0, r0 + n), n = q or q + 1
// (the launcher divides: N = q TG + rem over TG groups; no division here). Its x and dout rows go
// through a ring of kRingSlots row slots in dynamic shared memory by 16-byte cp.async.cg: every slot
// is requested before anything else, and slot i % S is refilled with row i + S as soon as row i's
// values have been read from it (before the row's reduction). Each thread copies exactly the chunks
// it later reads itself, so its own cp.async.wait_group is all the synchronisation the ring needs
// (one commit group per row, empty past the end: the count stays uniform). mean / rstd: lane j of
// every warp loads rows r0 + 32 b + j, one batch of 32 ahead, and row i's pair is shuffled from
// lane i % 32.
// Per row, with xhat = (x - mean) rstd and gw = dout w: the row sums of gw and gw xhat (one
// halving shuffle tree on the two values; for NW > 1 the warps' sums meet in shared memory behind
// one __syncthreads a row, double-buffered, added in warp order), then dx = rstd gw + c1 + xhat c2
// from xhat and gw kept in registers as fp32 across the reduction. dweight / dbias: fp32 column
// sums in registers (fixed columns a thread, row order), folded at the end in group order through
// the ring's shared memory into partial[blockIdx.x] = [dweight | dbias] (2C floats; partial is
// nullptr when neither is needed). Every sum has a fixed order: the result is reproducible. Needs
// N < 2^31.
// Row slots a group (S), the launch bound and the row-sum scratch: launch_params.cuh (kRingSlots,
// kRingThreads, kLnRingRed).

template <typename T>
__global__ void __launch_bounds__(kRingThreads, 1)
    layernorm_backward_ring_kernel(const T* __restrict__ dout, const T* __restrict__ x,
                                   const T* __restrict__ weight, const float* __restrict__ mean,
                                   const float* __restrict__ rstd, T* __restrict__ dx,
                                   float* __restrict__ partial, int q, int rem, int C,
                                   int need_dweight, int need_dbias) {
  kf_wait_prior_grids();
  using U = Pack128<T, Held::words>;
  constexpr int V = U::size, S = kRingSlots;
  static_assert(V == 8, "bf16 / half: 8 columns a thread, two float4 of each column sum");
  // Ring: per group S slots of [x units | dout units] (C / V 16-byte chunks each), unit u of a
  // tensor at chunk u; consecutive threads, consecutive chunks (no bank conflicts). Reused at the
  // end for the column-sum fold.
  extern __shared__ float4 ring16[];
  // Per warp of the block: (sum gw, sum gw xhat), double-buffered; group y's warp w at y ns + w,
  // ns = max(NW, 4) (entries past NW stay zero: groups of up to 4 warps add 4 entries unrolled).
  __shared__ __align__(16) float2 red[2][kLnRingRed];
  const int tx = threadIdx.x, ty = threadIdx.y, tpr = blockDim.x;
  const int lane = tx & 31, warp = tx >> 5, nw = tpr >> 5;
  const int units = C / V;
  const int o = ty * gridDim.x + blockIdx.x;
  const int r0 = o * q + min(o, rem), n = q + (o < rem ? 1 : 0);
  const int iters = q + (rem > 0 ? 1 : 0);  // the same for the whole block (barriers)
  const bool has = tx < units;
  float4* const mine = ring16 + (i64)ty * S * 2 * units + tx;  // slot s: below
  const u32 smine = smem_u32(mine);
  // Byte offsets from mine: slot s at s * slot_bytes, its dout unit dout_bytes further.
  const u32 slot_bytes = 2u * units * 16u, dout_bytes = units * 16u;
  const T* xn = x + (i64)r0 * C + tx * V;  // row i + S of the range (the next refill)
  const T* gn = dout + (i64)r0 * C + tx * V;

  // This thread's unit of row i2 into the slot at byte offset so (nothing past the range's end).
  auto refill = [&](u32 so, int i2, const T* xr, const T* gr, float after) {
    if (i2 < n && has) {
      const u32 a = smine + so;
      cp_async16_after(a, xr, after);
      cp_async16_after(a + dout_bytes, gr, after);
    }
  };
#pragma unroll
  for (int s = 0; s < S; ++s) {
    refill(s * slot_bytes, s, xn, gn, 0.0f);
    cp_async_commit();
    xn += C;
    gn += C;
  }

  float wf[V];  // this thread's weights (ones without weight), for every row, as fp32
  {
    U w = U::fill(1.0f);
    if (weight && has) load_unit(w, weight + tx * V);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      wf[j] = w.f(j);
      asm volatile("" : "+f"(wf[j]));  // kept as fp32, not re-converted every row
    }
  }
  const int ns = nw > 4 ? nw : 4;
  if (nw > 1) {  // the same for the whole block
    for (int e = ty * tpr + tx; e < 2 * kLnRingRed; e += tpr * blockDim.y)
      (&red[0][0])[e] = make_float2(0.0f, 0.0f);
    __syncthreads();
  }
  // Batches of 32 rows' (mean, rstd): lane j holds row 32 b + j; the next batch in flight.
  float mc = 0.0f, rc = 0.0f, mn = 0.0f, rn = 0.0f;
  if (lane < n) mc = mean[r0 + lane], rc = rstd[r0 + lane];
  if (32 + lane < n) mn = mean[r0 + 32 + lane], rn = rstd[r0 + 32 + lane];

  float accw[V], accb[V];  // column sums of dout xhat and dout, this thread's columns
#pragma unroll
  for (int j = 0; j < V; ++j) accw[j] = accb[j] = 0.0f;
  const float inv_c = 1.0f / (float)C;
  // Row-sum scratch: this warp's (lanes 0 / 16) entry, and the group's first warp, buffer 0.
  float* const red_mine = reinterpret_cast<float*>(red[0] + ty * ns + warp) + (lane >> 4);
  const float2* const red_group = red[0] + ty * ns;

  T* drow = dx + (i64)r0 * C + tx * V;
  u32 so = 0;  // byte offset of row i's slot
  for (int i = 0; i < iters; ++i) {
    if (i > 0 && (i & 31) == 0) {
      mc = mn, rc = rn, mn = rn = 0.0f;
      if (i + 32 + lane < n) mn = mean[r0 + i + 32 + lane], rn = rstd[r0 + i + 32 + lane];
    }
    const float mu = __shfl_sync(0xffffffffu, mc, i & 31);
    const float rs = __shfl_sync(0xffffffffu, rc, i & 31);
    const bool live = i < n && has;
    cp_async_wait<S - 1>();  // row i's group has landed (this thread's chunks)
    const float4* const cur =
        reinterpret_cast<const float4*>(reinterpret_cast<const char*>(mine) + so);

    float xh[V], gw[V];
    float s1 = 0.0f, s2 = 0.0f;
    if (live) {
      U a, g;
      set_words(a, *reinterpret_cast<const int4*>(cur));
      set_words(g, *reinterpret_cast<const int4*>(cur + units));
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float h = (a.f(j) - mu) * rs, gv = g.f(j), t = gv * wf[j];
        s1 += t;
        s2 = fmaf(t, h, s2);
        accw[j] = fmaf(gv, h, accw[j]);
        accb[j] += gv;
        xh[j] = h;
        gw[j] = t;
      }
      refill(so, i + S, xn, gn, s2);  // the slot has been read: row i + S into it
    }
    cp_async_commit();

    // Row sums over the group: lanes 0..15 end with sum gw, 16..31 with sum gw xhat.
    {
      float v[2] = {s1, s2};
      const float r = warp_sum_spread<2>(v, lane);
      if (nw == 1) {  // the same for the whole block
        s1 = __shfl_sync(0xffffffffu, r, 0);
        s2 = __shfl_sync(0xffffffffu, r, 16);
      } else {
        const int b = (i & 1) * kLnRingRed;  // double-buffered: one barrier a row
        if ((lane & 15) == 0) red_mine[2 * b] = r;
        __syncthreads();
        const float2* const rr = red_group + b;
        if (nw <= 4) {  // the same for the whole block; 16-byte reads (ns = 4: aligned)
          const float4 t0 = *reinterpret_cast<const float4*>(rr);
          const float4 t1 = *reinterpret_cast<const float4*>(rr + 2);
          s1 = ((t0.x + t0.z) + t1.x) + t1.z;
          s2 = ((t0.y + t0.w) + t1.y) + t1.w;
        } else {
          s1 = s2 = 0.0f;
#pragma unroll 1
          for (int w = 0; w < nw; ++w) {
            const float2 t = rr[w];
            s1 += t.x;
            s2 += t.y;
          }
        }
      }
    }

    // dx = rs (gw - mean(gw) - xhat mean(gw xhat)) = rs gw + c1 + xhat c2.
    if (live) {
      const float c1 = -rs * (s1 * inv_c), c2 = -rs * (s2 * inv_c);
      float y[V];
#pragma unroll
      for (int j = 0; j < V; ++j) y[j] = fmaf(xh[j], c2, fmaf(rs, gw[j], c1));
      store_unit_last(drow, U::from(y));
    }
    xn += C;
    gn += C;
    drow += C;
    so = so + slot_bytes == S * slot_bytes ? 0u : so + slot_bytes;
  }

  if (!partial) return;  // the same for the whole block
  cp_async_wait_all();
  __syncthreads();  // every group is done with its slots
  // Fold: group y's float4 f of thread t at ring16[(4 y + f) tpr + t]; f = 0, 1: dweight columns
  // 4f..4f+3 of the thread, 2, 3: dbias.
  float4* const fold = ring16 + (i64)ty * 4 * tpr + tx;
#pragma unroll
  for (int f = 0; f < 2; ++f) {
    fold[f * tpr] = make_float4(accw[4 * f], accw[4 * f + 1], accw[4 * f + 2], accw[4 * f + 3]);
    fold[(2 + f) * tpr] = make_float4(accb[4 * f], accb[4 * f + 1], accb[4 * f + 2], accb[4 * f + 3]);
  }
  __syncthreads();
  // Four columns (one float4 of the fold) at a time: the last block's epilogue is on the call's
  // critical path.
  float4* const prow = reinterpret_cast<float4*>(partial + (i64)blockIdx.x * 2 * C);
  const int nthreads = tpr * blockDim.y, gstride = 4 * tpr;
  for (int t = ty * tpr + tx; t < C / 2; t += nthreads) {
    const int which = 4 * t >= C, c = 4 * t - which * C;
    if (which ? !need_dbias : !need_dweight) continue;
    const int idx = (2 * which + ((c >> 2) & 1)) * tpr + c / V;  // the owner thread's float4
    float4 sum = ring16[idx];
#pragma unroll 4
    for (int g = 1; g < (int)blockDim.y; ++g) {
      const float4 b = ring16[g * gstride + idx];
      sum.x += b.x, sum.y += b.y, sum.z += b.z, sum.w += b.w;
    }
    prow[t] = sum;
  }
}

// dweight / dbias = column sums of the G partial rows (2C floats each, 2C % 4 == 0: 16-byte rows),
// in a fixed order. blockDim (kPgX, kPgY): threadIdx.x a float4 column of the block's 4 kPgX-float
// tile of [dweight | dbias], threadIdx.y the partial rows y, y + kPgY, ... (kPgLoads 16-byte loads
// issued before they are added; a warp reads 8 rows of 64 contiguous bytes); then the kPgY
// per-thread sums of each column in order, four at a time, and those in order.
constexpr int kPgLoads = 4;  // kPgX, kPgY: launch_params.cuh
template <typename T>
__global__ void __launch_bounds__(kPgX * kPgY)
    layernorm_param_grad_vec_kernel(const float* __restrict__ partial, T* __restrict__ dweight,
                                    T* __restrict__ dbias, int G, int C) {
  kf_wait_prior_grids();
  constexpr int W = 4 * kPgX, Q = kPgY / 4;  // tile columns; partial sums of 4 rows per column
  static_assert(W * Q == kPgX * kPgY, "one stage-2 thread per (column, quarter)");
  __shared__ float red[kPgY][W + 1];
  const int tx = threadIdx.x, ty = threadIdx.y, n4 = C / 2;  // float4s per partial row
  const int j4 = blockIdx.x * kPgX + tx;
  float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const bool need = j4 < n4 && ((4 * j4 < C && dweight) || (4 * j4 + 3 >= C && dbias));
  if (need) {
    const float4* const p = reinterpret_cast<const float4*>(partial) + j4;
    for (int b0 = ty; b0 < G; b0 += kPgY * kPgLoads) {
      float4 v[kPgLoads];
#pragma unroll
      for (int k = 0; k < kPgLoads; ++k) {
        const int b = b0 + k * kPgY;
        v[k] = b < G ? __ldcs(p + (i64)b * n4) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int k = 0; k < kPgLoads; ++k) {
        s.x += v[k].x;
        s.y += v[k].y;
        s.z += v[k].z;
        s.w += v[k].w;
      }
    }
  }
  red[ty][4 * tx] = s.x;
  red[ty][4 * tx + 1] = s.y;
  red[ty][4 * tx + 2] = s.z;
  red[ty][4 * tx + 3] = s.w;
  __syncthreads();
  const int tid = ty * kPgX + tx, c = tid % W, part = tid / W;
  float t = 0.0f;
#pragma unroll
  for (int y = 0; y < 4; ++y) t += red[4 * part + y][c];
  __syncthreads();
  red[part][c] = t;
  __syncthreads();
  if (tid < W) {
    float u = 0.0f;
#pragma unroll
    for (int y = 0; y < Q; ++y) u += red[y][tid];
    const int j = blockIdx.x * W + tid;
    if (j < 2 * C) {
      T* const dst = j < C ? dweight : dbias;
      if (dst) dst[j < C ? j : j - C] = from_float<T>(u);
    }
  }
}

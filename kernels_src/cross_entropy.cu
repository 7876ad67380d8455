// cross_entropy: loss_i = logsumexp(x_i) - x_i[t_i] over logits x (N, V), integer targets t (N,).
//
// Forward reads each row once: every thread keeps an online (max, sum of exp) over its elements,
// the block merges them, and the row's logsumexp (fp32, N) is saved for backward next to the
// per-row loss. mean / sum are reduced by one extra single-block kernel over the N fp32 row losses
// in a fixed order (deterministic); it also counts the non-ignored targets (n_valid) on the device,
// so the mean's 1/n_valid never needs the host.
// Backward recomputes softmax from the saved logsumexp in one read of x and one write of dx, as a
// streaming elementwise kernel over (row, chunk) work items (see below):
//   dx_ij = (exp(x_ij - lse_i) - [j == t_i]) * dloss_i,   dloss_i = g_i | g | g / n_valid
// Rows whose target is ignore_index get loss 0 and an exactly-zero gradient row. A target that is
// neither ignore_index nor in [0, V) is never used as an index: its row loss is NaN (so mean/sum are
// NaN) and its gradient row is NaN.
//
// Rows may be strided: row i of the logits and of dx starts at element i * ld (ld >= V; ld = V when
// contiguous, more for the padded lm_head's logits[:, :V] view of an (N, ld) buffer). dx's padding
// columns [V, ld) are written as exact zeros: that linear's backward multiplies the whole padded
// gradient by a weight whose padding rows are zero, and finite zeros there keep that GEMM exact.
//
// Liger / llm.c fuse the gradient into the forward pass: `Fused` below re-reads the row hoping for L2,
// and cross_entropy_fused_smem_kernel keeps rows of 16 .. 112 KB in shared memory (one read and one
// write of the logits' bytes). dloss is not known when Thunder's forward runs: the executor's fused
// path (opt-in, KFORGE_CE_FUSED=1) writes the gradient for dloss = 1 there, and the backward scales
// it in place by the real dloss (cross_entropy_rescale_kernel), which costs only a launch when dloss
// is 1, as loss.backward() makes it; otherwise the same read + write pass as the backward kernel.
#include "common.cuh"
#include "launch_params.cuh"

#define CE_NAN __int_as_float(0x7fffffff)

// Rows start anywhere when V * sizeof(T) is not a multiple of 16: split_row (common.cuh) gives a
// row's scalar head up to the first 16-byte boundary, its whole packs, then its scalar tail.
template <bool Stream, typename T>
KF_DEVICE Pack128<T> load_pack(const T* p) {
  if constexpr (Stream) return load128cs(p);
  else return load128(p);
}

// Calls f(pack, pack_index) for this thread's packs of a row, four loads in flight per step.
template <bool Stream, typename T, typename F>
KF_DEVICE void for_each_pack(const T* __restrict__ packs, long long npacks, F&& f) {
  constexpr int P = Pack128<T>::size;
  const long long bs = blockDim.x;
  long long p = threadIdx.x;
  for (; p + 3 * bs < npacks; p += 4 * bs) {
    Pack128<T> a[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) a[u] = load_pack<Stream>(packs + (p + u * bs) * P);
#pragma unroll
    for (int u = 0; u < 4; ++u) f(a[u], p + u * bs);
  }
  for (; p < npacks; p += bs) f(load_pack<Stream>(packs + p * P), p);
}

// Online softmax state of one thread: m = max seen, s = sum of exp(x - m).
// The exponent is taken relative to 0 while m is still -inf (only -inf seen: adds exp(-inf) = 0,
// where m itself would give -inf - -inf = NaN); NaN logits still propagate into s.
KF_DEVICE void online_rescale(float new_max, float& m, float& s) {
  if (new_max > m) {
    s *= __expf(m - new_max);  // m = -inf: s is 0 and stays 0
    m = new_max;
  }
}

// (m, s) updated by one pack of a row, and by one element.
template <typename Pack>
KF_DEVICE void pack_max_sumexp(const Pack& a, float& m, float& s) {
  float pm = a.f(0);
#pragma unroll
  for (int k = 1; k < Pack::size; ++k) pm = fmaxf(pm, a.f(k));
  online_rescale(pm, m, s);
  const float ms = m == -KF_INF ? 0.0f : m;
#pragma unroll
  for (int k = 0; k < Pack::size; ++k) s += __expf(a.f(k) - ms);
}
KF_DEVICE void scalar_max_sumexp(float v, float& m, float& s) {
  online_rescale(v, m, s);
  s += __expf(v - (m == -KF_INF ? 0.0f : m));
}

// One thread's (max, sum-exp) over its share of row x.
template <bool Stream, typename T>
KF_DEVICE void thread_max_sumexp(const T* __restrict__ x, long long V, float& m, float& s) {
  const RowSplit<long long> r = split_row(x, V);
  for_each_pack<Stream>(x + r.head, r.npk, [&](const Pack128<T>& a, long long) { pack_max_sumexp(a, m, s); });
  // Head and tail hold fewer than 2 * P elements: at most one each for the first threads.
  const long long nscalar = r.head + r.tail;
  for (long long j = threadIdx.x; j < nscalar; j += blockDim.x)
    scalar_max_sumexp(to_float(x[j < r.head ? j : (V - r.tail) + (j - r.head)]), m, s);
}

// Writes one gradient row dx = (exp(x - L) - onehot(t)) * scale, or zeros when `zero`.
// `vec`: x and dx share their address modulo 16, so one split serves both; else all scalar.
template <bool Stream, typename T>
KF_DEVICE void write_row_grad(const T* __restrict__ x, T* __restrict__ dx, long long V, long long t,
                              float L, float scale, bool zero, int vec) {
  constexpr int P = Pack128<T>::size;
  RowSplit<long long> r = vec ? split_row(x, V) : RowSplit<long long>{V, 0, 0};
  if (zero) {
    Pack128<T> z;
#pragma unroll
    for (int k = 0; k < P; ++k) z.set(k, 0.0f);
    for (long long p = threadIdx.x; p < r.npk; p += blockDim.x) store128(dx + r.head + p * P, z);
  } else {
    for_each_pack<Stream>(x + r.head, r.npk, [&](const Pack128<T>& a, long long p) {
      const long long d = t - (r.head + p * P);  // position of the target in this pack, if there
      const int dk = (d >= 0 && d < P) ? (int)d : -1;
      Pack128<T> o;
#pragma unroll
      for (int k = 0; k < P; ++k) o.set(k, (__expf(a.f(k) - L) - (k == dk ? 1.0f : 0.0f)) * scale);
      store128(dx + r.head + p * P, o);
    });
  }
  const long long nscalar = r.head + r.tail;
  for (long long j = threadIdx.x; j < nscalar; j += blockDim.x) {
    const long long c = j < r.head ? j : (V - r.tail) + (j - r.head);
    dx[c] = from_float<T>(zero ? 0.0f : (__expf(to_float(x[c]) - L) - (c == t ? 1.0f : 0.0f)) * scale);
  }
}

// dloss of one row: g (per row for reduction "none", grad_stride 1; else a scalar, stride 0; 1 when
// grad is null: the unit gradient), divided by the device-side count of non-ignored targets for
// "mean" (n_valid != nullptr).
template <typename T>
KF_DEVICE float row_dloss(const T* __restrict__ grad, long long grad_stride,
                          const float* __restrict__ n_valid, long long row) {
  float g = grad ? to_float(grad[row * grad_stride]) : 1.0f;
  return n_valid ? g / *n_valid : g;
}

// Exact zeros into a dx row's padding columns [V, ld), over `threads` threads of the block.
template <typename T>
KF_DEVICE void zero_row_padding(T* __restrict__ dx, long long V, long long ld, int threads) {
#pragma unroll 1
  for (long long j = V + threadIdx.x; j < ld; j += threads) dx[j] = from_float<T>(0.0f);
}

// A row's end of the forward, from each thread's (max, sum-exp): the block's logsumexp (an all -inf
// row gives S = 0 and lse = -inf, not NaN), its target, and, by thread 0, lse and the row's loss (fp32
// into row_loss, reduced later, or T into loss_none). `x`: the row's logits (global or shared memory).
struct CeRow {
  float lse;
  long long t;
  bool ignored, bad;
};
template <typename T>
KF_DEVICE CeRow ce_row_finish(float m, float s, float* scratch, const T* x, const i64* __restrict__ targets,
                              long long row, long long V, long long ignore_index, float* __restrict__ lse_out,
                              float* __restrict__ row_loss, T* __restrict__ loss_none) {
  const float M = block_max(m, scratch);
  const float Ms = M == -KF_INF ? 0.0f : M;
  const float S = block_sum(s * __expf(m - Ms), scratch);
  CeRow r;
  r.lse = Ms + logf(S);
  r.t = targets[row];
  r.ignored = r.t == ignore_index;
  r.bad = !r.ignored && (r.t < 0 || r.t >= V);
  if (threadIdx.x == 0) {
    const float loss = r.ignored ? 0.0f : r.bad ? CE_NAN : r.lse - to_float(x[r.t]);
    lse_out[row] = r.lse;
    if (row_loss) row_loss[row] = loss;
    else loss_none[row] = from_float<T>(loss);
  }
  return r;
}

// Forward, one block per row (rows ld elements apart). Writes lse[row] and the row loss: fp32 into
// row_loss (reduced later) or T into loss_none. Fused: also writes the gradient row for dloss (grad,
// grad_stride, n_valid), re-reading the row while it is still in L2 (first pass without the
// evict-first hint), and zeros into its padding [V, ld).
template <typename T, bool Fused>
__global__ void cross_entropy_forward_kernel(const T* __restrict__ logits, const i64* __restrict__ targets,
                                             float* __restrict__ lse_out, float* __restrict__ row_loss,
                                             T* __restrict__ loss_none, T* __restrict__ dlogits,
                                             const T* __restrict__ grad, long long grad_stride,
                                             const float* __restrict__ n_valid, long long V, long long ld,
                                             long long ignore_index, int vec) {
  kf_wait_prior_grids();
  __shared__ float scratch[32];
  const long long row = blockIdx.x;
  const T* x = logits + row * ld;

  float m = -KF_INF, s = 0.0f;
  thread_max_sumexp<!Fused>(x, V, m, s);
  const CeRow rr = ce_row_finish(m, s, scratch, x, targets, row, V, ignore_index, lse_out, row_loss, loss_none);
  const long long t = rr.t;
  const bool ignored = rr.ignored, bad = rr.bad;
  const float lse = rr.lse;
  if constexpr (Fused) {
    const float scale = ignored ? 0.0f : row_dloss(grad, grad_stride, n_valid, row);
    T* dx = dlogits + row * ld;
    write_row_grad<true>(x, dx, V, t, bad ? CE_NAN : lse, scale, ignored, vec);
    zero_row_padding(dx, V, ld, blockDim.x);
  }
}

// Fused forward + backward with the row held in shared memory, one block per row: the logits are read
// from DRAM once (16-byte cp.async into the block's dynamic shared memory), max / sum-exp and the
// gradient row come from there, and the gradient is written once. The register kernel above re-reads
// each row hoping for L2, which misses once more rows are in flight than L2 holds (GPT-2's 100 KB
// rows: its fused launch took as long as forward + backward apart). Rows start anywhere: element j
// sits at byte mis + j * sizeof(T) of the shared row (mis: the row's offset from a 16-byte boundary),
// so the row's 16-byte packs land 16-byte aligned there too; its scalar head and tail (split_row) are
// copied element-wise. logits and dlogits share their address modulo 16 (the launcher's condition,
// with rows of kSmemMinRowBytes .. kSmemMaxRowBytes; other rows take the register kernel). Same
// arithmetic as that kernel: one rounding of each gradient element.
template <typename T>
__global__ void __launch_bounds__(kf_cross_entropy::kSmemThreads)
    cross_entropy_fused_smem_kernel(const T* __restrict__ logits, const i64* __restrict__ targets,
                                    float* __restrict__ lse_out, float* __restrict__ row_loss,
                                    T* __restrict__ loss_none, T* __restrict__ dlogits,
                                    const T* __restrict__ grad, long long grad_stride,
                                    const float* __restrict__ n_valid, long long V, long long ld,
                                    long long ignore_index) {
  kf_wait_prior_grids();
  extern __shared__ __align__(16) unsigned char ce_smem[];
  __shared__ float scratch[32];
  constexpr int P = Pack128<T>::size;
  const long long row = blockIdx.x;
  const T* x = logits + row * ld;
  const RowSplit<long long> r = split_row(x, V);
  const int mis = (int)(reinterpret_cast<u64>(x) & 15);
  T* srow = reinterpret_cast<T*>(ce_smem + mis);  // element j of the row
  const u32 spk = smem_u32(srow + r.head);         // its first pack: 16-byte aligned
  const int npk = (int)r.npk, nscalar = (int)(r.head + r.tail);
  // this thread's scalar element (head, then tail), if any
  const long long sc = (long long)threadIdx.x < r.head ? (long long)threadIdx.x : (V - r.tail) + (threadIdx.x - r.head);
  const bool has_sc = (int)threadIdx.x < nscalar;
  for (int p = threadIdx.x; p < npk; p += blockDim.x)
    cp_async16(spk + (u32)p * 16u, x + r.head + (long long)p * P);
  cp_async_commit();
  if (has_sc) srow[sc] = x[sc];
  cp_async_wait_all();
  __syncthreads();  // every thread's copies (and the scalars' stores) seen by all

  float m = -KF_INF, s = 0.0f;
  for (int p = threadIdx.x; p < npk; p += blockDim.x) pack_max_sumexp(lds16<T>(spk + (u32)p * 16u), m, s);
  if (has_sc) scalar_max_sumexp(to_float(srow[sc]), m, s);
  const CeRow rr = ce_row_finish(m, s, scratch, srow, targets, row, V, ignore_index, lse_out, row_loss, loss_none);
  const long long t = rr.t;
  const bool ignored = rr.ignored, bad = rr.bad;
  const float lse = rr.lse;
  // Ignored rows: exact zeros (a NaN logit there does not leak); out-of-range targets: NaN rows.
  const float scale = ignored ? 0.0f : row_dloss(grad, grad_stride, n_valid, row);
  const float L = bad ? CE_NAN : lse;
  T* dx = dlogits + row * ld;
  for (int p = threadIdx.x; p < npk; p += blockDim.x) {
    const auto a = lds16<T>(spk + (u32)p * 16u);
    const long long d = t - (r.head + (long long)p * P);  // the target's position in this pack, if there
    const int dk = (d >= 0 && d < P) ? (int)d : -1;
    Pack128<T> o;
#pragma unroll
    for (int k = 0; k < P; ++k)
      o.set(k, ignored ? 0.0f : (__expf(a.f(k) - L) - (k == dk ? 1.0f : 0.0f)) * scale);
    store128(dx + r.head + (long long)p * P, o);
  }
  if (has_sc)
    dx[sc] = from_float<T>(ignored ? 0.0f : (__expf(to_float(srow[sc]) - L) - (sc == t ? 1.0f : 0.0f)) * scale);
  zero_row_padding(dx, V, ld, blockDim.x);
}

// ---- the unit gradient, scaled in the backward --------------------------------------------------
// The executor's fused path (kforge/ops/cross_entropy.py) writes the gradient for dloss = 1 in the
// forward (the kernels above with grad = null) and scales it here, in place, by the loss gradient g
// that the backward receives. A row whose g is 1 is left as it is, and every block reads g before
// anything else: for loss.backward() (g = 1, a scalar) the launch returns at once instead of making
// the read + write pass of the separate backward kernel. Other g (gradient accumulation's 1 / steps,
// a loss scale) cost that pass, one more rounding of each element than the separate kernel's.
// Zeros stay exact zeros (ignored rows; 0 * inf would be NaN where the separate kernel writes 0); NaN
// rows stay NaN. The padding columns [V, ld) are not touched (zeros already). Rows ld elements apart,
// grid-stride over rows; 16-byte packs in a row's aligned middle, its head and tail element-wise.
template <typename T>
__global__ void cross_entropy_rescale_kernel(T* __restrict__ dlogits, const T* __restrict__ grad,
                                             long long grad_stride, long long N, long long V, long long ld) {
  kf_wait_prior_grids();
  constexpr int P = Pack128<T>::size;
  for (long long row = blockIdx.x; row < N; row += gridDim.x) {
    const float g = to_float(grad[row * grad_stride]);
    if (g == 1.0f) {
      if (grad_stride == 0) return;  // one g for every row
      continue;
    }
    T* dx = dlogits + row * ld;
    const RowSplit<long long> r = split_row(dx, V);
    for (long long p = threadIdx.x; p < r.npk; p += blockDim.x) {
      Pack128<T> a = load128(dx + r.head + p * P);
#pragma unroll
      for (int k = 0; k < P; ++k) {
        const float v = a.f(k);
        a.set(k, v == 0.0f ? 0.0f : v * g);
      }
      store128(dx + r.head + p * P, a);
    }
    const long long nscalar = r.head + r.tail;
    for (long long j = threadIdx.x; j < nscalar; j += blockDim.x) {
      const long long c = j < r.head ? j : (V - r.tail) + (j - r.head);
      const float v = to_float(dx[c]);
      dx[c] = from_float<T>(v == 0.0f ? 0.0f : v * g);
    }
  }
}

// ---- backward: a streaming elementwise kernel ------------------------------------------------------
// Work items are (row, chunk) pairs, w = row * chunks_per_row + chunk. A chunk is `chunk_packs`
// (<= kBwdThreads * U) consecutive 16-byte packs of the row's aligned middle; thread tid moves
// packs tid, tid + 256, ... (U of them at most) and issues all of its loads before the first use.
// Chunk 0 also does the row's scalar head and tail (< 2 packs' worth, one element per thread).
// Math: dx = exp2(x * log2e - lse * log2e) * s, minus s at the target.
//
// One block per work item, several waves of short-lived blocks, like a plain elementwise kernel.
// Each thread issues its U pack loads first, then the row's inputs (target, lse, dloss): none of
// them waits for another, so a block's life is one memory latency plus its arithmetic. Ignored rows
// read their logits too (rare; this keeps the loads independent of the target) and write exact
// zeros (selected, so a NaN logit there does not leak).
// Block size and packs per thread: kBwdThreads, kBwdUnrollVec / kBwdUnrollScalar (launch_params.cuh).
using namespace kf_cross_entropy;
#define CE_LOG2E 1.4426950408889634f

KF_DEVICE float ce_ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// This thread's packs p = u * kBwdThreads + tid < np of the chunk starting at xc. Vec: 16-byte
// loads; else P elements one by one (no alignment needed).
template <bool Vec, int U, typename T>
KF_DEVICE void ce_load_chunk(const T* __restrict__ xc, int np, Pack128<T> (&a)[U]) {
  constexpr int P = Pack128<T>::size;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int p = u * kBwdThreads + (int)threadIdx.x;
    if (p < np) {
      if constexpr (Vec) {
        a[u] = load128(xc + p * P);
      } else {
#pragma unroll
        for (int k = 0; k < P; ++k) a[u][k] = xc[p * P + k];
      }
    }
  }
}

template <bool Vec, typename T>
KF_DEVICE void ce_store_pack(T* __restrict__ d, const Pack128<T>& o) {
  if constexpr (Vec) {
    store128(d, o);
  } else {
#pragma unroll
    for (int k = 0; k < Pack128<T>::size; ++k) d[k] = o[k];
  }
}

// The chunk's gradient from its packs a: (2^(x log2e - l2) - [element == tl]) * s, or exact zeros
// for an ignored row. tl: the target's position counted from the chunk's first element, or -1.
template <bool Vec, int U, typename T>
KF_DEVICE void ce_store_chunk(T* __restrict__ dc, int np, const Pack128<T> (&a)[U], int tl, float l2,
                              float s, bool zero) {
  constexpr int P = Pack128<T>::size;
  if (zero) {
    Pack128<T> z;
#pragma unroll
    for (int k = 0; k < P; ++k) z.set(k, 0.0f);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int p = u * kBwdThreads + (int)threadIdx.x;
      if (p < np) ce_store_pack<Vec>(dc + p * P, z);
    }
    return;
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int p = u * kBwdThreads + (int)threadIdx.x;
    if (p < np) {
      float e[P];
      unpack128(a[u], e);
#pragma unroll
      for (int k = 0; k < P; ++k) e[k] = ce_ex2(fmaf(e[k], CE_LOG2E, -l2)) * s;
      const int dk = tl - p * P;  // in [0, P) only in the one pack of the row holding the target
      if ((unsigned)dk < (unsigned)P) {
#pragma unroll
        for (int k = 0; k < P; ++k)
          if (k == dk) e[k] -= s;
      }
      ce_store_pack<Vec>(dc + p * P, pack128<T>(e));
    }
  }
}

// Where a work item's packs are: np packs from element `first` of the row.
struct CeChunk {
  long long first;
  int np;
};
template <typename T>
KF_DEVICE CeChunk ce_chunk(const RowSplit<long long>& rs, long long chunk, int chunk_packs) {
  const long long left = rs.npk - chunk * chunk_packs;  // packs from the chunk's start on
  return {rs.head + chunk * chunk_packs * Pack128<T>::size,
          (int)(left < chunk_packs ? (left > 0 ? left : 0) : chunk_packs)};
}

// The row's scalar head and tail (fewer than 2 * P elements, one per thread), owned by chunk 0:
// element index c and whether this thread has one.
struct CeScalar {
  long long c;
  bool on;
};
KF_DEVICE CeScalar ce_scalar(const RowSplit<long long>& rs, long long V, long long chunk) {
  const long long tid = threadIdx.x;
  const long long nscalar = chunk == 0 ? rs.head + rs.tail : 0;
  return {tid < rs.head ? tid : (V - rs.tail) + (tid - rs.head), tid < nscalar};
}

// dloss of a row (s) and its exponent offset (l2 = lse * log2e, NaN for an out-of-range target).
struct CeRowScale {
  float l2, s;
  bool zero;
};
KF_DEVICE CeRowScale ce_row_scale(long long t, float L, float g, float nv, bool mean, long long V,
                                  long long ignore_index) {
  const bool zero = t == ignore_index;
  const bool bad = !zero && (t < 0 || t >= V);
  return {bad ? CE_NAN : L * CE_LOG2E, zero ? 0.0f : (mean ? g / nv : g), zero};
}

// The raw inputs of a row. Their loads take row + kf_opaque_zero(): 0 in every thread, but not
// known to the compiler to be the same in all of them, so the loaded values stay in per-thread
// registers. As block-uniform values the compiler moved them into uniform registers right after
// their loads, which waited for those loads before the pack loads were issued.
struct CeRowIn {
  long long t;
  float lse, g;
};
template <typename T>
KF_DEVICE CeRowIn ce_row_in(long long row, const T* __restrict__ grad, long long grad_stride,
                            const i64* __restrict__ targets, const float* __restrict__ lse) {
  return {targets[row], lse[row], to_float(grad[row * grad_stride])};
}

// One block per work item w = blockIdx.x (gridDim.x = N * chunks_per_row < 2^31); rows ld elements
// apart, the row's last chunk also zeroes its padding [V, ld). Vec: logits and dlogits share their
// address modulo 16 (16-byte packs with default caching between a scalar head and tail per row);
// else every "pack" is P elements moved one by one.
template <typename T, bool Vec>
__global__ void __launch_bounds__(kBwdThreads, 6)
    cross_entropy_backward_kernel(const T* __restrict__ grad, long long grad_stride,
                                       const float* __restrict__ n_valid, const T* __restrict__ logits,
                                       const i64* __restrict__ targets, const float* __restrict__ lse,
                                       T* __restrict__ dlogits, long long V, long long ld,
                                       long long ignore_index, int chunks_per_row, int chunk_packs) {
  kf_wait_prior_grids();
  constexpr int P = Pack128<T>::size;
  constexpr int U = Vec ? kBwdUnrollVec : kBwdUnrollScalar;
  const u32 row32 = blockIdx.x / (u32)chunks_per_row;  // the one division
  const long long chunk = (long long)(blockIdx.x - row32 * (u32)chunks_per_row);
  const long long row = row32;
  const T* xr = logits + row * ld;
  T* dr = dlogits + row * ld;
  const RowSplit<long long> rs = Vec ? split_row(xr, V) : RowSplit<long long>{0, V / P, V - (V / P) * P};
  const CeChunk ck = ce_chunk<T>(rs, chunk, chunk_packs);

  // All loads first: the packs, the scalar head / tail element, then the row's inputs.
  Pack128<T> a[U];
  ce_load_chunk<Vec>(xr + ck.first, ck.np, a);
  const CeScalar sc = ce_scalar(rs, V, chunk);
  const float xs = sc.on ? to_float(xr[sc.c]) : 0.0f;
  const CeRowIn in = ce_row_in(row + kf_opaque_zero(), grad, grad_stride, targets, lse);
  const long long t = in.t;
  const float nv = n_valid ? *n_valid : 1.0f;

  const CeRowScale r = ce_row_scale(t, in.lse, in.g, nv, n_valid != nullptr, V, ignore_index);
  const long long dt = t - ck.first;  // the target's position in this chunk, if there
  const int tl = (dt >= 0 && dt < (long long)ck.np * P) ? (int)dt : -1;
  ce_store_chunk<Vec>(dr + ck.first, ck.np, a, tl, r.l2, r.s, r.zero);
  if (sc.on) {
    const float e = r.zero ? 0.0f : ce_ex2(fmaf(xs, CE_LOG2E, -r.l2)) * r.s;
    dr[sc.c] = from_float<T>(sc.c == t ? e - r.s : e);
  }
  if (chunk == chunks_per_row - 1) zero_row_padding(dr, V, ld, kBwdThreads);
}

KF_DEVICE long long block_sum_ll(long long x, long long* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < nwarps ? scratch[lane] : 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// One block: n_valid = #(targets != ignore_index) and, when row_loss is given, loss = sum of the row
// losses (divided by n_valid for mean: 0 / 0 = NaN when every target is ignored, as in PyTorch).
// Each thread sums a fixed strided subset, then a fixed tree: the same bits on every run.
template <typename T>
__global__ void cross_entropy_reduce_kernel(const float* __restrict__ row_loss, const i64* __restrict__ targets,
                                            T* __restrict__ loss, float* __restrict__ n_valid, long long N,
                                            long long ignore_index, int mean) {
  kf_wait_prior_grids();
  __shared__ float scratch[32];
  __shared__ long long count_scratch[32];
  float acc = 0.0f;
  long long count = 0;
  for (long long i = threadIdx.x; i < N; i += blockDim.x) {
    if (row_loss) acc += row_loss[i];
    count += targets[i] != ignore_index;
  }
  count = block_sum_ll(count, count_scratch);
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) {
    *n_valid = (float)count;
    if (row_loss) *loss = from_float<T>(mean ? acc / (float)count : acc);
  }
}

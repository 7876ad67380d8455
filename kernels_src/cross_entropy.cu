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
// Liger / llm.c fuse the gradient into the forward pass (`Fused` below: a second, L2-hot read of the
// row writes dx). That only pays when dloss is known before the forward runs; under Thunder's grad
// transform it is not, and scaling a saved unit-gradient later costs the same read+write pass as the
// backward kernel, so the executor uses forward + backward and the fused variant is a launcher only.
#include "common.cuh"

#define CE_NAN __int_as_float(0x7fffffff)

// The 16-byte-aligned middle of one row: a scalar head up to the first 16-byte boundary (rows
// start anywhere when V * sizeof(T) is not a multiple of 16), whole packs, then a scalar tail.
struct RowSplit {
  long long head;    // elements [0, head) are scalar
  long long npacks;  // packs start at element head
  long long tail;    // elements [tail, V) are scalar
};
template <typename T>
KF_DEVICE RowSplit split_row(const T* row, long long V) {
  constexpr int P = Pack128<T>::size;
  long long head = (long long)((16 - ((u64)row & 15)) & 15) / (long long)sizeof(T);
  if (head > V) head = V;
  const long long npacks = (V - head) / P;
  return {head, npacks, head + npacks * P};
}

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

// One thread's (max, sum-exp) over its share of row x.
template <bool Stream, typename T>
KF_DEVICE void thread_max_sumexp(const T* __restrict__ x, long long V, float& m, float& s) {
  constexpr int P = Pack128<T>::size;
  const RowSplit r = split_row(x, V);
  for_each_pack<Stream>(x + r.head, r.npacks, [&](const Pack128<T>& a, long long) {
    float pm = a.f(0);
#pragma unroll
    for (int k = 1; k < P; ++k) pm = fmaxf(pm, a.f(k));
    online_rescale(pm, m, s);
    const float ms = m == -KF_INF ? 0.0f : m;
#pragma unroll
    for (int k = 0; k < P; ++k) s += __expf(a.f(k) - ms);
  });
  // Head and tail hold fewer than 2 * P elements: at most one each for the first threads.
  const long long nscalar = r.head + (V - r.tail);
  for (long long j = threadIdx.x; j < nscalar; j += blockDim.x) {
    const float v = to_float(x[j < r.head ? j : r.tail + (j - r.head)]);
    online_rescale(v, m, s);
    s += __expf(v - (m == -KF_INF ? 0.0f : m));
  }
}

// Writes one gradient row dx = (exp(x - L) - onehot(t)) * scale, or zeros when `zero`.
// `vec`: x and dx share their address modulo 16, so one split serves both; else all scalar.
template <bool Stream, typename T>
KF_DEVICE void write_row_grad(const T* __restrict__ x, T* __restrict__ dx, long long V, long long t,
                              float L, float scale, bool zero, int vec) {
  constexpr int P = Pack128<T>::size;
  RowSplit r = vec ? split_row(x, V) : RowSplit{V, 0, V};
  if (zero) {
    Pack128<T> z;
#pragma unroll
    for (int k = 0; k < P; ++k) z.set(k, 0.0f);
    for (long long p = threadIdx.x; p < r.npacks; p += blockDim.x) store128(dx + r.head + p * P, z);
  } else {
    for_each_pack<Stream>(x + r.head, r.npacks, [&](const Pack128<T>& a, long long p) {
      const long long d = t - (r.head + p * P);  // position of the target in this pack, if there
      const int dk = (d >= 0 && d < P) ? (int)d : -1;
      Pack128<T> o;
#pragma unroll
      for (int k = 0; k < P; ++k) o.set(k, (__expf(a.f(k) - L) - (k == dk ? 1.0f : 0.0f)) * scale);
      store128(dx + r.head + p * P, o);
    });
  }
  const long long nscalar = r.head + (V - r.tail);
  for (long long j = threadIdx.x; j < nscalar; j += blockDim.x) {
    const long long c = j < r.head ? j : r.tail + (j - r.head);
    dx[c] = from_float<T>(zero ? 0.0f : (__expf(to_float(x[c]) - L) - (c == t ? 1.0f : 0.0f)) * scale);
  }
}

// dloss of one row: g (per row for reduction "none", grad_stride 1; else a scalar, stride 0),
// divided by the device-side count of non-ignored targets for "mean" (n_valid != nullptr).
template <typename T>
KF_DEVICE float row_dloss(const T* __restrict__ grad, long long grad_stride,
                          const float* __restrict__ n_valid, long long row) {
  float g = to_float(grad[row * grad_stride]);
  return n_valid ? g / *n_valid : g;
}

// Forward, one block per row. Writes lse[row] and the row loss: fp32 into row_loss (reduced later)
// or T into loss_none. Fused: also writes the gradient row for dloss (grad, grad_stride, n_valid),
// re-reading the row while it is still in L2 (first pass without the evict-first hint).
template <typename T, bool Fused>
__global__ void cross_entropy_forward_kernel(const T* __restrict__ logits, const i64* __restrict__ targets,
                                             float* __restrict__ lse_out, float* __restrict__ row_loss,
                                             T* __restrict__ loss_none, T* __restrict__ dlogits,
                                             const T* __restrict__ grad, long long grad_stride,
                                             const float* __restrict__ n_valid, long long V,
                                             long long ignore_index, int vec) {
  __shared__ float scratch[32];
  const long long row = blockIdx.x;
  const T* x = logits + row * V;

  float m = -KF_INF, s = 0.0f;
  thread_max_sumexp<!Fused>(x, V, m, s);
  const float M = block_max(m, scratch);
  const float Ms = M == -KF_INF ? 0.0f : M;  // all -inf row: S = 0 and lse = -inf, not NaN
  const float S = block_sum(s * __expf(m - Ms), scratch);
  const float lse = Ms + logf(S);

  const long long t = targets[row];
  const bool ignored = t == ignore_index;
  const bool bad = !ignored && (t < 0 || t >= V);
  if (threadIdx.x == 0) {
    const float loss = ignored ? 0.0f : bad ? CE_NAN : lse - to_float(x[t]);
    lse_out[row] = lse;
    if (row_loss) row_loss[row] = loss;
    else loss_none[row] = from_float<T>(loss);
  }
  if constexpr (Fused) {
    const float scale = ignored ? 0.0f : row_dloss(grad, grad_stride, n_valid, row);
    write_row_grad<true>(x, dlogits + row * V, V, t, bad ? CE_NAN : lse, scale, ignored, vec);
  }
}

// ---- backward: a streaming elementwise kernel ------------------------------------------------------
// Work items are (row, chunk) pairs, w = row * chunks_per_row + chunk, taken by a persistent grid
// (blockIdx.x, += gridDim.x): one 64-bit division per item, none per element. A chunk is `chunk_packs`
// (<= CE_BWD_THREADS * unroll) consecutive 16-byte packs of the row's aligned middle; each thread
// issues all of its loads of the item before the first use. Chunk 0 also does the row's scalar head
// and tail (< 2 packs' worth). The next item's row inputs (target, lse, dloss) are loaded before the
// current item's data, so their latency hides behind it. Ignored rows write zeros without reading
// the logits. Math: dx = exp2(x * log2e - lse * log2e) * s, minus s at the target.
#define CE_BWD_THREADS 256
#define CE_BWD_UNROLL_VEC 8     // 16-byte packs in flight per thread (128 bytes)
#define CE_BWD_UNROLL_SCALAR 2  // element-wise "packs" (P loads each) in flight per thread
#define CE_LOG2E 1.4426950408889634f

KF_DEVICE float ce_ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// The raw per-row inputs of one work item, loaded one item ahead.
struct CeRowIn {
  long long t;
  float lse, g;
};
template <typename T>
KF_DEVICE CeRowIn ce_row_in(long long row, const T* __restrict__ grad, long long grad_stride,
                            const i64* __restrict__ targets, const float* __restrict__ lse) {
  return {targets[row], lse[row], to_float(grad[row * grad_stride])};
}

// Vec: logits and dlogits share their address modulo 16: 16-byte packs between a scalar head and
// tail per row. Else every "pack" is P elements moved one by one (no alignment needed).
template <typename T, bool Vec>
__global__ void __launch_bounds__(CE_BWD_THREADS, 4)
    cross_entropy_backward_kernel(const T* __restrict__ grad, long long grad_stride,
                                  const float* __restrict__ n_valid, const T* __restrict__ logits,
                                  const i64* __restrict__ targets, const float* __restrict__ lse,
                                  T* __restrict__ dlogits, long long V, long long ignore_index,
                                  long long chunks_per_row, int chunk_packs, long long work) {
  constexpr int P = Pack128<T>::size, B = CE_BWD_THREADS;
  constexpr int U = Vec ? CE_BWD_UNROLL_VEC : CE_BWD_UNROLL_SCALAR;
  const int tid = threadIdx.x;
  long long w = blockIdx.x;
  if (w >= work) return;
  long long row = w / chunks_per_row;
  CeRowIn in = ce_row_in(row, grad, grad_stride, targets, lse);
  const float nv = n_valid ? *n_valid : 1.0f;  // mean: dloss = g / n_valid
  for (; w < work; w += gridDim.x) {
    const long long chunk = w - row * chunks_per_row;
    const long long t = in.t;
    const bool zero = t == ignore_index;
    const bool bad = !zero && (t < 0 || t >= V);
    const float l2 = bad ? CE_NAN : in.lse * CE_LOG2E;
    const float s = zero ? 0.0f : (n_valid ? in.g / nv : in.g);
    const T* xr = logits + row * V;
    T* dr = dlogits + row * V;

    // Prefetch the next item's row inputs.
    const long long wn = w + gridDim.x;
    long long row_n = row;
    if (wn < work) {
      row_n = wn / chunks_per_row;
      in = ce_row_in(row_n, grad, grad_stride, targets, lse);
    }

    const RowSplit rs = Vec ? split_row(xr, V) : RowSplit{0, V / P, (V / P) * P};
    const long long first = rs.head + chunk * (long long)chunk_packs * P;  // element of the chunk's pack 0
    const long long left = rs.npacks - chunk * (long long)chunk_packs;    // packs from there on
    const int np = (int)(left < chunk_packs ? (left > 0 ? left : 0) : chunk_packs);
    const long long dt = t - first;  // the target's position in this chunk, if there
    const int tl = (dt >= 0 && dt < (long long)np * P) ? (int)dt : -1;
    const T* xc = xr + first;
    T* dc = dr + first;
    // Chunk 0 also owns the row's scalar head and tail (fewer than 2 * P elements); their loads go
    // out with the packs'.
    const int nscalar = chunk == 0 ? (int)(rs.head + (V - rs.tail)) : 0;
    const long long c = tid < rs.head ? (long long)tid : rs.tail + (tid - rs.head);
    const float xs = tid < nscalar && !zero ? to_float(xr[c]) : 0.0f;

    if (zero) {
      Pack128<T> z;
#pragma unroll
      for (int k = 0; k < P; ++k) z.set(k, 0.0f);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = u * B + tid;
        if (p < np) {
          if (Vec) {
            store128cs(dc + p * P, z);
          } else {
#pragma unroll
            for (int k = 0; k < P; ++k) dc[p * P + k] = z[k];
          }
        }
      }
    } else {
      Pack128<T> a[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = u * B + tid;
        if (p < np) {
          if (Vec) {
            a[u] = load128cs(xc + p * P);
          } else {
#pragma unroll
            for (int k = 0; k < P; ++k) a[u][k] = xc[p * P + k];
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = u * B + tid;
        if (p < np) {
          const int dk = tl - p * P;  // in [0, P) for the pack holding the target
          Pack128<T> o;
#pragma unroll
          for (int k = 0; k < P; ++k) {
            const float e = ce_ex2(fmaf(a[u].f(k), CE_LOG2E, -l2)) * s;
            o.set(k, k == dk ? e - s : e);
          }
          if (Vec) {
            store128cs(dc + p * P, o);
          } else {
#pragma unroll
            for (int k = 0; k < P; ++k) dc[p * P + k] = o[k];
          }
        }
      }
    }
    if (tid < nscalar) {
      const float e = zero ? 0.0f : ce_ex2(fmaf(xs, CE_LOG2E, -l2)) * s;
      dr[c] = from_float<T>(c == t ? e - s : e);
    }
    row = row_n;
  }
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

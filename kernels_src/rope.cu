// rope: rotary position embedding of q (B, Hq, T, D) and k (B, Hkv, T, D) in one launch, from cos/sin
// tables; outputs are contiguous (B, H, T, D). Nothing is saved for backward but the tables: backward
// is the transposed rotation (rotation by -theta) of the output gradients, by the same kernel.
//
// Two layouts of a head row x (D elements, D even), with c / s the token's cos / sin table row:
// - rotate_half (HF, GPT-NeoX, litgpt): out = x * c + rotate_half(x) * s, rotate_half(x) =
//   (-x[h:], x[:h]) with h = D / 2, and c, s of D entries (HF repeats the D / 2 angles twice). For
//   i < h: out[i] = x[i] c[i] - x[i+h] s[i], out[i+h] = x[i+h] c[i+h] + x[i] s[i+h]. Its transpose,
//   used by backward, swaps and negates the sine halves: dx[i] = g[i] c[i] + g[i+h] s[i+h],
//   dx[i+h] = g[i+h] c[i+h] - g[i] s[i] (exact for any table, not only repeated halves).
// - interleaved (Meta reference, llama2.c): pairs (x[2p], x[2p+1]) rotated by angle p, c and s of
//   D / 2 entries: out = (x0 c - x1 s, x0 s + x1 c); backward rotates by -theta (s -> -s).
//
// Table row of token (b, t): row position_ids[b, t] of a (P, Dc) table when position ids are given
// (an id outside [0, P) makes that token's outputs NaN: no host check on the launch path), else row
// (b, t) of a (B, T, Dc) table or row t of a (1, T, Dc) / (T, Dc) one. Tables are T or fp32.
//
// Layout: one block per token; threadIdx.x walks the row in chunks of W elements (16 bytes when
// `vec`, else 1 element or 1 pair), loading the chunk's table entries once, and threadIdx.y walks the
// Hq + Hkv heads of that token (q heads first, then k heads), kHeadsInFlight heads per thread at a
// time so that each thread has several 16-byte loads outstanding. fp32 math.
#include "common.cuh"

// N consecutive elements of p as floats: 16- or 8-byte loads when `aligned` (the launcher guarantees
// alignment for the offsets this file uses), else element by element.
template <int N, typename C>
KF_DEVICE void load_floats(const C* p, float (&out)[N], int aligned) {
  constexpr int bytes = N * (int)sizeof(C);
  if (bytes % 16 == 0 && aligned) {
    constexpr int E = 16 / sizeof(C);
#pragma unroll
    for (int j = 0; j < N; j += E) {
      const Pack128<C> v = load128(p + j);
#pragma unroll
      for (int u = 0; u < E; ++u) out[j + u] = v.f(u);
    }
  } else if (bytes % 8 == 0 && aligned) {
    constexpr int E = 8 / sizeof(C);
#pragma unroll
    for (int j = 0; j < N; j += E) {
      union {
        uint2 u;
        C c[E];
      } v;
      v.u = *reinterpret_cast<const uint2*>(p + j);
#pragma unroll
      for (int u = 0; u < E; ++u) out[j + u] = to_float(v.c[u]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = to_float(p[j]);
  }
}

// Where head hh (q heads first, then k heads) of token (b, t) is read from and written to.
template <typename T>
struct HeadRow {
  const T* src;
  T* dst;
};
template <typename T>
KF_DEVICE HeadRow<T> head_row(int hh, const T* q, const T* k, T* q_out, T* k_out, long long b,
                              long long t, int Tn, int Hq, int Hkv, int D, long long qsb,
                              long long qsh, long long qst, long long ksb, long long ksh,
                              long long kst) {
  if (hh < Hq)
    return {q + b * qsb + hh * qsh + t * qst, q_out + ((b * Hq + hh) * Tn + t) * D};
  const int h = hh - Hq;
  return {k + b * ksb + h * ksh + t * kst, k_out + ((b * Hkv + h) * Tn + t) * D};
}

// W elements of a head row, kept packed in registers until used: one 16-byte access when W is a
// whole pack (the launcher's `vec`), else element by element.
template <int W, typename T>
KF_DEVICE Pack128<T> load_part(const T* p) {
  if constexpr (W == Pack128<T>::size) {
    return load128cs(p);
  } else {
    Pack128<T> r;
#pragma unroll
    for (int j = 0; j < W; ++j) r[j] = p[j];
    return r;
  }
}
template <int W, typename T>
KF_DEVICE void store_part(T* p, const Pack128<T>& v) {
  if constexpr (W == Pack128<T>::size) {
    store128(p, v);
  } else {
#pragma unroll
    for (int j = 0; j < W; ++j) p[j] = v[j];
  }
}

// Heads a thread has in flight at once: all their loads are issued before the first store.
constexpr int kHeadsInFlight = 4;

// rotate_half layout, chunks of W elements from each half (W = V when `vec`, else 1).
template <int W, typename T, typename C>
KF_DEVICE void rope_half_token(const T* q, const T* k, T* q_out, T* k_out, const C* cr, const C* sr,
                               bool bad, long long b, long long t, int Tn, int Hq, int Hkv, int D,
                               long long qsb, long long qsh, long long qst, long long ksb,
                               long long ksh, long long kst, int inverse, int tvec) {
  constexpr int U = kHeadsInFlight;
  const int H = Hq + Hkv, half = D / 2, nchunk = half / W;
  for (int c = threadIdx.x; c < nchunk; c += blockDim.x) {
    const int i0 = c * W;
    float c_lo[W], c_hi[W], s_lo[W], s_hi[W];
    load_floats<W>(cr + i0, c_lo, tvec);
    load_floats<W>(cr + half + i0, c_hi, tvec);
    load_floats<W>(sr + i0, s_lo, tvec);
    load_floats<W>(sr + half + i0, s_hi, tvec);
#pragma unroll
    for (int j = 0; j < W; ++j) {
      if (inverse) {  // the transpose: lo = a c_lo + b s_hi, hi = b c_hi - a s_lo
        const float t_lo = s_lo[j];
        s_lo[j] = -s_hi[j];
        s_hi[j] = -t_lo;
      }
      if (bad) c_lo[j] = c_hi[j] = __int_as_float(0x7fffffff);
    }
    for (int h0 = threadIdx.y; h0 < H; h0 += U * blockDim.y) {
      Pack128<T> lo[U], hi[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int hh = h0 + u * blockDim.y;
        if (hh < H) {
          const HeadRow<T> r = head_row(hh, q, k, q_out, k_out, b, t, Tn, Hq, Hkv, D, qsb, qsh, qst,
                                        ksb, ksh, kst);
          lo[u] = load_part<W>(r.src + i0);
          hi[u] = load_part<W>(r.src + half + i0);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int hh = h0 + u * blockDim.y;
        if (hh < H) {
          Pack128<T> olo, ohi;
#pragma unroll
          for (int j = 0; j < W; ++j) {
            const float a = lo[u].f(j), bb = hi[u].f(j);
            olo.set(j, a * c_lo[j] - bb * s_lo[j]);
            ohi.set(j, bb * c_hi[j] + a * s_hi[j]);
          }
          const HeadRow<T> r = head_row(hh, q, k, q_out, k_out, b, t, Tn, Hq, Hkv, D, qsb, qsh, qst,
                                        ksb, ksh, kst);
          store_part<W>(r.dst + i0, olo);
          store_part<W>(r.dst + half + i0, ohi);
        }
      }
    }
  }
}

// Interleaved layout, chunks of W elements = W / 2 pairs (W = V when `vec`, else 2).
template <int W, typename T, typename C>
KF_DEVICE void rope_pairs_token(const T* q, const T* k, T* q_out, T* k_out, const C* cr, const C* sr,
                                bool bad, long long b, long long t, int Tn, int Hq, int Hkv, int D,
                                long long qsb, long long qsh, long long qst, long long ksb,
                                long long ksh, long long kst, int inverse, int tvec) {
  constexpr int P = W / 2, U = kHeadsInFlight;
  const int H = Hq + Hkv, nchunk = D / W;
  for (int c = threadIdx.x; c < nchunk; c += blockDim.x) {
    const int i0 = c * W;
    float cs[P], sn[P];
    load_floats<P>(cr + i0 / 2, cs, tvec);
    load_floats<P>(sr + i0 / 2, sn, tvec);
#pragma unroll
    for (int p = 0; p < P; ++p) {
      if (inverse) sn[p] = -sn[p];
      if (bad) cs[p] = __int_as_float(0x7fffffff);
    }
    for (int h0 = threadIdx.y; h0 < H; h0 += U * blockDim.y) {
      Pack128<T> x[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int hh = h0 + u * blockDim.y;
        if (hh < H)
          x[u] = load_part<W>(head_row(hh, q, k, q_out, k_out, b, t, Tn, Hq, Hkv, D, qsb, qsh, qst,
                                       ksb, ksh, kst).src + i0);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int hh = h0 + u * blockDim.y;
        if (hh < H) {
          Pack128<T> out;
#pragma unroll
          for (int p = 0; p < P; ++p) {
            const float x0 = x[u].f(2 * p), x1 = x[u].f(2 * p + 1);
            out.set(2 * p, x0 * cs[p] - x1 * sn[p]);
            out.set(2 * p + 1, x0 * sn[p] + x1 * cs[p]);
          }
          store_part<W>(head_row(hh, q, k, q_out, k_out, b, t, Tn, Hq, Hkv, D, qsb, qsh, qst, ksb,
                                 ksh, kst).dst + i0, out);
        }
      }
    }
  }
}

template <typename T, typename C>
KF_DEVICE void rope_body(const T* q, const T* k, T* q_out, T* k_out, const C* cos, const C* sin,
                         const long long* pos, int Tn, int Hq, int Hkv, int D, long long qsb,
                         long long qsh, long long qst, long long ksb, long long ksh, long long kst,
                         int tab_batched, long long n_pos, long long pos_sb, int interleaved,
                         int inverse, int vec, int tvec) {
  constexpr int V = Pack128<T>::size;
  const long long tok = blockIdx.x;
  const long long b = tok / Tn, t = tok - b * Tn;
  long long trow = tab_batched ? tok : t;
  bool bad = false;
  if (pos) {
    const long long p = pos[b * pos_sb + t];
    bad = p < 0 || p >= n_pos;
    trow = bad ? 0 : p;
  }
  const int Dc = interleaved ? D / 2 : D;
  const C* cr = cos + trow * Dc;
  const C* sr = sin + trow * Dc;
  if (interleaved) {
    if (vec)
      rope_pairs_token<V>(q, k, q_out, k_out, cr, sr, bad, b, t, Tn, Hq, Hkv, D, qsb, qsh, qst, ksb,
                          ksh, kst, inverse, tvec);
    else
      rope_pairs_token<2>(q, k, q_out, k_out, cr, sr, bad, b, t, Tn, Hq, Hkv, D, qsb, qsh, qst, ksb,
                          ksh, kst, inverse, 0);
  } else {
    if (vec)
      rope_half_token<V>(q, k, q_out, k_out, cr, sr, bad, b, t, Tn, Hq, Hkv, D, qsb, qsh, qst, ksb,
                         ksh, kst, inverse, tvec);
    else
      rope_half_token<1>(q, k, q_out, k_out, cr, sr, bad, b, t, Tn, Hq, Hkv, D, qsb, qsh, qst, ksb,
                         ksh, kst, inverse, 0);
  }
}

// Tables stored as T.
template <typename T>
__global__ void rope_kernel(const T* __restrict__ q, const T* __restrict__ k, T* __restrict__ q_out,
                            T* __restrict__ k_out, const T* __restrict__ cos,
                            const T* __restrict__ sin, const long long* __restrict__ pos, int Tn,
                            int Hq, int Hkv, int D, long long qsb, long long qsh, long long qst,
                            long long ksb, long long ksh, long long kst, int tab_batched,
                            long long n_pos, long long pos_sb, int interleaved, int inverse, int vec,
                            int tvec) {
  rope_body<T, T>(q, k, q_out, k_out, cos, sin, pos, Tn, Hq, Hkv, D, qsb, qsh, qst, ksb, ksh, kst,
                  tab_batched, n_pos, pos_sb, interleaved, inverse, vec, tvec);
}

// Tables stored as fp32 (bf16 / fp16 q and k).
template <typename T>
__global__ void rope_f32tab_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                   T* __restrict__ q_out, T* __restrict__ k_out,
                                   const float* __restrict__ cos, const float* __restrict__ sin,
                                   const long long* __restrict__ pos, int Tn, int Hq, int Hkv, int D,
                                   long long qsb, long long qsh, long long qst, long long ksb,
                                   long long ksh, long long kst, int tab_batched, long long n_pos,
                                   long long pos_sb, int interleaved, int inverse, int vec,
                                   int tvec) {
  rope_body<T, float>(q, k, q_out, k_out, cos, sin, pos, Tn, Hq, Hkv, D, qsb, qsh, qst, ksb, ksh,
                      kst, tab_batched, n_pos, pos_sb, interleaved, inverse, vec, tvec);
}

// rope: rotary position embedding of q (B, Hq, T, D) and k (B, Hkv, T, D) in one launch, from cos/sin
// tables. Inputs and outputs are read and written at any (b, h, t) strides with a dense last dim: the
// launcher gives each output its input's layout where that is token-major ((B, T, H, D) in memory),
// else contiguous (B, H, T, D). Nothing is saved for backward but the tables: backward is the
// transposed rotation (rotation by -theta) of the output gradients, by the same kernel.
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
// Two kernels, fp32 math in both (the launcher picks; see src/ops/rope.cpp):
// - rope_tile_kernel (16-byte aligned rows and table rows, rows of at most 256 16-byte chunks): a
//   thread owns one 16-byte chunk column of one token for a group of U = 8 heads of q or of k, issues all of their loads before
//   the token's table chunk (read once per U heads) and before any math; blocks cover tiles of
//   consecutive tokens, grid.y the head groups. See the comment above rope_tile_body.
// - rope_kernel (every other layout: misaligned rows or tables, D / 2 or D not a multiple of the
//   16-byte pack, longer rows, more than 65535 head groups): one block per token; threadIdx.x walks the row in chunks of W elements (16 bytes
//   when `vec`, else 1 element or 1 pair), loading the chunk's table entries once, and threadIdx.y
//   walks the Hq + Hkv heads of that token (q heads first, then k heads), kHeadsInFlight heads per
//   thread at a time so that each thread has several 16-byte loads outstanding.
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
// qs* / ks*: the (b, h, t) strides of q / k, qo* / ko*: those of q_out / k_out (elements).
template <typename T>
KF_DEVICE HeadRow<T> head_row(int hh, const T* q, const T* k, T* q_out, T* k_out, long long b,
                              long long t, int Hq, long long qsb, long long qsh, long long qst,
                              long long ksb, long long ksh, long long kst, long long qob,
                              long long qoh, long long qot, long long kob, long long koh,
                              long long kot) {
  if (hh < Hq) return {q + b * qsb + hh * qsh + t * qst, q_out + b * qob + hh * qoh + t * qot};
  const int h = hh - Hq;
  return {k + b * ksb + h * ksh + t * kst, k_out + b * kob + h * koh + t * kot};
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
                               bool bad, long long b, long long t, int Hq, int Hkv, int D,
                               long long qsb, long long qsh, long long qst, long long ksb,
                               long long ksh, long long kst, long long qob, long long qoh,
                               long long qot, long long kob, long long koh, long long kot,
                               int inverse, int tvec) {
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
          const HeadRow<T> r = head_row(hh, q, k, q_out, k_out, b, t, Hq, qsb, qsh, qst, ksb, ksh,
                                        kst, qob, qoh, qot, kob, koh, kot);
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
          const HeadRow<T> r = head_row(hh, q, k, q_out, k_out, b, t, Hq, qsb, qsh, qst, ksb, ksh,
                                        kst, qob, qoh, qot, kob, koh, kot);
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
                                bool bad, long long b, long long t, int Hq, int Hkv, int D,
                                long long qsb, long long qsh, long long qst, long long ksb,
                                long long ksh, long long kst, long long qob, long long qoh,
                                long long qot, long long kob, long long koh, long long kot,
                                int inverse, int tvec) {
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
          x[u] = load_part<W>(head_row(hh, q, k, q_out, k_out, b, t, Hq, qsb, qsh, qst, ksb, ksh, kst,
                                       qob, qoh, qot, kob, koh, kot).src + i0);
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
          store_part<W>(head_row(hh, q, k, q_out, k_out, b, t, Hq, qsb, qsh, qst, ksb, ksh, kst, qob,
                                 qoh, qot, kob, koh, kot).dst + i0, out);
        }
      }
    }
  }
}

// Table row of token tok = (b, t) (see the top of the file); `bad`: its position id is outside
// [0, n_pos) (row 0 is read instead and the caller writes NaN). I: the caller's index type.
template <typename I>
KF_DEVICE long long table_row(const long long* pos, I b, I t, I tok, int tab_batched,
                              long long n_pos, long long pos_sb, bool& bad) {
  long long row = tab_batched ? tok : t;
  bad = false;
  if (pos) {
    const long long p = pos[b * pos_sb + t];
    bad = p < 0 || p >= n_pos;
    row = bad ? 0 : p;
  }
  return row;
}

template <typename T, typename C>
KF_DEVICE void rope_body(const T* q, const T* k, T* q_out, T* k_out, const C* cos, const C* sin,
                         const long long* pos, int Tn, int Hq, int Hkv, int D, long long qsb,
                         long long qsh, long long qst, long long ksb, long long ksh, long long kst,
                         long long qob, long long qoh, long long qot, long long kob, long long koh,
                         long long kot, int tab_batched, long long n_pos, long long pos_sb,
                         int interleaved, int inverse, int vec, int tvec) {
  constexpr int V = Pack128<T>::size;
  const long long tok = blockIdx.x;
  const long long b = tok / Tn, t = tok - b * Tn;
  bool bad;
  const long long trow = table_row(pos, b, t, tok, tab_batched, n_pos, pos_sb, bad);
  const int Dc = interleaved ? D / 2 : D;
  const C* cr = cos + trow * Dc;
  const C* sr = sin + trow * Dc;
  if (interleaved) {
    if (vec)
      rope_pairs_token<V>(q, k, q_out, k_out, cr, sr, bad, b, t, Hq, Hkv, D, qsb, qsh, qst, ksb, ksh,
                          kst, qob, qoh, qot, kob, koh, kot, inverse, tvec);
    else
      rope_pairs_token<2>(q, k, q_out, k_out, cr, sr, bad, b, t, Hq, Hkv, D, qsb, qsh, qst, ksb, ksh,
                          kst, qob, qoh, qot, kob, koh, kot, inverse, 0);
  } else {
    if (vec)
      rope_half_token<V>(q, k, q_out, k_out, cr, sr, bad, b, t, Hq, Hkv, D, qsb, qsh, qst, ksb, ksh,
                         kst, qob, qoh, qot, kob, koh, kot, inverse, tvec);
    else
      rope_half_token<1>(q, k, q_out, k_out, cr, sr, bad, b, t, Hq, Hkv, D, qsb, qsh, qst, ksb, ksh,
                         kst, qob, qoh, qot, kob, koh, kot, inverse, 0);
  }
}

// Tables stored as T. qs* / ks*: input strides, qo* / ko*: output strides, over (b, h, t).
template <typename T>
__global__ void rope_kernel(const T* __restrict__ q, const T* __restrict__ k, T* __restrict__ q_out,
                            T* __restrict__ k_out, const T* __restrict__ cos,
                            const T* __restrict__ sin, const long long* __restrict__ pos, int Tn,
                            int Hq, int Hkv, int D, long long qsb, long long qsh, long long qst,
                            long long ksb, long long ksh, long long kst, long long qob,
                            long long qoh, long long qot, long long kob, long long koh,
                            long long kot, int tab_batched, long long n_pos, long long pos_sb,
                            int interleaved, int inverse, int vec, int tvec) {
  kf_wait_prior_grids();
  rope_body<T, T>(q, k, q_out, k_out, cos, sin, pos, Tn, Hq, Hkv, D, qsb, qsh, qst, ksb, ksh, kst,
                  qob, qoh, qot, kob, koh, kot, tab_batched, n_pos, pos_sb, interleaved, inverse,
                  vec, tvec);
}

// Tables stored as fp32 (bf16 / fp16 q and k).
template <typename T>
__global__ void rope_f32tab_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                   T* __restrict__ q_out, T* __restrict__ k_out,
                                   const float* __restrict__ cos, const float* __restrict__ sin,
                                   const long long* __restrict__ pos, int Tn, int Hq, int Hkv, int D,
                                   long long qsb, long long qsh, long long qst, long long ksb,
                                   long long ksh, long long kst, long long qob, long long qoh,
                                   long long qot, long long kob, long long koh, long long kot,
                                   int tab_batched, long long n_pos, long long pos_sb,
                                   int interleaved, int inverse, int vec, int tvec) {
  kf_wait_prior_grids();
  rope_body<T, float>(q, k, q_out, k_out, cos, sin, pos, Tn, Hq, Hkv, D, qsb, qsh, qst, ksb, ksh,
                      kst, qob, qoh, qot, kob, koh, kot, tab_batched, n_pos, pos_sb, interleaved,
                      inverse, vec, tvec);
}

// ---- tiled kernel (16-byte aligned rows and tables) ---------------------------------------------
// Element access on raw 16-byte packs (uint4): E = 4 / sizeof(T) elements per 32-bit word. bf16
// unpacks with one shift or mask per element and packs two results with one cvt (sm_80+).
// Element j of N consecutive 16-byte packs of C.
template <typename C, int N>
KF_DEVICE float pack_elem(const uint4 (&t)[N], int j) {
  constexpr int E = 4 / (int)sizeof(C), PER = 4 * E;
  return Word<C>::get(word_of(t[j / PER], (j % PER) / E), j % E);
}
template <typename T> KF_DEVICE uint4 ld16cs(const T* p) {
  return __ldcs(reinterpret_cast<const uint4*>(p));
}
template <typename T> KF_DEVICE uint4 ld16(const T* p) { return *reinterpret_cast<const uint4*>(p); }
template <typename T> KF_DEVICE void st16(T* p, const uint4& v) { *reinterpret_cast<uint4*>(p) = v; }

// Layout: blocks of (bx, by) threads, threadIdx.x over a row's 16-byte chunks (rotate_half: chunk c
// is elements [cV, cV + V) of the first half *and* the same of the second half, so one thread holds
// both members of its rotated pairs; interleaved: elements [cV, cV + V), V / 2 pairs), threadIdx.y
// over a tile of by consecutive tokens. blockIdx.y is a group of U consecutive heads of q (groups
// 0 .. gq - 1) or of k (the rest), never both, so a group has one base pointer and one head stride
// per side (input and output);
// blockIdx.x walks the token tiles with a grid stride (the launcher gives each block one tile). Per (token, chunk) a thread issues the 16-byte loads of its U
// heads (2U for rotate_half) and of its token's table chunk (once for the U heads) back to back, and
// only then converts and rotates, table element outer and head inner, results written over their
// inputs (the table's address depends on no load unless position ids are given). Heads past a
// tensor's last head (a partial group) re-read that last head and skip their stores, so the loads
// are unconditional.
template <typename T, typename C, int U, bool IL>
KF_DEVICE void rope_tile_body(const T* __restrict__ q, const T* __restrict__ k, T* __restrict__ q_out,
                              T* __restrict__ k_out, const C* __restrict__ cos,
                              const C* __restrict__ sin, const long long* __restrict__ pos, int ntok,
                              int Tn, int Hq, int Hkv, int D, long long qsb, long long qsh,
                              long long qst, long long ksb, long long ksh, long long kst,
                              long long qob, long long qoh, long long qot, long long kob,
                              long long koh, long long kot, int tab_batched, long long n_pos,
                              long long pos_sb, int inverse, int ntiles, int gq) {
  constexpr int V = Pack128<T>::size, E = 4 / (int)sizeof(T);
  const int half = D / 2, Dc = IL ? half : D;
  const bool isq = (int)blockIdx.y < gq;
  const int h0 = (isq ? (int)blockIdx.y : (int)blockIdx.y - gq) * U;
  const int Hn = isq ? Hq : Hkv;
  const int last = min(U, Hn - h0) - 1;
  const T* src0 = isq ? q : k;
  T* dst0 = isq ? q_out : k_out;
  const long long sb = isq ? qsb : ksb, sh = isq ? qsh : ksh, st = isq ? qst : kst;
  const long long ob = isq ? qob : kob, oh = isq ? qoh : koh, ot = isq ? qot : kot;
  const float qnan = __int_as_float(0x7fffffff);
  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int tok = tile * (int)blockDim.y + (int)threadIdx.y;
    if (tok >= ntok) break;  // later tiles only hold later tokens
    const int b = tok / Tn, t = tok - b * Tn;
    const T* src = src0 + b * sb + t * st + h0 * sh;
    T* dst = dst0 + b * ob + t * ot + h0 * oh;
    const int i0 = threadIdx.x * V;  // blockDim.x is the row's chunk count
    // 1. the data loads of the U heads (pointers stepped per head: no per-head 64-bit products)
    uint4 x0[U], x1[U];  // rotate_half: first / second half chunks; interleaved: x0 only
    {
      const T* p = src + i0;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        x0[u] = ld16cs(p);
        if constexpr (!IL) x1[u] = ld16cs(p + half);
        if (u < last) p += sh;
      }
    }
    // 2. the table row (a dependent load with position ids) and its chunk
    bool bad;
    const long long trow = table_row(pos, b, t, tok, tab_batched, n_pos, pos_sb, bad);
    const C* cr = cos + trow * Dc;
    const C* sr = sin + trow * Dc;
    // 3. rotate (table element outer, head inner), then the stores
    if constexpr (!IL) {
      constexpr int NT = V * (int)sizeof(C) / 16;  // 16-byte table packs per half chunk
      uint4 cl[NT], ch[NT], sl[NT], shi[NT];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        cl[n] = ld16(cr + i0 + n * 16 / (int)sizeof(C));
        ch[n] = ld16(cr + half + i0 + n * 16 / (int)sizeof(C));
        sl[n] = ld16(sr + i0 + n * 16 / (int)sizeof(C));
        shi[n] = ld16(sr + half + i0 + n * 16 / (int)sizeof(C));
      }
#pragma unroll
      for (int m = 0; m < 4; ++m) {  // word m of each pack: elements j = mE .. mE + E - 1
        float c_lo[E], c_hi[E], s_lo[E], s_hi[E];
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const int j = m * E + e;
          c_lo[e] = pack_elem<C>(cl, j);
          c_hi[e] = pack_elem<C>(ch, j);
          s_lo[e] = pack_elem<C>(sl, j);
          s_hi[e] = pack_elem<C>(shi, j);
          if (inverse) {  // the transpose: lo = a c_lo + b s_hi, hi = b c_hi - a s_lo
            const float t_lo = s_lo[e];
            s_lo[e] = -s_hi[e];
            s_hi[e] = -t_lo;
          }
          if (bad) c_lo[e] = c_hi[e] = qnan;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const u32 wa = word_of(x0[u], m), wb = word_of(x1[u], m);
          float lo[2], hi[2];
#pragma unroll
          for (int e = 0; e < E; ++e) {
            const float a = Word<T>::get(wa, e), bb = Word<T>::get(wb, e);
            lo[e] = a * c_lo[e] - bb * s_lo[e];
            hi[e] = bb * c_hi[e] + a * s_hi[e];
          }
          set_word(x0[u], m, Word<T>::pack2(lo[0], lo[E - 1]));
          set_word(x1[u], m, Word<T>::pack2(hi[0], hi[E - 1]));
        }
      }
      T* o = dst + i0;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (u <= last) {
          st16(o, x0[u]);
          st16(o + half, x1[u]);
        }
        o += oh;
      }
    } else {
      constexpr int P = V / 2;
      float cs[P], sn[P];
      load_floats<P>(cr + i0 / 2, cs, 1);
      load_floats<P>(sr + i0 / 2, sn, 1);
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const float cp = bad ? qnan : cs[p], sp = inverse ? -sn[p] : sn[p];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if constexpr (E == 2) {  // pair p is word p
            const u32 w = word_of(x0[u], p);
            const float a = Word<T>::get(w, 0), bb = Word<T>::get(w, 1);
            set_word(x0[u], p, Word<T>::pack2(a * cp - bb * sp, a * sp + bb * cp));
          } else {  // pair p is words 2p, 2p + 1
            const float a = __uint_as_float(word_of(x0[u], 2 * p));
            const float bb = __uint_as_float(word_of(x0[u], 2 * p + 1));
            set_word(x0[u], 2 * p, __float_as_uint(a * cp - bb * sp));
            set_word(x0[u], 2 * p + 1, __float_as_uint(a * sp + bb * cp));
          }
        }
      }
      T* o = dst + i0;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (u <= last) st16(o, x0[u]);
        o += oh;
      }
    }
  }
}

// Tables stored as T; U heads per thread, IL: interleaved layout. Needs the launcher's `vec` and
// `tvec` (16-byte aligned rows and table rows). Compiled for 2 resident blocks per SM (the register
// cap that U = 8 needs).
template <typename T, int U, bool IL>
__global__ void __launch_bounds__(256, 2)
    rope_tile_kernel(const T* __restrict__ q, const T* __restrict__ k, T* __restrict__ q_out,
                     T* __restrict__ k_out, const T* __restrict__ cos, const T* __restrict__ sin,
                     const long long* __restrict__ pos, int ntok, int Tn, int Hq, int Hkv, int D,
                     long long qsb, long long qsh, long long qst, long long ksb, long long ksh,
                     long long kst, long long qob, long long qoh, long long qot, long long kob,
                     long long koh, long long kot, int tab_batched, long long n_pos,
                     long long pos_sb, int inverse, int ntiles, int gq) {
  kf_wait_prior_grids();
  rope_tile_body<T, T, U, IL>(q, k, q_out, k_out, cos, sin, pos, ntok, Tn, Hq, Hkv, D, qsb, qsh, qst,
                              ksb, ksh, kst, qob, qoh, qot, kob, koh, kot, tab_batched, n_pos,
                              pos_sb, inverse, ntiles, gq);
}

// Tables stored as fp32 (bf16 / fp16 q and k).
template <typename T, int U, bool IL>
__global__ void __launch_bounds__(256, 2)
    rope_tile_f32tab_kernel(const T* __restrict__ q, const T* __restrict__ k, T* __restrict__ q_out,
                            T* __restrict__ k_out, const float* __restrict__ cos,
                            const float* __restrict__ sin, const long long* __restrict__ pos,
                            int ntok, int Tn, int Hq, int Hkv, int D, long long qsb, long long qsh,
                            long long qst, long long ksb, long long ksh, long long kst,
                            long long qob, long long qoh, long long qot, long long kob,
                            long long koh, long long kot, int tab_batched, long long n_pos,
                            long long pos_sb, int inverse, int ntiles, int gq) {
  kf_wait_prior_grids();
  rope_tile_body<T, float, U, IL>(q, k, q_out, k_out, cos, sin, pos, ntok, Tn, Hq, Hkv, D, qsb, qsh,
                                  qst, ksb, ksh, kst, qob, qoh, qot, kob, koh, kot, tab_batched,
                                  n_pos, pos_sb, inverse, ntiles, gq);
}

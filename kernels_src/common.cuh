// common.cuh: what every kforge kernel shares.
//
// Compiled by NVRTC with no CUDA headers at all (NVRTC 13 ships no cuda_bf16.h / cuda_fp16.h), so
// the 16-bit float storage types below are our own: plain 16-bit structs converted with the PTX
// `cvt` instructions (sm_80+: round-to-nearest-even, NaN preserved). All arithmetic is done in fp32.
//
// Conventions for kernels:
// - Template on the storage type T (float, bf16, half); instantiated from the C++ launcher through
//   NVRTC name expressions, e.g. "gelu_forward_kernel<bf16>".
// - Index with size_t / long long wherever an offset can exceed 2^31 elements.
// - 16-byte accesses: Pack128<T, H>, one unit with element and word views; H says whether the
//   compiler holds it as T elements (element-wise kernels) or as four 32-bit words (kernels that
//   hold rows in registers). Scalar tails handle sizes that are not a multiple of it.
// - Every primitive a kernel shares with another lives here (words of packed 16-bit values, the
//   16-byte units, splitting a row around 16-byte boundaries, opaque zeros, cp.async); a kernel
//   file holds its op's math and layouts only.
#pragma once

#define KF_DEVICE __device__ __forceinline__

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// NVRTC has no <math.h>: INFINITY is not defined.
#define KF_INF __int_as_float(0x7f800000)

struct __align__(2) bf16 { u16 bits; };
struct __align__(2) half { u16 bits; };

// ---- dependent launches (Kernel::launch in the runtime) ------------------------------------------
// On sm_90+ every kernel is launched as a programmatic dependent of the kernel before it on the
// stream, so it may start while that kernel is still draining. Every kernel therefore begins with
// kf_wait_prior_grids(), which returns once that kernel has finished and its writes are visible
// (tests/test_runtime.py checks it is each kernel's first statement). A no-op before sm_90.
KF_DEVICE void kf_wait_prior_grids() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the dependent kernel's blocks be scheduled now (e.g. as this block enters its epilogue) rather
// than when this grid exits. Only scheduling: the dependent still waits in kf_wait_prior_grids().
KF_DEVICE void kf_allow_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---- conversions --------------------------------------------------------------------------------
KF_DEVICE float to_float(float x) { return x; }
KF_DEVICE float to_float(bf16 x) { return __uint_as_float(((u32)x.bits) << 16); }
KF_DEVICE float to_float(half x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}

template <typename T> KF_DEVICE T from_float(float x);
template <> KF_DEVICE float from_float<float>(float x) { return x; }
template <> KF_DEVICE bf16 from_float<bf16>(float x) {
  bf16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  return r;
}
template <> KF_DEVICE half from_float<half>(float x) {
  half r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  return r;
}

// ---- 32-bit words of packed elements ------------------------------------------------------------
// Word<T>: a 32-bit word as kElems elements of T (one float, or two bf16 / half with element 0 in
// the low half). Kernels that keep 16-bit data packed convert word by word: bf16 unpacks with one
// shift (low half) or mask (high half) per element, and two results round in one cvt (sm_80+).
//   get(w, e): element e as fp32;  unpack(w, f): all kElems elements (widen(w, lo, hi): both of two);  pack(f) / pack2(lo, hi): a
//   word from kElems floats, rounded to nearest even as from_float<T>;  round(a, b): a and b
//   rounded to T and read back (two elements: one cvt);  kOne: a word of ones.
template <typename T> struct Word;
template <> struct Word<float> {
  static constexpr int kElems = 1;
  static constexpr u32 kOne = 0x3f800000u;
  KF_DEVICE static float get(u32 w, int) { return __uint_as_float(w); }
  KF_DEVICE static void unpack(u32 w, float* f) { f[0] = __uint_as_float(w); }
  KF_DEVICE static u32 pack2(float lo, float) { return __float_as_uint(lo); }
  KF_DEVICE static u32 pack(const float* f) { return __float_as_uint(f[0]); }
  KF_DEVICE static void round(float&, float&) {}
};
template <> struct Word<bf16> {
  static constexpr int kElems = 2;
  static constexpr u32 kOne = 0x3f803f80u;
  KF_DEVICE static float get(u32 w, int e) { return __uint_as_float(e ? w & 0xffff0000u : w << 16); }
  KF_DEVICE static void widen(u32 w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
  }
  KF_DEVICE static void unpack(u32 w, float* f) { widen(w, f[0], f[1]); }
  KF_DEVICE static u32 pack2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  KF_DEVICE static u32 pack(const float* f) { return pack2(f[0], f[1]); }
  KF_DEVICE static void round(float& a, float& b) {
    const u32 r = pack2(a, b);
    a = __uint_as_float(r << 16);
    b = __uint_as_float(r & 0xffff0000u);
  }
};
template <> struct Word<half> {
  static constexpr int kElems = 2;
  static constexpr u32 kOne = 0x3c003c00u;
  KF_DEVICE static float get(u32 w, int e) {
    float f;
    if (e)
      asm("{.reg .f16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.f32.f16 %0, hi;}" : "=f"(f) : "r"(w));
    else
      asm("{.reg .f16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.f32.f16 %0, lo;}" : "=f"(f) : "r"(w));
    return f;
  }
  KF_DEVICE static void widen(u32 w, float& lo, float& hi) {
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\t"
        "cvt.f32.f16 %0, lo;\n\tcvt.f32.f16 %1, hi;\n\t}"
        : "=f"(lo), "=f"(hi)
        : "r"(w));
  }
  KF_DEVICE static void unpack(u32 w, float* f) { widen(w, f[0], f[1]); }
  KF_DEVICE static u32 pack2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  KF_DEVICE static u32 pack(const float* f) { return pack2(f[0], f[1]); }
  KF_DEVICE static void round(float& a, float& b) {
    const u32 r = pack2(a, b);
    a = get(r, 0);
    b = get(r, 1);
  }
};

// The 16-bit type of a norm backward's copy of an fp32 dx (NZ, a template parameter of the rmsnorm and
// layernorm backward kernels: 1 bf16, 2 half; 0: no copy, bf16 named only to type a null pointer).
template <int NZ> struct CopyOf { using type = bf16; };
template <> struct CopyOf<2> { using type = half; };

// Word i of a raw 16-byte vector (int4 / uint4, as loaded), and setting it.
KF_DEVICE u32 word_of(const int4& v, int i) {
  return (u32)(i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w);
}
KF_DEVICE u32 word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
KF_DEVICE void set_word(int4& v, int i, u32 w) {
  if (i == 0) v.x = (int)w;
  else if (i == 1) v.y = (int)w;
  else if (i == 2) v.z = (int)w;
  else v.w = (int)w;
}
KF_DEVICE void set_word(uint4& v, int i, u32 w) {
  if (i == 0) v.x = w;
  else if (i == 1) v.y = w;
  else if (i == 2) v.z = w;
  else v.w = w;
}

// ---- the 16-byte unit -----------------------------------------------------------------------------
// Pack128<T, H>: what a thread moves in one 16-byte access, 16 bytes of T (4 floats or 8 bf16 /
// half). Loads and stores must be 16-byte aligned; launchers check base pointers and row strides
// before choosing a vectorised kernel. Every unit has both views of its bytes:
//   elements: p[i] (a T&), f(i) (element i as fp32), set(i, x) (x rounded to nearest even);
//   words:    word(i) (32-bit word i; two bf16 / half per word, element 0 in the low half, as Word<T>);
//   whole:    size (elements), from(y) (a unit from `size` floats, rounded to nearest even), fill(v),
//             words(x) (every word x).
// H is only how the compiler is shown the 16 bytes (the type of the array it holds), yet that alone
// changes the machine code ptxas emits, so each kernel keeps the one it was tuned with:
// - Held::elems (default): T[size], the element-wise kernels; f(i) reads element i's own bits.
// - Held::words: u32[4], the kernels that keep rows in registers: a unit costs four registers
//   whatever T is and stays packed until its elements are used (16-bit values unpacked one per
//   register would cost twice as many); f(i) shifts or masks its word (Word<T>::get), and opaque()
//   works on the words.
// Either H for every kernel changes the SASS of some (dev/cubin_diff.py; see
// docs/experiments/common-primitives.md), hence the parameter rather than one storage.
enum class Held { elems, words };
template <typename T, Held H> struct Held128 { typedef T type[16 / sizeof(T)]; };
template <typename T> struct Held128<T, Held::words> { typedef u32 type[4]; };

template <typename T, Held H = Held::elems>
struct __align__(16) Pack128 {
  static constexpr int size = 16 / sizeof(T);
  static constexpr bool kWords = H == Held::words;
  typename Held128<T, H>::type raw;
  KF_DEVICE T& operator[](int i) { return reinterpret_cast<T*>(raw)[i]; }
  KF_DEVICE const T& operator[](int i) const { return reinterpret_cast<const T*>(raw)[i]; }
  KF_DEVICE u32& word(int i) { return reinterpret_cast<u32*>(raw)[i]; }
  KF_DEVICE u32 word(int i) const { return reinterpret_cast<const u32*>(raw)[i]; }
  KF_DEVICE float f(int i) const {
    if constexpr (!kWords) return to_float((*this)[i]);
    else if constexpr (size == 4) return __uint_as_float(word(i));
    else return Word<T>::get(word(i >> 1), i & 1);
  }
  KF_DEVICE void set(int i, float x) { (*this)[i] = from_float<T>(x); }
  static KF_DEVICE Pack128 from(const float (&y)[size]) {
    Pack128 r;
    if constexpr (kWords || sizeof(T) == 2) {
#pragma unroll
      for (int i = 0; i < 4; ++i) r.word(i) = Word<T>::pack(&y[i * Word<T>::kElems]);
    } else {
#pragma unroll
      for (int i = 0; i < size; ++i) r.set(i, y[i]);
    }
    return r;
  }
  static KF_DEVICE Pack128 fill(float v) {
    if constexpr (size == 4) return from({v, v, v, v});
    else return from({v, v, v, v, v, v, v, v});
  }
  static KF_DEVICE Pack128 words(u32 x) {
    if constexpr (kWords) {
      return Pack128{{x, x, x, x}};
    } else {
      Pack128 r;
#pragma unroll
      for (int i = 0; i < 4; ++i) r.word(i) = x;
      return r;
    }
  }
};

template <typename T> KF_DEVICE Pack128<T> load128(const T* p) {
  Pack128<T> r;
  *reinterpret_cast<int4*>(&r) = *reinterpret_cast<const int4*>(p);
  return r;
}
// Streaming (evict-first) load for data read exactly once.
template <typename T> KF_DEVICE Pack128<T> load128cs(const T* p) {
  Pack128<T> r;
  *reinterpret_cast<int4*>(&r) = __ldcs(reinterpret_cast<const int4*>(p));
  return r;
}
template <typename T> KF_DEVICE void store128(T* p, const Pack128<T>& x) {
  *reinterpret_cast<int4*>(p) = *reinterpret_cast<const int4*>(&x);
}
// Streaming store for outputs no later kernel of this op re-reads soon.
template <typename T> KF_DEVICE void store128cs(T* p, const Pack128<T>& x) {
  __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&x));
}

// A pack's elements as floats, and floats back to a pack; 16-bit types by 32-bit word (bf16: a
// shift or a mask per element, no byte permutes; two results per cvt).
template <typename T>
KF_DEVICE void unpack128(const Pack128<T>& p, float (&f)[Pack128<T>::size]) {
  if constexpr (sizeof(T) == 2) {
    const u32* w = reinterpret_cast<const u32*>(&p);
#pragma unroll
    for (int j = 0; j < Pack128<T>::size / 2; ++j) {
      T lo, hi;
      lo.bits = (u16)(w[j] & 0xffffu);
      hi.bits = (u16)(w[j] >> 16);
      f[2 * j] = to_float(lo);
      f[2 * j + 1] = to_float(hi);
    }
  } else {
#pragma unroll
    for (int i = 0; i < Pack128<T>::size; ++i) f[i] = p.f(i);
  }
}
template <>
KF_DEVICE void unpack128<bf16>(const Pack128<bf16>& p, float (&f)[8]) {
  const u32* w = reinterpret_cast<const u32*>(&p);
#pragma unroll
  for (int j = 0; j < 4; ++j) Word<bf16>::unpack(w[j], &f[2 * j]);
}
template <typename T>
KF_DEVICE Pack128<T> pack128(const float (&f)[Pack128<T>::size]) {
  return Pack128<T>::from(f);
}

// ---- one-element unit -----------------------------------------------------------------------------
// Elem1<T> is one element (misaligned rows, or a row length that is not a multiple of the unit), with
// Pack128's size, f(i), from(y) and fill(v). Unit<T, VEC> picks a row kernel's unit: a 16-byte one
// held as words, or one element.
template <typename T>
struct Elem1 {
  static constexpr int size = 1;
  T v;
  KF_DEVICE float f(int) const { return to_float(v); }
  static KF_DEVICE Elem1 from(const float (&y)[1]) { return Elem1{from_float<T>(y[0])}; }
  static KF_DEVICE Elem1 fill(float v) { return Elem1{from_float<T>(v)}; }
};
template <bool VEC, typename T> struct UnitOf { using type = Elem1<T>; };
template <typename T> struct UnitOf<true, T> { using type = Pack128<T, Held::words>; };
template <typename T, bool VEC> using Unit = typename UnitOf<VEC, T>::type;

template <typename T, Held H> KF_DEVICE void set_words(Pack128<T, H>& r, int4 v) {
  r.word(0) = (u32)v.x, r.word(1) = (u32)v.y, r.word(2) = (u32)v.z, r.word(3) = (u32)v.w;
}
template <typename T, Held H> KF_DEVICE int4 int4_of(const Pack128<T, H>& r) {
  return make_int4((int)r.word(0), (int)r.word(1), (int)r.word(2), (int)r.word(3));
}
template <typename T, Held H> KF_DEVICE void load_unit(Pack128<T, H>& r, const T* p) {
  set_words(r, *reinterpret_cast<const int4*>(p));
}
template <typename T> KF_DEVICE void load_unit(Elem1<T>& r, const T* p) { r.v = *p; }
// Last read of data that is not needed again soon (evict-first for the 16-byte unit).
template <typename T, Held H> KF_DEVICE void load_unit_last(Pack128<T, H>& r, const T* p) {
  set_words(r, __ldcs(reinterpret_cast<const int4*>(p)));
}
template <typename T> KF_DEVICE void load_unit_last(Elem1<T>& r, const T* p) { r.v = *p; }
template <typename T, Held H> KF_DEVICE void store_unit(T* p, const Pack128<T, H>& r) {
  *reinterpret_cast<int4*>(p) = int4_of(r);
}
template <typename T> KF_DEVICE void store_unit(T* p, const Elem1<T>& r) { *p = r.v; }
// The same, marked evict-first (not read again by this kernel).
template <typename T, Held H> KF_DEVICE void store_unit_last(T* p, const Pack128<T, H>& r) {
  __stcs(reinterpret_cast<int4*>(p), int4_of(r));
}

// ---- opaque zeros ---------------------------------------------------------------------------------
// A value that is 0 at run time but unknown to the compiler: `zero`, a kernel argument the launcher
// passes as 0, or kf_opaque_zero() (0 in every thread, but not known to be the same in all of them,
// so values loaded with it stay in per-thread registers rather than moving to uniform registers
// right after their loads, which made later loads wait for them).
// opaque(unit, zero) xors a unit's bits with it: the compiler must forget what the unit holds, so fp32
// values converted from it before are converted again after instead of being kept live across the
// reductions in between (twice the registers of packed 16-bit units), nor hoisted out of a row loop.
// An empty asm is not enough: ptxas sees through it. after(v, zero) is `zero` made to depend on v: an
// opaque() with it cannot be scheduled before v is known (e.g. before a warp reduction finishes).
KF_DEVICE long long kf_opaque_zero() { return threadIdx.x >= blockDim.x; }
template <typename T, Held H> KF_DEVICE void opaque(Pack128<T, H>& r, u32 zero) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm("xor.b32 %0, %0, %1;" : "+r"(r.word(i)) : "r"(zero));
}
KF_DEVICE void opaque(Elem1<float>& r, u32 zero) {
  u32 b = __float_as_uint(r.v);
  asm("xor.b32 %0, %0, %1;" : "+r"(b) : "r"(zero));
  r.v = __uint_as_float(b);
}
KF_DEVICE void opaque(Elem1<bf16>& r, u32 zero) {
  asm("xor.b16 %0, %0, %1;" : "+h"(r.v.bits) : "h"((u16)zero));
}
KF_DEVICE void opaque(Elem1<half>& r, u32 zero) {
  asm("xor.b16 %0, %0, %1;" : "+h"(r.v.bits) : "h"((u16)zero));
}
KF_DEVICE u32 after(float v, u32 zero) { return __float_as_uint(v) & zero; }

// ---- rows around 16-byte boundaries ----------------------------------------------------------------
// A row of n elements starting anywhere (C = 50257 rows do not start 16-byte aligned): `head` leading
// scalars up to the first 16-byte boundary, `npk` whole packs, `tail` trailing scalars. With vec = 0
// (rows whose pointers do not share an alignment) there is no head: packs are then moved element-wise.
template <typename I> struct RowSplit {
  I head, npk, tail;
};
template <typename T, typename I>
KF_DEVICE RowSplit<I> split_row(const T* row, I n, int vec = 1) {
  constexpr int V = Pack128<T>::size;
  RowSplit<I> s;
  s.head = 0;
  if (vec) {
    const int mis = (int)((reinterpret_cast<u64>(row) & 15) / sizeof(T));
    s.head = min(n, (I)((V - mis) % V));
  }
  s.npk = (n - s.head) / V;
  s.tail = n - s.head - s.npk * V;
  return s;
}

// ---- named barriers -------------------------------------------------------------------------------
// Barrier `id` (1..15; 0 is __syncthreads) of `threads` threads (a multiple of 32): groups of warps
// of one block (a row's threads) synchronise among themselves while the block's other groups run on.
KF_DEVICE void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- shared memory and cp.async (sm_80+) ------------------------------------------------------------
// Rings of row slots in shared memory filled by cp.async: each thread copies exactly the chunks it
// later reads itself, so its own cp.async.wait_group is all the synchronisation a ring needs.
KF_DEVICE u32 smem_u32(const void* p) {  // shared-memory address of a generic pointer
  u32 s;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(p));
  return s;
}
// 16 bytes, bypassing L1 (.cg). cp_async16_after: `after`, an unused operand, orders the copy after
// the instructions computing it (the reads of the slot it overwrites).
KF_DEVICE void cp_async16(u32 saddr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(saddr), "l"(gmem) : "memory");
}
KF_DEVICE void cp_async16_after(u32 saddr, const void* gmem, float after) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(saddr), "l"(gmem), "f"(after)
               : "memory");
}
KF_DEVICE void cp_async4(u32 saddr, const void* gmem) {  // 4 bytes (through L1: .ca)
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(saddr), "l"(gmem) : "memory");
}
KF_DEVICE void cp_async8(u32 saddr, const void* gmem) {  // 8 bytes (.ca: .cg takes 16 only)
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(saddr), "l"(gmem) : "memory");
}
KF_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> KF_DEVICE void cp_async_wait() {  // at most N of this thread's groups pending
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
KF_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// Shared-memory accesses by address (volatile: ordered against the cp.async waits).
template <typename T> KF_DEVICE Pack128<T, Held::words> lds16(u32 a) {
  Pack128<T, Held::words> c;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(c.word(0)), "=r"(c.word(1)), "=r"(c.word(2)), "=r"(c.word(3))
               : "r"(a)
               : "memory");
  return c;
}
KF_DEVICE void lds8(u32 a, u32& w0, u32& w1) {
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(w0), "=r"(w1) : "r"(a) : "memory");
}
KF_DEVICE void sts8_zero(u32 a) {
  asm volatile("st.shared.v2.u32 [%0], {%1, %1};" ::"r"(a), "r"(0u) : "memory");
}
KF_DEVICE void sts16_zero(u32 a) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(a), "r"(0u) : "memory");
}
KF_DEVICE float lds_f32(u32 a) {
  float f;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(f) : "r"(a) : "memory");
  return f;
}
KF_DEVICE void sts_f32(u32 a, float f) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(a), "f"(f) : "memory");
}

// ---- reductions ---------------------------------------------------------------------------------
KF_DEVICE float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
KF_DEVICE float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Block-wide reduction; every thread gets the result. `scratch` holds >= 32 floats of shared memory.
// blockDim.x must be a multiple of 32. Safe to call repeatedly with the same scratch.
template <bool IsMax>
KF_DEVICE float block_reduce(float x, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  x = IsMax ? warp_max(x) : warp_sum(x);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float init = IsMax ? -KF_INF : 0.0f;
  x = lane < nwarps ? scratch[lane] : init;
  return IsMax ? warp_max(x) : warp_sum(x);
}
KF_DEVICE float block_sum(float x, float* scratch) { return block_reduce<false>(x, scratch); }
KF_DEVICE float block_max(float x, float* scratch) { return block_reduce<true>(x, scratch); }


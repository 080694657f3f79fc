// The vector kernels of a row's call (AVX2, and AVX-512 F + VL; x86-64 with
// GCC or Clang only) and the run-time choice among them: each kernel is
// compiled for its instruction set alone (target attributes), so a generic
// build has them all, and Simd picks per CPU (ASCEND_OFFLOAD_NATIVE_SIMD=0
// forces scalar, =2 caps at AVX2).  Every kernel does the vectorisable prefix
// of one step and leaves the tail to the scalar loop of its caller
// (residency_row.h, residency_lru.h, residency_arc.h); all paths give
// identical results.
//
// Included only by residency.cpp, directly or through another residency_*.h:
// one translation unit, compiled as one file; everything here is in an
// anonymous namespace, like the rest of its internals.
#pragma once

#include "residency_table.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define AO_X86_AVX2 1
#endif

namespace {

#ifdef AO_X86_AVX2
// Left-pack table: for an 8-bit lane mask, the indices of its set lanes first.
struct PackTable {
  alignas(32) int32_t idx[256][8];
  PackTable() {
    for (int m = 0; m < 256; ++m) {
      int n = 0;
      for (int b = 0; b < 8; ++b)
        if ((m >> b) & 1) idx[m][n++] = b;
      for (; n < 8; ++n) idx[m][n] = 0;
    }
  }
};
const PackTable kPack;

// AVX2 when the CPU has it, unless ASCEND_OFFLOAD_NATIVE_SIMD=0 (tests compare
// the paths; also an escape hatch should a vector path ever misbehave).
bool use_avx2() {
  static const bool ok = [] {
    const char* env = std::getenv("ASCEND_OFFLOAD_NATIVE_SIMD");
    return __builtin_cpu_supports("avx2") && !(env && env[0] == '0');
  }();
  return ok;
}

__attribute__((target("avx2"))) inline __m256i pack_idx(uint32_t m) {
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(kPack.idx[m]));
}

// Scan of the live entries [0, n): hits are listed (packed entries); entries
// at or beyond `stable` are freed; the rest are kept, compacted in place.
// `bits` is the top-k membership bitmap, `wmax` its last word.  Returns the
// kept count; *j_out is where the scalar tail starts.
__attribute__((target("avx2"))) int32_t scan_avx2(
    uint32_t* ent, int32_t n, int32_t slot_bits, uint32_t slot_mask, const uint32_t* bits,
    int32_t wmax, int32_t stable, uint32_t* hit_e, int32_t* nh_out, Row& r,
    int32_t* j_out) {
  const __m256i vmask = _mm256_set1_epi32(int32_t(slot_mask)), v31 = _mm256_set1_epi32(31);
  const __m256i one = _mm256_set1_epi32(1);
  const __m128i vsb = _mm_cvtsi32_si128(slot_bits);
  const __m256i vstable1 = _mm256_set1_epi32(stable - 1), vmax = _mm256_set1_epi32(wmax);
  const int* words = reinterpret_cast<const int*>(bits);
  int32_t nk = 0, nh = 0, j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ent + j));
    const __m256i p = _mm256_srl_epi32(e, vsb);
    const __m256i s = _mm256_and_si256(e, vmask);
    // Eight scalar loads, not vpgatherdd: measured ~8 % faster on Zen 3.
    alignas(32) int32_t pw[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(pw), _mm256_min_epi32(_mm256_srli_epi32(p, 5), vmax));
    const __m256i w = _mm256_setr_epi32(words[pw[0]], words[pw[1]], words[pw[2]], words[pw[3]],
                                        words[pw[4]], words[pw[5]], words[pw[6]], words[pw[7]]);
    const __m256i in = _mm256_and_si256(_mm256_srlv_epi32(w, _mm256_and_si256(p, v31)), one);
    const __m256i spec = _mm256_cmpgt_epi32(p, vstable1);
    const __m256i touched = _mm256_cmpeq_epi32(in, one);
    const uint32_t sm = uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(spec)));
    const uint32_t tm = uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(touched)));
    const uint32_t hm = tm & ~sm, km = ~(tm | sm) & 0xFFu;
    const __m256i hp = pack_idx(hm);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hit_e + nh), _mm256_permutevar8x32_epi32(e, hp));
    nh += __builtin_popcount(hm);
    if (__builtin_expect(sm != 0, 0)) {
      alignas(32) int32_t ss[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(ss), s);
      for (uint32_t b = sm; b; b &= b - 1) give_free(r, ss[__builtin_ctz(b)]);
    }
    const __m256i kp = pack_idx(km);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ent + nk), _mm256_permutevar8x32_epi32(e, kp));
    nk += __builtin_popcount(km);
  }
  *nh_out = nh;
  *j_out = j;
  return nk;
}

// Indices i with valid top-k and no output yet (-1: first-occurrence misses;
// duplicates carry -2).
__attribute__((target("avx2"))) int32_t unresolved_avx2(const int32_t* topk, const int32_t* out,
                                                        int32_t K, int32_t* idx, int32_t* i_out) {
  const __m256i neg1 = _mm256_set1_epi32(-1), iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int32_t m = 0, i = 0;
  for (; i + 8 <= K; i += 8) {
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(topk + i));
    const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + i));
    const __m256i want = _mm256_and_si256(_mm256_cmpeq_epi32(o, neg1), _mm256_cmpgt_epi32(p, neg1));
    const uint32_t wm = uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(want)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx + m),
                        _mm256_permutevar8x32_epi32(_mm256_add_epi32(iota, _mm256_set1_epi32(i)), pack_idx(wm)));
    m += __builtin_popcount(wm);
  }
  *i_out = i;
  return m;
}

// Append the hits (out >= 0 before misses are written: first occurrences
// only) in top-k order as packed entries at ent + n.
__attribute__((target("avx2"))) int32_t append_hits_avx2(const int32_t* topk, const int32_t* out,
                                                         int32_t K, int32_t base, int32_t slot_bits,
                                                         uint32_t* ent, int32_t n, int32_t* i_out) {
  const __m256i neg1 = _mm256_set1_epi32(-1), vbase = _mm256_set1_epi32(base);
  const __m128i vsb = _mm_cvtsi32_si128(slot_bits);
  int32_t i = 0;
  for (; i + 8 <= K; i += 8) {
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(topk + i));
    const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + i));
    const uint32_t hm = uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(o, neg1))));
    const __m256i perm = pack_idx(hm);
    const __m256i e = _mm256_or_si256(_mm256_sll_epi32(p, vsb), _mm256_sub_epi32(o, vbase));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ent + n), _mm256_permutevar8x32_epi32(e, perm));
    n += __builtin_popcount(hm);
  }
  *i_out = i;
  return n;
}

// AVX-512 (F + VL): 16 lanes, a hardware gather of the membership words and
// register compresses instead of the left-pack table.  Measured on Zen 4 in an
// alternating A/B on the bench trace (ABI 5 layout): 0.96-0.98x the AVX2 time;
// with the ABI 6 bitmap the scan waits on vpgatherdd (~14 cycles a gather).  A
// compress straight to memory is avoided: it is microcoded and slow on Zen 4.
bool use_avx512() {
  static const bool ok = [] {
    const char* env = std::getenv("ASCEND_OFFLOAD_NATIVE_SIMD");
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           !(env && (env[0] == '0' || env[0] == '2'));
  }();
  return ok;
}

__attribute__((target("avx512f,avx512vl"))) int32_t scan_avx512(
    uint32_t* ent, int32_t n, int32_t slot_bits, uint32_t slot_mask, const uint32_t* bits,
    int32_t wmax, int32_t stable, uint32_t* hit_e, int32_t* nh_out, Row& r,
    int32_t* j_out) {
  const __m512i vmask = _mm512_set1_epi32(int32_t(slot_mask)), v31 = _mm512_set1_epi32(31);
  const __m512i one = _mm512_set1_epi32(1);
  const __m128i vsb = _mm_cvtsi32_si128(slot_bits);
  const __m512i vstable1 = _mm512_set1_epi32(stable - 1), vmax = _mm512_set1_epi32(wmax);
  int32_t nk = 0, nh = 0, j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512i e = _mm512_loadu_si512(ent + j);
    const __m512i p = _mm512_srl_epi32(e, vsb);
    const __m512i s = _mm512_and_si512(e, vmask);
    const __m512i w = _mm512_i32gather_epi32(_mm512_min_epi32(_mm512_srli_epi32(p, 5), vmax), bits, 4);
    const __mmask16 sm = _mm512_cmpgt_epi32_mask(p, vstable1);
    const __mmask16 tm = _mm512_test_epi32_mask(_mm512_srlv_epi32(w, _mm512_and_si512(p, v31)), one);
    const __mmask16 hm = tm & ~sm, km = ~(tm | sm);
    _mm512_storeu_si512(hit_e + nh, _mm512_maskz_compress_epi32(hm, e));
    nh += __builtin_popcount(hm);
    if (__builtin_expect(sm != 0, 0)) {
      alignas(64) int32_t ss[16];
      _mm512_store_si512(ss, s);
      for (uint32_t b = sm; b; b &= b - 1) give_free(r, ss[__builtin_ctz(b)]);
    }
    _mm512_storeu_si512(ent + nk, _mm512_maskz_compress_epi32(km, e));
    nk += __builtin_popcount(km);
  }
  *nh_out = nh;
  *j_out = j;
  return nk;
}

__attribute__((target("avx512f,avx512vl"))) int32_t unresolved_avx512(
    const int32_t* topk, const int32_t* out, int32_t K, int32_t* idx, int32_t* i_out) {
  const __m512i neg1 = _mm512_set1_epi32(-1);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int32_t m = 0, i = 0;
  for (; i + 16 <= K; i += 16) {
    const __m512i p = _mm512_loadu_si512(topk + i);
    const __m512i o = _mm512_loadu_si512(out + i);
    const __mmask16 wm = _mm512_cmpeq_epi32_mask(o, neg1) & _mm512_cmpgt_epi32_mask(p, neg1);
    _mm512_storeu_si512(idx + m, _mm512_maskz_compress_epi32(wm, _mm512_add_epi32(iota, _mm512_set1_epi32(i))));
    m += __builtin_popcount(wm);
  }
  *i_out = i;
  return m;
}

// The distinct misses' descriptors, 16 at a time (power-of-two block sizes):
// host row through the block table, destination slot, the new LRU entry; the
// outputs are written by a scalar loop (a scatter is slower here).  ~1.5-4 %
// of a batch-1 call against the scalar loop (C driver, same trace).  Returns
// how many it did; the scalar loop does the tail.
__attribute__((target("avx512f,avx512vl"))) int32_t misses_avx512(
    const int32_t* miss_i, const int32_t* topk, const int32_t* dest, int32_t nd, int32_t base,
    int32_t slot_bits, int32_t shift, const int32_t* bt, int32_t* out, int32_t* msrc, int32_t* mdst,
    uint32_t* ent) {
  const __m512i vbase = _mm512_set1_epi32(base), low = _mm512_set1_epi32((1 << shift) - 1);
  const __m128i vsb = _mm_cvtsi32_si128(slot_bits), vsh = _mm_cvtsi32_si128(shift);
  int32_t k = 0;
  for (; k + 16 <= nd; k += 16) {
    const __m512i iv = _mm512_loadu_si512(miss_i + k);
    const __m512i p = _mm512_i32gather_epi32(iv, topk, 4);
    const __m512i sv = _mm512_loadu_si512(dest + k);
    const __m512i slot = _mm512_add_epi32(sv, vbase);
    const __m512i blk = _mm512_i32gather_epi32(_mm512_srl_epi32(p, vsh), bt, 4);
    _mm512_storeu_si512(msrc + k, _mm512_or_si512(_mm512_sll_epi32(blk, vsh), _mm512_and_si512(p, low)));
    _mm512_storeu_si512(mdst + k, slot);
    _mm512_storeu_si512(ent + k, _mm512_or_si512(_mm512_sll_epi32(p, vsb), sv));
  }
  for (int32_t q = 0; q < k; ++q) out[miss_i[q]] = mdst[q];
  return k;
}

__attribute__((target("avx512f,avx512vl"))) int32_t append_hits_avx512(
    const int32_t* topk, const int32_t* out, int32_t K, int32_t base, int32_t slot_bits,
    uint32_t* ent, int32_t n, int32_t* i_out) {
  const __m512i neg1 = _mm512_set1_epi32(-1), vbase = _mm512_set1_epi32(base);
  const __m128i vsb = _mm_cvtsi32_si128(slot_bits);
  int32_t i = 0;
  for (; i + 16 <= K; i += 16) {
    const __m512i p = _mm512_loadu_si512(topk + i);
    const __m512i o = _mm512_loadu_si512(out + i);
    const __mmask16 hm = _mm512_cmpgt_epi32_mask(o, neg1);
    const __m512i e = _mm512_or_si512(_mm512_sll_epi32(p, vsb), _mm512_sub_epi32(o, vbase));
    _mm512_storeu_si512(ent + n, _mm512_maskz_compress_epi32(hm, e));
    n += __builtin_popcount(hm);
  }
  *i_out = i;
  return n;
}

// ARC's ghost lists (positions): ghosts at or beyond `stable` are dropped, those
// in the top-k are listed at hit_p, the rest kept, compacted in place; returns
// the kept count, *nh_out the listed ones, *j_out where the scalar tail starts.
// 3-4x faster than the scalar loop (a ghost list is up to H entries a call).
__attribute__((target("avx512f,avx512vl"))) int32_t ghosts_avx512(
    uint32_t* g, int32_t n, const uint32_t* bits, int32_t wmax, int32_t stable, uint32_t* hit_p,
    int32_t* nh_out, int32_t* j_out) {
  const __m512i v31 = _mm512_set1_epi32(31), one = _mm512_set1_epi32(1);
  const __m512i vstable = _mm512_set1_epi32(stable), vmax = _mm512_set1_epi32(wmax);
  int32_t nk = 0, nh = 0, j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512i q = _mm512_loadu_si512(g + j);
    const __m512i w = _mm512_i32gather_epi32(_mm512_min_epi32(_mm512_srli_epi32(q, 5), vmax), bits, 4);
    const __mmask16 live = _mm512_cmplt_epi32_mask(q, vstable);
    const __mmask16 in = _mm512_test_epi32_mask(_mm512_srlv_epi32(w, _mm512_and_si512(q, v31)), one);
    const __mmask16 hm = live & in, km = live & ~in;
    _mm512_storeu_si512(hit_p + nh, _mm512_maskz_compress_epi32(hm, q));
    nh += __builtin_popcount(hm);
    _mm512_storeu_si512(g + nk, _mm512_maskz_compress_epi32(km, q));
    nk += __builtin_popcount(km);
  }
  *nh_out = nh;
  *j_out = j;
  return nk;
}

// ARC's misses, 16 at a time (power-of-two block sizes): descriptors in top-k
// order as misses_avx512, the new entries of fresh misses to t1 and of ghost
// misses (output -3) to t2.  *m1 / *m2 advance; returns how many it did.
__attribute__((target("avx512f,avx512vl"))) int32_t misses_arc_avx512(
    const int32_t* miss_i, const int32_t* topk, const int32_t* dest, int32_t nd, int32_t base,
    int32_t slot_bits, int32_t shift, const int32_t* bt, int32_t* out, int32_t* msrc, int32_t* mdst,
    uint32_t* t1, int32_t* m1, uint32_t* t2, int32_t* m2) {
  const __m512i vbase = _mm512_set1_epi32(base), low = _mm512_set1_epi32((1 << shift) - 1);
  const __m512i neg3 = _mm512_set1_epi32(-3);
  const __m128i vsb = _mm_cvtsi32_si128(slot_bits), vsh = _mm_cvtsi32_si128(shift);
  int32_t k = 0, n1 = *m1, n2 = *m2;
  for (; k + 16 <= nd; k += 16) {
    const __m512i iv = _mm512_loadu_si512(miss_i + k);
    const __m512i p = _mm512_i32gather_epi32(iv, topk, 4);
    const __mmask16 gm = _mm512_cmpeq_epi32_mask(_mm512_i32gather_epi32(iv, out, 4), neg3);
    const __m512i sv = _mm512_loadu_si512(dest + k);
    const __m512i blk = _mm512_i32gather_epi32(_mm512_srl_epi32(p, vsh), bt, 4);
    _mm512_storeu_si512(msrc + k, _mm512_or_si512(_mm512_sll_epi32(blk, vsh), _mm512_and_si512(p, low)));
    _mm512_storeu_si512(mdst + k, _mm512_add_epi32(sv, vbase));
    const __m512i e = _mm512_or_si512(_mm512_sll_epi32(p, vsb), sv);
    _mm512_storeu_si512(t1 + n1, _mm512_maskz_compress_epi32(__mmask16(~gm), e));
    n1 += 16 - __builtin_popcount(gm);
    _mm512_storeu_si512(t2 + n2, _mm512_maskz_compress_epi32(gm, e));
    n2 += __builtin_popcount(gm);
  }
  for (int32_t q = 0; q < k; ++q) out[miss_i[q]] = mdst[q];
  *m1 = n1;
  *m2 = n2;
  return k;
}

// ghosts_avx512 with 8 lanes, scalar word loads and the left-pack table.
__attribute__((target("avx2"))) int32_t ghosts_avx2(
    uint32_t* g, int32_t n, const uint32_t* bits, int32_t wmax, int32_t stable, uint32_t* hit_p,
    int32_t* nh_out, int32_t* j_out) {
  const __m256i v31 = _mm256_set1_epi32(31), one = _mm256_set1_epi32(1);
  const __m256i vstable1 = _mm256_set1_epi32(stable - 1);
  const int* words = reinterpret_cast<const int*>(bits);
  int32_t nk = 0, nh = 0, j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + j));
    alignas(32) int32_t qs[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(qs), q);
    const __m256i w = _mm256_setr_epi32(
        words[std::min(qs[0] >> 5, wmax)], words[std::min(qs[1] >> 5, wmax)],
        words[std::min(qs[2] >> 5, wmax)], words[std::min(qs[3] >> 5, wmax)],
        words[std::min(qs[4] >> 5, wmax)], words[std::min(qs[5] >> 5, wmax)],
        words[std::min(qs[6] >> 5, wmax)], words[std::min(qs[7] >> 5, wmax)]);
    const __m256i in = _mm256_and_si256(_mm256_srlv_epi32(w, _mm256_and_si256(q, v31)), one);
    const uint32_t sm = uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(q, vstable1))));
    const uint32_t tm = uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(in, one))));
    const uint32_t hm = tm & ~sm, km = ~(tm | sm) & 0xFFu;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hit_p + nh), _mm256_permutevar8x32_epi32(q, pack_idx(hm)));
    nh += __builtin_popcount(hm);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(g + nk), _mm256_permutevar8x32_epi32(q, pack_idx(km)));
    nk += __builtin_popcount(km);
  }
  *nh_out = nh;
  *j_out = j;
  return nk;
}
#endif

// Which vector paths a call takes (the CPU checks are cached statics).
struct Simd {
  bool avx512 = false, avx2 = false;
  Simd() {
#ifdef AO_X86_AVX2
    avx512 = use_avx512();
    avx2 = !avx512 && use_avx2();
#endif
  }
};

}  // namespace

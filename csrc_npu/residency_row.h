// One row's call, the steps both policies share (RowCall): mark the top-k in
// the membership bitmap, scan live entries for hits, list the misses, append
// hits in top-k order, resolve duplicates and clear the bitmap.  Each step
// takes the vector path Simd chose and finishes with a scalar loop.
//
// Included only by residency.cpp, directly or through another residency_*.h:
// one translation unit, compiled as one file; everything here is in an
// anonymous namespace, like the rest of its internals.
#pragma once

#include "residency_simd.h"
#include "residency_table.h"

namespace {

// Leaves the membership bits clear for the next call: a 4 KiB memset at 32k
// tokens, or one store per top-k position once the bitmap is larger (every
// set bit belongs to a top-k position, so whole words may go).
void clear_bits(uint32_t* bits, int32_t wmax, const int32_t* topk, int32_t K) {
  if (wmax < K) {
    std::memset(bits, 0, size_t(wmax + 1) * sizeof(uint32_t));
    return;
  }
  for (int32_t i = 0; i < K; ++i) {
    if (topk[i] >= 0) bits[topk[i] >> 5] = 0;
  }
}

// The steps both policies share; each is one pass over the top-k or the live
// entries, always inlined so the LRU call compiles as one function (as before).
struct RowCall {
  const RowArgs& a;
  Scratch& sc;
  Simd simd;
  const int32_t K, base, stable, wmax, sb;
  const uint32_t smask;
  uint32_t* __restrict bits;
  uint16_t* __restrict first;
  int32_t valid = 0, ndup = 0;
  RowCall(const Table& t, const RowArgs& args, Scratch& scratch)
      : a(args), sc((scratch.fit(args.K, args.len), scratch)), K(args.K), base(args.base),
        stable(args.stable), wmax(args.len / 32), sb(t.slot_bits), smask(t.slot_mask),
        bits(scratch.bits.data()), first(scratch.first.data()) {}

  // 1: set the membership bit of every top-k position and note its first
  // index; outputs start unresolved (-1).  A position whose bit is already
  // set is a later duplicate: its output becomes -2 (resolved last, from its
  // first occurrence), so no later pass has to tell first occurrences from
  // duplicates.  `first` is only written (no read): the store buffer hides
  // its L2 misses (a write prefetch 24 positions ahead made the call ~10 %
  // slower; the loop is bound by its instructions, so the -1 fill is a
  // separate vector pass: ~2 % faster).
  __attribute__((always_inline)) inline void mark() {
    const int32_t* __restrict topk = a.topk;
    int32_t* __restrict out = a.out;
    int32_t* __restrict dup_i = sc.dup_i.data();
    std::fill(out, out + K, -1);
    for (int32_t i = 0; i < K; ++i) {
      const int32_t p = topk[i];
      if (p < 0) continue;
      ++valid;
      const uint32_t bit = uint32_t(1) << (p & 31);
      if (__builtin_expect((bits[p >> 5] & bit) != 0, 0)) {
        out[i] = -2;
        dup_i[ndup++] = i;
        continue;
      }
      bits[p >> 5] |= bit;
      first[p] = uint16_t(i);
    }
  }

  // 2: one pass over live entries ent[0, n): hits are listed at hit_e[nh...],
  // speculative entries are freed, the rest stay (compacted in place).
  // Returns the kept count.
  __attribute__((always_inline)) inline int32_t scan(Row& r, uint32_t* __restrict ent, int32_t n,
                                                     int32_t* nh_io) {
    uint32_t* __restrict hit_e = sc.hit_e.data() + *nh_io;
    int32_t nk = 0, j = 0, nh = 0;
#ifdef AO_X86_AVX2
    if (simd.avx512) nk = scan_avx512(ent, n, sb, smask, bits, wmax, stable, hit_e, &nh, r, &j);
    if (simd.avx2) nk = scan_avx2(ent, n, sb, smask, bits, wmax, stable, hit_e, &nh, r, &j);
#endif
    // Scalar path (aarch64, the tail, ASCEND_OFFLOAD_NATIVE_SIMD=0): branch-free
    // on hit / keep, which is a coin toss per entry (a branch mispredicts a third
    // of the time); both candidate slots are written and the counters decide.
    for (; j < n; ++j) {
      const uint32_t e = ent[j];
      const int32_t p = int32_t(e >> sb);
      const int32_t s = int32_t(e & smask);
      if (p >= stable) {
        give_free(r, s);
        continue;
      }
      const int32_t hit = int32_t((bits[p >> 5] >> (p & 31)) & 1u);
      hit_e[nh] = e;
      nh += hit;
      ent[nk] = e;
      nk += 1 - hit;
    }
    *nh_io += nh;
    return nk;
  }

  // The hits' outputs (first occurrences), from the entries the scans listed.
  __attribute__((always_inline)) inline void hit_outputs(int32_t nh) {
    const uint32_t* __restrict hit_e = sc.hit_e.data();
    const uint16_t* __restrict fst = first;
    int32_t* __restrict out = a.out;
    const int32_t b = base, shift = sb;
    const uint32_t mask = smask;
    for (int32_t k = 0; k < nh; ++k) {
      const uint32_t e = hit_e[k];
      out[fst[e >> shift]] = b + int32_t(e & mask);
    }
  }

  // 3: the distinct misses: valid first occurrences still unresolved (-1).
  __attribute__((always_inline)) inline int32_t misses() {
    const int32_t* __restrict topk = a.topk;
    const int32_t* __restrict out = a.out;
    int32_t* __restrict miss_i = sc.miss_i.data();
    int32_t nd = 0, i0 = 0;
#ifdef AO_X86_AVX2
    if (simd.avx512) nd = unresolved_avx512(topk, out, K, miss_i, &i0);
    if (simd.avx2) nd = unresolved_avx2(topk, out, K, miss_i, &i0);
#endif
    for (int32_t i = i0; i < K; ++i) {
      miss_i[nd] = i;
      nd += int32_t((topk[i] >= 0) & (out[i] == -1));
    }
    return nd;
  }

  // The hits (outputs >= 0 before the misses are written: first occurrences
  // only) in top-k order as packed entries at ent[n...].  Returns the new n.
  __attribute__((always_inline)) inline int32_t append_hits(uint32_t* __restrict ent, int32_t n) {
    const int32_t* __restrict topk = a.topk;
    const int32_t* __restrict out = a.out;
    int32_t i0 = 0;
#ifdef AO_X86_AVX2
    if (simd.avx512) n = append_hits_avx512(topk, out, K, base, sb, ent, n, &i0);
    if (simd.avx2) n = append_hits_avx2(topk, out, K, base, sb, ent, n, &i0);
#endif
    for (int32_t i = i0; i < K; ++i) {  // branch-free, as in the scan
      ent[n] = (uint32_t(topk[i]) << sb) | uint32_t(out[i] - base);
      n += int32_t(out[i] >= 0);
    }
    return n;
  }

  // 6: duplicates share their first occurrence's slot; the bitmap is cleared.
  __attribute__((always_inline)) inline void finish() {
    const int32_t* __restrict dup_i = sc.dup_i.data();
    const int32_t* __restrict topk = a.topk;
    int32_t* __restrict out = a.out;
    for (int32_t d = 0; d < ndup; ++d) {
      const int32_t i = dup_i[d];
      out[i] = out[first[topk[i]]];
    }
    clear_bits(bits, wmax, topk, K);
  }

  void abort() { clear_bits(bits, wmax, a.topk, K); }
};

void begin_row(const Table& t, Row& r, const RowArgs& a) {
  if (!r.active || r.tag != a.tag) {
    reset_row(t, r);
    r.tag = a.tag;
    r.active = true;
  }
}

}  // namespace

// Exact LRU (policy 0, the default) on the shared steps of residency_row.h:
// one packed entry array per row, least recently used first.
//
// Included only by residency.cpp, directly or through another residency_*.h:
// one translation unit, compiled as one file; everything here is in an
// anonymous namespace, like the rest of its internals.
#pragma once

#include "residency_row.h"

namespace {

// Exact LRU.  Returns the number of misses (>= 0) or -error (inputs already
// validated).
int64_t resolve_row(const Table& t, Row& r, const RowArgs& a, Scratch& sc, int32_t* nvalid) {
  begin_row(t, r, a);
  RowCall c(t, a, sc);
  c.mark();
  uint32_t* __restrict ent = r.ent.data();
  int32_t nh = 0;
  const int32_t nk = c.scan(r, ent, r.n, &nh);
  c.hit_outputs(nh);
  const int32_t nd = c.misses();

  // 4: slots for the distinct misses: lowest free slots first, then the
  // least recently used kept entries (never one hit in this call).
  int32_t* __restrict dest = sc.dest.data();
  int32_t nf = 0;
  while (nf < nd && r.free_count > 0) dest[nf++] = take_free(r);
  const int32_t nv = nd - nf;
  if (nv > nk) {
    c.abort();
    return -kErrInternal;
  }
  for (int32_t k = 0; k < nv; ++k) dest[nf + k] = int32_t(ent[k] & c.smask);

  // 5: the new LRU order: surviving kept entries, then hits, then misses.
  int32_t n = nk - nv;
  if (nv > 0 && n > 0) std::memmove(ent, ent + nv, size_t(n) * sizeof(uint32_t));
  n = c.append_hits(ent, n);
  const int32_t* __restrict topk = a.topk;
  const int32_t* __restrict miss_i = sc.miss_i.data();
  int32_t* __restrict out = a.out;
  int32_t* __restrict msrc = a.msrc;
  int32_t* __restrict mdst = a.mdst;
  const int32_t bs = a.block_size, base = a.base, sb = c.sb;
  const int32_t* __restrict bt = a.bt;
  const bool pow2 = (bs & (bs - 1)) == 0;
  const int32_t shift = pow2 ? __builtin_ctz(uint32_t(bs)) : 0;
  int32_t k0 = 0;
#ifdef AO_X86_AVX2
  if (c.simd.avx512 && pow2) k0 = misses_avx512(miss_i, topk, dest, nd, base, sb, shift, bt, out, msrc, mdst, ent + n);
#endif
  for (int32_t k = k0; k < nd; ++k) {
    const int32_t i = miss_i[k];
    const int32_t p = topk[i];
    const int32_t s = dest[k];
    out[i] = base + s;
    msrc[k] = pow2 ? (bt[p >> shift] << shift) | (p & (bs - 1)) : bt[p / bs] * bs + p % bs;
    mdst[k] = base + s;
    ent[n + k] = (uint32_t(p) << sb) | uint32_t(s);
  }
  r.n = n + nd;
  c.finish();
  *nvalid = c.valid;
  return nd;
}

}  // namespace

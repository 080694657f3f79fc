// ARC (policy 1; semantics and why: the top of residency.cpp) on the shared
// steps of residency_row.h: T1 and T2 as packed entry arrays, the ghost lists
// B1 and B2 as positions, and the T1 target p.
//
// Included only by residency.cpp, directly or through another residency_*.h:
// one translation unit, compiled as one file; everything here is in an
// anonymous namespace, like the rest of its internals.
#pragma once

#include "residency_row.h"

namespace {

// One pass over ghost positions g[0, n): those at or beyond `stable` are
// dropped, those in the top-k are ghost misses (their first top-k output is
// set to -3 and they leave the list), the rest stay, compacted in place.
// Returns the kept count; *found gets the ghost misses.  The scalar loop
// branches: unlike the entry scan's hits, ghost misses are rare per ghost.
int32_t scan_ghosts(uint32_t* __restrict g, int32_t n, const RowCall& c, int32_t* found) {
  int32_t nk = 0, nf = 0, j = 0;
  uint32_t* __restrict hit_p = c.sc.hit_e.data();  // free again once the hit outputs are written
#ifdef AO_X86_AVX2
  if (c.simd.avx512) nk = ghosts_avx512(g, n, c.bits, c.wmax, c.stable, hit_p, &nf, &j);
  if (c.simd.avx2) nk = ghosts_avx2(g, n, c.bits, c.wmax, c.stable, hit_p, &nf, &j);
#endif
  for (; j < n; ++j) {
    const uint32_t q = g[j];
    if (__builtin_expect(int64_t(q) >= c.stable, 0)) continue;
    if (__builtin_expect((c.bits[q >> 5] >> (q & 31)) & 1u, 0)) {
      hit_p[nf++] = q;
      continue;
    }
    g[nk++] = q;
  }
  for (int32_t k = 0; k < nf; ++k) c.a.out[c.first[hit_p[k]]] = -3;
  *found = nf;
  return nk;
}

// Appends the positions of entries src[0, e) to ghost list g[0, kept) and
// drops the least recent ghosts beyond `limit`.  Returns the new size.
int32_t push_ghosts(uint32_t* __restrict g, int32_t kept, const uint32_t* __restrict src,
                    int32_t e, int32_t limit, int32_t sb) {
  const int32_t drop = std::max(0, kept + e - std::max(limit, 0));
  int32_t m = 0, from = 0;
  if (drop < kept) {
    if (drop > 0) std::memmove(g, g + drop, size_t(kept - drop) * sizeof(uint32_t));
    m = kept - drop;
  } else {
    from = drop - kept;
  }
  for (int32_t k = from; k < e; ++k) g[m++] = src[k] >> sb;
  return m;
}

// ARC (see the top of residency.cpp).  Same contract as resolve_row; T1 lives in
// ent, T2 in ent2, ghosts in g1 / g2.
int64_t resolve_row_arc(const Table& t, Row& r, const RowArgs& a, Scratch& sc, int32_t* nvalid) {
  begin_row(t, r, a);
  RowCall c(t, a, sc);
  c.mark();
  uint32_t* __restrict t1 = r.ent.data();
  uint32_t* __restrict t2 = r.ent2.data();
  int32_t nh = 0;
  const int32_t k1 = c.scan(r, t1, r.n, &nh);
  const int32_t k2 = c.scan(r, t2, r.n2, &nh);
  c.hit_outputs(nh);
  const int32_t nd = c.misses();
  int32_t gh1 = 0, gh2 = 0;
  const int32_t kb1 = scan_ghosts(r.g1.data(), r.ng1, c, &gh1);
  const int32_t kb2 = scan_ghosts(r.g2.data(), r.ng2, c, &gh2);
  const int64_t b1 = kb1 + gh1, b2 = kb2 + gh2, H = t.H;
  int64_t p = r.p;
  if (gh1 > 0) p += gh1 * std::max<int64_t>(1, b2 / b1);
  if (gh2 > 0) p -= gh2 * std::max<int64_t>(1, b1 / b2);
  r.p = int32_t(std::clamp<int64_t>(p, 0, H));

  int32_t* __restrict dest = sc.dest.data();
  int32_t nf = 0;
  while (nf < nd && r.free_count > 0) dest[nf++] = take_free(r);
  const int32_t nv = nd - nf, fresh = nd - gh1 - gh2;
  if (nv > k1 + k2) {
    c.abort();
    return -kErrInternal;
  }
  const int32_t want1 = std::max(0, k1 + fresh - r.p);
  const int32_t e1 = std::min(k1, std::max(nv - k2, std::min(nv, want1))), e2 = nv - e1;
  const uint32_t smask = c.smask;
  for (int32_t k = 0; k < e1; ++k) dest[nf + k] = int32_t(t1[k] & smask);
  for (int32_t k = 0; k < e2; ++k) dest[nf + e1 + k] = int32_t(t2[k] & smask);
  const int32_t n1 = k1 - e1 + fresh;
  r.ng1 = push_ghosts(r.g1.data(), kb1, t1, e1, t.H - n1, c.sb);
  r.ng2 = push_ghosts(r.g2.data(), kb2, t2, e2, t.H - r.ng1, c.sb);
  int32_t m1 = k1 - e1, m2 = k2 - e2;
  if (e1 > 0 && m1 > 0) std::memmove(t1, t1 + e1, size_t(m1) * sizeof(uint32_t));
  if (e2 > 0 && m2 > 0) std::memmove(t2, t2 + e2, size_t(m2) * sizeof(uint32_t));
  m2 = c.append_hits(t2, m2);

  // Misses in top-k order: descriptors in that order; fresh ones to T1, ghost
  // misses (-3) to T2; both arrays are written, the counters decide.
  const int32_t* __restrict topk = a.topk;
  const int32_t* __restrict miss_i = sc.miss_i.data();
  const int32_t* __restrict bt = a.bt;
  int32_t* __restrict out = a.out;
  int32_t* __restrict msrc = a.msrc;
  int32_t* __restrict mdst = a.mdst;
  const int32_t base = a.base, sb = c.sb, bs = a.block_size;
  const bool pow2 = (bs & (bs - 1)) == 0;
  const int32_t shift = pow2 ? __builtin_ctz(uint32_t(bs)) : 0;
  int32_t k0 = 0;
#ifdef AO_X86_AVX2
  if (c.simd.avx512 && pow2) {
    k0 = misses_arc_avx512(miss_i, topk, dest, nd, base, sb, shift, bt, out, msrc, mdst, t1, &m1,
                           t2, &m2);
  }
#endif
  for (int32_t k = k0; k < nd; ++k) {
    const int32_t i = miss_i[k];
    const int32_t q = topk[i];
    const int32_t s = dest[k];
    const int32_t ghost = int32_t(out[i] == -3);
    out[i] = base + s;
    msrc[k] = pow2 ? (bt[q >> shift] << shift) | (q & (bs - 1)) : bt[q / bs] * bs + q % bs;
    mdst[k] = base + s;
    const uint32_t e = (uint32_t(q) << sb) | uint32_t(s);
    t1[m1] = e;
    t2[m2] = e;
    m1 += 1 - ghost;
    m2 += ghost;
  }
  r.n = m1;
  r.n2 = m2;
  c.finish();
  *nvalid = c.valid;
  return nd;
}

}  // namespace

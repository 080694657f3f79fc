// Hot-buffer residency for sparse decode offload: one table per (layer,
// request row), resolved for a whole batch in one call.  Two replacement
// policies share the layout and the call: exact LRU (policy 0, the default)
// and ARC (policy 1, see "ARC" below).
//
// Plain C++17 with a C ABI (built into the package at install by setup.py,
// loaded by ascend_offload/native.py through ctypes): no torch headers, so one
// build serves every torch / torch_npu version, x86-64 and aarch64 alike.
// AVX-512 and AVX2 paths are compiled per function and chosen at run time
// (ASCEND_OFFLOAD_NATIVE_SIMD=0 forces scalar, =2 caps at AVX2); every path
// gives identical results, and a generic build has them all.
//
// Layout (why): the state of a row is ONE packed array of its live entries in
// LRU order, each entry one uint32 (position << slot_bits | slot: 16 KiB at
// H = 4096), read and rewritten sequentially once per call.  One word per
// entry (ABI 5) instead of int32 + uint16 (ABI 4) halves the bytes the scan
// moves and drops a load, a widening and a pack per 8 entries.  The price is
// a position limit of 2^(32 - slot_bits) tokens (2^20 at H = 4096), checked
// per call (kErrCapacity) and exposed through ao_res_max_positions.  The
// top-k is joined against it through a per-thread membership bitmap indexed
// by position (L1-sized at 32k tokens; see Scratch), which every row and
// layer share and which therefore stays in cache.  An earlier design kept a
// position -> slot map per row (2 bytes per token: 64 KiB at 32k tokens, touched at random)
// plus a recency ring: 3x slower once 61 layers' states no longer fit in the
// caches, which is the normal case (docs/bench-sparse.md).  A call costs
// O(K + H) simple, mostly vectorised steps.
//
// Semantics (the pure-torch twin in residency.py and the test oracle implement
// the same ones and must give identical outputs):
//   * a row whose tag differs from the stored one is reset (new request);
//   * slots holding positions >= stable are freed first (speculative tokens);
//   * every valid position (>= 0) of top-k is a hit if resident; -1 is padding;
//     every occurrence of a position gets its slot;
//   * each distinct position is touched once, at its first occurrence; the
//     touch order of a call is: hits in top-k order, then misses in top-k
//     order (so the call's misses are its most recent entries);
//   * distinct misses, in order of first occurrence, take the lowest free
//     slots first, then evict least-recently-touched slots not hit in this call.
//
// ARC (policy 1; adaptive replacement, Megiddo & Modha, applied per call to a
// batch of demands).  Why: exact LRU ranks a one-off miss above an entry that
// is selected again and again; when the indexer's focus drifts through the
// context over a uniform background, that evicts the focus rows for
// background rows that never return (`bench sparse`, drift trace).
// ARC keeps rows seen once (T1) apart from rows seen again (T2) and sizes T1
// by what evicting recently cost: positions evicted from T1 / T2 are
// remembered, without slots, in ghost lists B1 / B2.  Per call, after the
// steps above up to the misses:
//   * resident entries are T1 then T2, each least recent first (inspect lists
//     them in that order); ghosts at or beyond `stable` are dropped too;
//   * a miss found in B1 or B2 is a ghost miss (taken out of its list); the
//     other misses are fresh.  With b1, b2 the ghost list sizes before that
//     and g1, g2 the ghost misses found in each, the target size of T1 becomes
//     p = clamp(p + g1 * max(1, b2 / b1) - g2 * max(1, b1 / b2), 0, H)
//     (integer division; a term is 0 when its g is 0);
//   * v = victims needed (misses beyond the free slots), k1 / k2 = T1 / T2
//     entries not hit, f = fresh misses:
//     e1 = min(k1, max(v - k2, min(v, max(0, k1 + f - p)))) victims are the
//     least recent of T1, e2 = v - e1 the least recent of T2; misses take the
//     lowest free slots, then the T1 victims' slots, then the T2 victims';
//   * new T1 = kept T1, fresh misses; new T2 = kept T2, hits in top-k order,
//     ghost misses in top-k order (hits from T1 move to T2);
//     B1 += T1 victims, B2 += T2 victims (least recent first);
//   * then the least recent ghosts are dropped until |T1| + |B1| <= H and
//     |B1| + |B2| <= H (ARC's |T1|+|T2|+|B1|+|B2| <= 2H whenever the table is
//     full, which it is whenever anything was evicted);
//   * a new request (tag) starts with p = 0 and no ghosts.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define AO_X86_AVX2 1
#endif

namespace {

constexpr int32_t kAbiVersion = 9;  // 8: the ordered copy queue (copyqueue.cpp); 9: residency
                                    // policies (ao_res_create_policy, ao_res_policy_state)
constexpr int32_t kSpare = 16;  // vector stores write whole groups past a count

// Error codes returned (negated) by ao_res_resolve; err_info gets (row, index).
enum : int64_t {
  kErrPosition = 1,   // top-k entry < -1 or >= len
  kErrLengths = 2,    // stable > len, len < 0, len beyond the block table
  kErrRow = 3,        // row id out of range or repeated in one batch
  kErrInternal = 4,   // invariant broken (not enough evictable slots)
  kErrArgs = 5,       // bad call arguments (layer, K > H, ...)
  kErrCapacity = 6,   // len beyond the positions a packed entry can hold
};

enum Policy : int32_t { kLru = 0, kArc = 1 };

struct Row {
  int64_t tag = 0;
  bool active = false;
  bool allocated = false;
  int32_t n = 0;                    // live entries, LRU first (ARC: T1)
  int32_t free_count = 0;
  int32_t free_hint = 0;            // lowest word of free_bits that may be non-zero
  std::vector<uint32_t> ent;        // H + kSpare: position << slot_bits | slot
  std::vector<uint64_t> free_bits;  // ceil(H / 64)
  // ARC only (allocated for policy 1): T2 entries, ghost positions, T1 target.
  int32_t n2 = 0, ng1 = 0, ng2 = 0, p = 0;
  std::vector<uint32_t> ent2;       // H + kSpare, like ent
  std::vector<uint32_t> g1, g2;     // H + kSpare positions each, least recent first
};

struct Table {
  int32_t layers = 0;
  int32_t rows = 0;
  int32_t H = 0;
  int32_t policy = kLru;
  int32_t slot_bits = 1;     // bits of the largest slot index (H - 1)
  uint32_t slot_mask = 1;
  int64_t max_positions = 0;  // 2^(32 - slot_bits): positions an entry can hold
  std::vector<Row> state;    // layers * rows
};

void reset_row(const Table& t, Row& r) {
  const int32_t H = t.H;
  if (!r.allocated) {
    r.ent.assign(size_t(H) + kSpare, 0);
    r.free_bits.assign(size_t(H + 63) / 64, 0);
    if (t.policy == kArc) {
      r.ent2.assign(size_t(H) + kSpare, 0);
      r.g1.assign(size_t(H) + kSpare, 0);
      r.g2.assign(size_t(H) + kSpare, 0);
    }
    r.allocated = true;
  }
  std::fill(r.free_bits.begin(), r.free_bits.end(), 0);
  for (int32_t s = 0; s < H; ++s) r.free_bits[s >> 6] |= uint64_t(1) << (s & 63);
  r.free_count = H;
  r.free_hint = 0;
  r.n = r.n2 = r.ng1 = r.ng2 = r.p = 0;
}

inline void give_free(Row& r, int32_t s) {
  r.free_bits[s >> 6] |= uint64_t(1) << (s & 63);
  ++r.free_count;
  if ((s >> 6) < r.free_hint) r.free_hint = s >> 6;
}

inline int32_t take_free(Row& r) {
  int32_t w = r.free_hint;
  while (r.free_bits[w] == 0) ++w;
  r.free_hint = w;
  const int32_t b = __builtin_ctzll(r.free_bits[w]);
  r.free_bits[w] &= r.free_bits[w] - 1;
  --r.free_count;
  return (w << 6) | b;
}

struct RowArgs {
  int64_t tag;
  int32_t stable;
  int32_t len;
  const int32_t* topk;
  int32_t K;
  const int32_t* bt;  // this request's block table
  int32_t bt_len;
  int32_t block_size;
  int32_t base;       // row * H: global slot offset in the layer's hot buffer
  int32_t* out;
  int32_t* msrc;
  int32_t* mdst;
};

// Per-thread working memory, shared by every row and layer a thread resolves.
//   * `bits`: one bit per position, set for the positions of the current
//     top-k and cleared again before the call returns.  At 32k tokens it is
//     4 KiB, so the scan's per-entry membership test hits L1;
//   * `first[p]`: the first top-k index of p in this call, valid only where
//     the bit is set (no clearing needed), read only for hits (~K * hit rate).
// Why (ABI 6): ABI 5 kept one 32-bit generation-tagged mark per position
// (128 KiB at 32k tokens, in L2) and read it for each of the H live entries;
// those scattered L2 reads were most of a call (an L1-sized stand-in made the
// scan 4x faster).  Now the scan's H reads go to L1 and only the hits read L2.
struct Scratch {
  std::vector<uint32_t> bits;    // (len + 31) / 32 + kSpare words
  std::vector<uint16_t> first;   // len + 1 (K <= H <= 65534 fits)
  std::vector<int32_t> miss_i;  // K + kSpare
  std::vector<int32_t> dup_i;   // K
  std::vector<int32_t> dest;    // K
  std::vector<uint32_t> hit_e;  // K + kSpare: the scan's hits, as packed entries (one
                                // compress per 16 entries instead of two: ~1-3 %)
  void fit(int32_t K, int32_t len) {
    if (int32_t(miss_i.size()) < K + kSpare) {
      hit_e.resize(size_t(K) + kSpare);
      miss_i.resize(size_t(K) + kSpare);
      dup_i.resize(size_t(K) + kSpare);
      dest.resize(size_t(K) + kSpare);
    }
    const size_t words = size_t(len) / 32 + 1 + kSpare;
    if (bits.size() < words) bits.resize(std::max(words, bits.size() * 2), 0u);
    if (int64_t(first.size()) < int64_t(len) + 1) {
      first.resize(std::max<size_t>(size_t(len) + 1, first.size() * 2), 0);
    }
  }
};

Scratch& thread_scratch() {
  thread_local Scratch sc;
  return sc;
}

// Checks one batch entry before anything is mutated (a rejected call changes
// no state).  Returns 0 or -error; *bad_index gets the offending top-k index.
int64_t validate_row(const Table& t, const RowArgs& a, int32_t* bad_index) {
  if (int64_t(a.len) > t.max_positions) {
    *bad_index = -1;
    return -kErrCapacity;
  }
  if (a.len < 0 || a.stable < 0 || a.stable > a.len ||
      int64_t(a.len) > int64_t(a.bt_len) * a.block_size) {
    *bad_index = -1;
    return -kErrLengths;
  }
  int32_t lo = 0, hi = -1;  // vectorisable min/max
  for (int32_t i = 0; i < a.K; ++i) {
    lo = std::min(lo, a.topk[i]);
    hi = std::max(hi, a.topk[i]);
  }
  if (lo < -1 || hi >= a.len) {
    int32_t bad = 0;
    while (a.topk[bad] >= -1 && a.topk[bad] < a.len) ++bad;
    *bad_index = bad;
    return -kErrPosition;
  }
  return 0;
}

// ---------------------------------------------------------------- vector paths
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

// ---------------------------------------------------------------- one row

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

// ARC (see the top of the file).  Same contract as resolve_row; T1 lives in
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

extern "C" {

int32_t ao_res_abi_version() { return kAbiVersion; }

int32_t ao_res_has_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

// A table of `layers` x `rows` rows of H slots with replacement policy
// `policy` (0 exact LRU, 1 ARC); nullptr for bad arguments.
void* ao_res_create_policy(int32_t layers, int32_t rows, int32_t H, int32_t policy) {
  if (layers <= 0 || rows <= 0 || H <= 0 || H > 65534) return nullptr;
  if (policy != kLru && policy != kArc) return nullptr;
  Table* t = new Table();
  t->layers = layers;
  t->rows = rows;
  t->H = H;
  t->policy = policy;
  t->slot_bits = H > 1 ? 32 - __builtin_clz(uint32_t(H - 1)) : 1;
  t->slot_mask = (uint32_t(1) << t->slot_bits) - 1;
  t->max_positions = int64_t(1) << (32 - t->slot_bits);
  t->state.resize(size_t(layers) * size_t(rows));
  return t;
}

void* ao_res_create(int32_t layers, int32_t rows, int32_t H) {
  return ao_res_create_policy(layers, rows, H, kLru);
}

void ao_res_destroy(void* h) { delete static_cast<Table*>(h); }

// Forget the request in `row` on every layer (its memory is kept for reuse).
int32_t ao_res_release(void* h, int32_t row) {
  Table* t = static_cast<Table*>(h);
  if (row < 0 || row >= t->rows) return -kErrRow;
  for (int32_t l = 0; l < t->layers; ++l) {
    Row& r = t->state[size_t(l) * t->rows + row];
    if (r.allocated) reset_row(*t, r);
    r.active = false;
  }
  return 0;
}

// Resolve one layer for a batch.  topk is [B, K] (row-major), block_table is
// [B, bt_stride].  out gets [B, K] global hot-buffer slots (row * H + slot, -1
// for padding).  The misses of all rows are written compacted, in batch order,
// to msrc (host pool rows) / mdst (global slots) of capacity B * K.  counts
// gets (valid, misses) per batch entry.  Returns the total number of misses or
// -error with err_info = (batch index, top-k index).
int64_t ao_res_resolve(void* h, int32_t layer, int32_t B, const int32_t* rows,
                       const int64_t* tags, const int32_t* stable, const int32_t* lens,
                       const int32_t* topk, int32_t K, const int32_t* block_table,
                       int32_t bt_stride, int32_t block_size, int32_t* out, int32_t* msrc,
                       int32_t* mdst, int32_t* counts, int32_t nthreads, int32_t* err_info) {
  Table* t = static_cast<Table*>(h);
  err_info[0] = -1;
  err_info[1] = -1;
  if (layer < 0 || layer >= t->layers || B < 0 || K < 0 || K > t->H || block_size <= 0) {
    return -kErrArgs;
  }
  // Per-call work arrays live per calling thread: at small batches a fresh
  // allocation costs as much as a row's resolve.
  thread_local std::vector<char> seen;
  thread_local std::vector<int64_t> result;
  thread_local std::vector<RowArgs> args;
  {
    seen.assign(size_t(t->rows), 0);
    for (int32_t b = 0; b < B; ++b) {
      const int32_t row = rows[b];
      if (row < 0 || row >= t->rows || seen[row]) {
        err_info[0] = b;
        return -kErrRow;
      }
      seen[row] = 1;
    }
  }
  result.assign(size_t(B), 0);
  args.resize(size_t(B));
  for (int32_t b = 0; b < B; ++b) {
    RowArgs& a = args[b];
    a.tag = tags[b];
    a.stable = stable[b];
    a.len = lens[b];
    a.topk = topk + size_t(b) * K;
    a.K = K;
    a.bt = block_table + size_t(b) * bt_stride;
    a.bt_len = bt_stride;
    a.block_size = block_size;
    a.base = rows[b] * t->H;
    a.out = out + size_t(b) * K;
    a.msrc = msrc + size_t(b) * K;
    a.mdst = mdst + size_t(b) * K;
    const int64_t rc = validate_row(*t, a, &err_info[1]);
    if (rc < 0) {
      err_info[0] = b;
      return rc;
    }
  }
  Row* layer_rows = t->state.data() + size_t(layer) * t->rows;
  const int32_t nt = nthreads > 0 ? nthreads : 1;
  (void)nt;

  // Plain pointers: inside the parallel region the thread_local names would
  // resolve to each worker's own (empty) vectors.
  int64_t* const res = result.data();
  const RowArgs* const argv = args.data();
  const bool arc = t->policy == kArc;
  auto run_rows = [&](Scratch& sc, int32_t lo, int32_t hi) {
    for (int32_t b = lo; b < hi; ++b) {
      int32_t nvalid = 0;
      res[b] = arc ? resolve_row_arc(*t, layer_rows[rows[b]], argv[b], sc, &nvalid)
                   : resolve_row(*t, layer_rows[rows[b]], argv[b], sc, &nvalid);
      counts[2 * b] = nvalid;
      counts[2 * b + 1] = res[b] >= 0 ? int32_t(res[b]) : 0;
    }
  };
  if (nt > 1 && B > 1) {
#pragma omp parallel num_threads(nt)
    {
      int32_t lo = 0, hi = B;
#ifdef _OPENMP
      const int32_t id = omp_get_thread_num(), cnt = omp_get_num_threads();
      lo = int32_t(int64_t(B) * id / cnt);
      hi = int32_t(int64_t(B) * (id + 1) / cnt);
#endif
      run_rows(thread_scratch(), lo, hi);
    }
  } else {
    // No parallel region at all for one thread: entering even an inactive
    // one costs ~0.3 us here, a few percent of a batch-1 call.
    run_rows(thread_scratch(), 0, B);
  }
  int64_t total = 0;
  for (int32_t b = 0; b < B; ++b) {
    if (result[b] < 0) {
      err_info[0] = b;
      return result[b];
    }
    const int64_t n = result[b];
    if (total != int64_t(b) * K && n > 0) {
      std::memmove(msrc + total, msrc + size_t(b) * K, size_t(n) * sizeof(int32_t));
      std::memmove(mdst + total, mdst + size_t(b) * K, size_t(n) * sizeof(int32_t));
    }
    total += n;
  }
  return total;
}

// The positions (tokens) a row can hold: a len beyond it is kErrCapacity.
int64_t ao_res_max_positions(void* h) { return static_cast<Table*>(h)->max_positions; }

// ao_res_resolve with its arguments in one int64 block, in ao_res_resolve's
// order: layer, B, rows, tags, stable, lens, topk, K, block_table, bt_stride,
// block_size, out, msrc, mdst, counts, nthreads, err_info.  Why: ctypes
// converts every argument on every call; eighteen of them cost ~5.5 us,
// about half a batch-1 resolve, one costs ~0.6 us (measured).  The caller
// keeps the block and rewrites only the input pointers.
int64_t ao_res_resolve_packed(void* h, const int64_t* a) {
  auto i32p = [](int64_t v) { return reinterpret_cast<int32_t*>(static_cast<intptr_t>(v)); };
  return ao_res_resolve(h, int32_t(a[0]), int32_t(a[1]), i32p(a[2]),
                        reinterpret_cast<const int64_t*>(static_cast<intptr_t>(a[3])), i32p(a[4]),
                        i32p(a[5]), i32p(a[6]), int32_t(a[7]), i32p(a[8]), int32_t(a[9]),
                        int32_t(a[10]), i32p(a[11]), i32p(a[12]), i32p(a[13]), i32p(a[14]),
                        int32_t(a[15]), i32p(a[16]));
}

// resolve_packed with the top-k pointer as its own argument: the per-layer call
// of a bound step (the block keeps the step's pointers, see resolve_args in
// native.py), shaped for the three-pointer fast-call trampoline (fastcall.cpp).
int64_t ao_res_resolve_layer(void* h, int64_t* a, const int32_t* topk) {
  a[6] = static_cast<int64_t>(reinterpret_cast<intptr_t>(topk));
  return ao_res_resolve_packed(h, a);
}

// Test hook: how many membership-bitmap words of the calling thread are not
// zero (0 between calls, or a bit leaked into the next call).
int64_t ao_res_debug_dirty_words() {
  int64_t n = 0;
  for (uint32_t w : thread_scratch().bits) n += w != 0;
  return n;
}

// Test/debug view of one row: slot -> position and the live slots from least
// to most recently used.  Returns the number of live entries written.
int32_t ao_res_inspect(void* h, int32_t layer, int32_t row, int32_t* slot_pos, int32_t* lru_order) {
  Table* t = static_cast<Table*>(h);
  if (layer < 0 || layer >= t->layers || row < 0 || row >= t->rows) return -kErrArgs;
  Row& r = t->state[size_t(layer) * t->rows + row];
  for (int32_t s = 0; s < t->H; ++s) slot_pos[s] = -1;
  if (!r.allocated || !r.active) return 0;
  for (int32_t j = 0; j < r.n + r.n2; ++j) {  // ARC: T1, then T2
    const uint32_t e = j < r.n ? r.ent[j] : r.ent2[j - r.n];
    const int32_t s = int32_t(e & t->slot_mask);
    slot_pos[s] = int32_t(e >> t->slot_bits);
    lru_order[j] = s;
  }
  return r.n + r.n2;
}

// Test/debug view of a row's policy state: info = (policy, |T1|, |T2|, |B1|,
// |B2|, p); b1 / b2 (H entries each) get the ghost positions, least recent
// first.  LRU rows report |T1| = live entries and no ghosts.
int32_t ao_res_policy_state(void* h, int32_t layer, int32_t row, int32_t* info, int32_t* b1,
                            int32_t* b2) {
  Table* t = static_cast<Table*>(h);
  if (layer < 0 || layer >= t->layers || row < 0 || row >= t->rows) return -kErrArgs;
  const Row& r = t->state[size_t(layer) * t->rows + row];
  const bool live = r.allocated && r.active;
  info[0] = t->policy;
  info[1] = live ? r.n : 0;
  info[2] = live ? r.n2 : 0;
  info[3] = live ? r.ng1 : 0;
  info[4] = live ? r.ng2 : 0;
  info[5] = live ? r.p : 0;
  for (int32_t j = 0; j < info[3]; ++j) b1[j] = int32_t(r.g1[j]);
  for (int32_t j = 0; j < info[4]; ++j) b2[j] = int32_t(r.g2[j]);
  return 0;
}

}  // extern "C"

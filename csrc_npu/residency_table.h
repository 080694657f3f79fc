// Residency table: the state of one (layer, request row) and of a table, the
// error codes, the free-slot bitmap helpers, a row's call arguments, the
// per-thread working memory, and the checks made before any state changes.
// Layout and semantics: the top of residency.cpp.
//
// Included only by residency.cpp, directly or through another residency_*.h:
// one translation unit, compiled as one file; everything here is in an
// anonymous namespace, like the rest of its internals.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

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

}  // namespace

// Hot-buffer residency for sparse decode offload: one exact-LRU table per
// (layer, request row), resolved for a whole batch in one call.
//
// Plain C++17 with a C ABI (loaded by ascend_offload/sparse/native.py through
// ctypes): no torch headers, so one build serves every torch / torch_npu
// version, x86-64 and aarch64 alike.
//
// Per row the state is
//   map       position -> slot + 1 (uint16, 0 = not resident), sized to the
//             request length (2 bytes per token: ~0.2 % of the host pool);
//   slot_pos  slot -> position (-1 = free);
//   slot_seq  slot -> sequence number of its newest entry in `ring`;
//   ring      a recency queue of slot ids; an entry at sequence q is live iff
//             slot_seq[slot] == q (older entries of re-touched slots are
//             stale and skipped lazily); the oldest live entry is the LRU;
//   free_bits bitmap of free slots (lowest index is taken first).
// A call costs O(K + misses) amortised: no pass over all H slots.  The ring is
// compacted (stale entries dropped) when a call could overflow it; it holds
// 4*H entries, so compaction happens at most every (3H/K) calls.
//
// Semantics (the pure-torch twin in residency.py implements the same ones and
// must give identical outputs):
//   * a row whose tag differs from the stored one is reset (new request);
//   * slots holding positions >= stable are freed first (speculative tokens);
//   * every valid position (>= 0) of top-k is a hit if resident; -1 is padding;
//   * the touch order of this call is: hits in top-k order, then misses in
//     top-k order (duplicates touch again; the newest touch counts);
//   * distinct misses, in order of first occurrence, take the lowest free
//     slots first, then evict least-recently-touched slots not hit in this call.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int32_t kAbiVersion = 3;

// Error codes returned (negated) by ao_res_resolve; err_info gets (row, index).
enum : int64_t {
  kErrPosition = 1,   // top-k entry < -1 or >= len
  kErrLengths = 2,    // stable > len, len < 0, len beyond the block table
  kErrRow = 3,        // row id out of range or repeated in one batch
  kErrInternal = 4,   // invariant broken (would evict a slot touched this call)
  kErrArgs = 5,       // bad call arguments (layer, K > H, ...)
};

struct Row {
  int64_t tag = 0;
  bool active = false;
  bool allocated = false;
  int32_t hi = 0;          // every resident position is < hi
  uint32_t head = 1;       // oldest sequence number still in the ring
  uint32_t tail = 1;       // next sequence number
  int32_t free_count = 0;
  int32_t free_hint = 0;   // lowest word of free_bits that may be non-zero
  std::vector<uint16_t> map;
  std::vector<int32_t> slot_pos;   // H
  std::vector<uint32_t> slot_seq;  // H + 1 (index H is a sink for branch-free writes)
  std::vector<uint16_t> ring;      // C
  std::vector<uint64_t> free_bits; // ceil(H / 64)
};

struct Table {
  int32_t layers = 0;
  int32_t rows = 0;
  int32_t H = 0;
  uint32_t C = 0;
  uint32_t mask = 0;
  std::vector<Row> state;  // layers * rows
};

inline void free_slot(Row& r, int32_t s) {
  r.map[r.slot_pos[s]] = 0;
  r.slot_pos[s] = -1;
  r.slot_seq[s] = 0;
  r.free_bits[s >> 6] |= uint64_t(1) << (s & 63);
  ++r.free_count;
  if ((s >> 6) < r.free_hint) r.free_hint = s >> 6;
}

void reset_row(const Table& t, Row& r) {
  const int32_t H = t.H;
  if (!r.allocated) {
    r.slot_pos.assign(H, -1);
    r.slot_seq.assign(H + 1, 0);
    r.ring.assign(t.C, 0);
    r.free_bits.assign((H + 63) / 64, 0);
    r.allocated = true;
  } else {
    for (int32_t s = 0; s < H; ++s) {
      const int32_t p = r.slot_pos[s];
      if (p >= 0) r.map[p] = 0;
      r.slot_pos[s] = -1;
    }
    std::fill(r.slot_seq.begin(), r.slot_seq.end(), 0u);
  }
  std::fill(r.free_bits.begin(), r.free_bits.end(), 0);
  for (int32_t s = 0; s < H; ++s) r.free_bits[s >> 6] |= uint64_t(1) << (s & 63);
  r.free_count = H;
  r.free_hint = 0;
  r.head = r.tail = 1;
  r.hi = 0;
}

// Drop stale ring entries and renumber the live ones 1..n (order preserved).
void compact(const Table& t, Row& r, std::vector<uint16_t>& tmp) {
  tmp.clear();
  for (uint32_t q = r.head; q != r.tail; ++q) {
    const uint16_t s = r.ring[q & t.mask];
    if (r.slot_seq[s] == q) tmp.push_back(s);
  }
  uint32_t q = 1;
  for (uint16_t s : tmp) {
    r.ring[q & t.mask] = s;
    r.slot_seq[s] = q;
    ++q;
  }
  r.head = 1;
  r.tail = q;
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

struct Scratch {
  std::vector<int32_t> miss_idx;
  std::vector<uint16_t> tmp;
};

// Returns the number of misses (>= 0) or -error; *bad_index gets the offender.
int64_t resolve_row(const Table& t, Row& r, const RowArgs& a, Scratch& sc, int32_t* nvalid,
                    int32_t* bad_index) {
  if (a.len < 0 || a.stable < 0 || a.stable > a.len ||
      int64_t(a.len) > int64_t(a.bt_len) * a.block_size) {
    *bad_index = -1;
    return -kErrLengths;
  }
  if (!r.active || r.tag != a.tag) {
    reset_row(t, r);
    r.tag = a.tag;
    r.active = true;
  }
  if (int64_t(r.map.size()) < a.len) {
    size_t n = std::max<size_t>(size_t(a.len), r.map.size() * 2);
    r.map.resize(n, 0);
  }
  // Speculative positions may be rolled back: forget them.
  if (a.stable < r.hi) {
    for (int32_t p = a.stable; p < r.hi; ++p) {
      const uint16_t m = r.map[p];
      if (m) free_slot(r, int32_t(m) - 1);
    }
    r.hi = a.stable;
  }
  if (r.tail - r.head + uint32_t(a.K) > t.C) compact(t, r, sc.tmp);

  const int32_t K = a.K;
  const int32_t H = t.H;
  const uint32_t mask = t.mask;
  const uint32_t call_start = r.tail;
  const uint32_t ulen = uint32_t(a.len);
  uint16_t* map = r.map.data();
  uint16_t* ring = r.ring.data();
  uint32_t* seq = r.slot_seq.data();
  int32_t* miss_idx = sc.miss_idx.data();
  uint32_t tail = r.tail;
  int32_t nm = 0;
  int32_t valid_count = 0;
  int32_t bad = -1;

  // Pass 1, branch-free: hits get their slot and a new ring entry; misses are listed.
  for (int32_t i = 0; i < K; ++i) {
    const int32_t p = a.topk[i];
    const uint32_t ok = uint32_t(p) < ulen;          // also false for every p < 0
    const uint32_t pc = ok ? uint32_t(p) : 0u;
    const uint32_t m = ok ? map[pc] : 0u;
    const uint32_t hit = m != 0;
    const uint32_t s = hit ? m - 1 : uint32_t(H);
    a.out[i] = hit ? a.base + int32_t(s) : -1;
    ring[tail & mask] = uint16_t(s);
    seq[s] = tail;
    tail += hit;
    miss_idx[nm] = i;
    nm += int32_t(ok & (hit ^ 1u));
    valid_count += int32_t(ok);
    if (!ok && p != -1 && bad < 0) bad = i;
  }
  seq[H] = 0;
  if (bad >= 0) {
    reset_row(t, r);  // never leave a half-updated row behind
    r.tag = a.tag;
    r.active = true;
    *bad_index = bad;
    return -kErrPosition;
  }

  // Pass 2: distinct misses take free slots, then LRU victims not hit in this call.
  int32_t misses = 0;
  int32_t hi = r.hi;
  const int32_t bshift = __builtin_ctz(uint32_t(a.block_size));
  const bool pow2 = (a.block_size & (a.block_size - 1)) == 0;
  for (int32_t j = 0; j < nm; ++j) {
    const int32_t i = miss_idx[j];
    const int32_t p = a.topk[i];
    const uint16_t m = map[p];
    int32_t s;
    if (m) {  // repeated position already loaded by this call
      s = int32_t(m) - 1;
    } else {
      if (r.free_count > 0) {
        s = take_free(r);
      } else {
        for (;;) {
          const uint32_t q = r.head;
          if (q == call_start) {
            *bad_index = i;
            r.tail = tail;
            return -kErrInternal;
          }
          ++r.head;
          const uint16_t v = ring[q & mask];
          if (seq[v] == q) {
            s = v;
            break;
          }
        }
        map[r.slot_pos[s]] = 0;
      }
      r.slot_pos[s] = p;
      map[p] = uint16_t(s + 1);
      if (p >= hi) hi = p + 1;
      int32_t src;
      if (pow2) {
        src = a.bt[p >> bshift] * a.block_size + (p & (a.block_size - 1));
      } else {
        src = a.bt[p / a.block_size] * a.block_size + p % a.block_size;
      }
      a.msrc[misses] = src;
      a.mdst[misses] = a.base + s;
      ++misses;
    }
    a.out[i] = a.base + s;
    ring[tail & mask] = uint16_t(s);
    seq[s] = tail;
    ++tail;
  }
  r.tail = tail;
  r.hi = hi;
  *nvalid = valid_count;
  return misses;
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

void* ao_res_create(int32_t layers, int32_t rows, int32_t H) {
  if (layers <= 0 || rows <= 0 || H <= 0 || H > 65535) return nullptr;
  Table* t = new Table();
  t->layers = layers;
  t->rows = rows;
  t->H = H;
  uint32_t c = 1;
  while (c < uint32_t(4 * H)) c <<= 1;
  t->C = c;
  t->mask = c - 1;
  t->state.resize(size_t(layers) * size_t(rows));
  return t;
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
  {
    std::vector<char> seen(size_t(t->rows), 0);
    for (int32_t b = 0; b < B; ++b) {
      const int32_t row = rows[b];
      if (row < 0 || row >= t->rows || seen[row]) {
        err_info[0] = b;
        return -kErrRow;
      }
      seen[row] = 1;
    }
  }
  std::vector<int64_t> result(size_t(B), 0);
  std::vector<int32_t> bad_idx(size_t(B), -1);
  Row* layer_rows = t->state.data() + size_t(layer) * t->rows;
  const int32_t nt = nthreads > 0 ? nthreads : 1;

#pragma omp parallel num_threads(nt) if (nt > 1 && B > 1)
  {
    thread_local Scratch sc;
    if (int32_t(sc.miss_idx.size()) < K) sc.miss_idx.resize(size_t(K));
    if (sc.tmp.capacity() < size_t(t->H)) sc.tmp.reserve(size_t(t->H));
#pragma omp for schedule(static)
    for (int32_t b = 0; b < B; ++b) {
      RowArgs a;
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
      int32_t nvalid = 0;
      result[b] = resolve_row(*t, layer_rows[rows[b]], a, sc, &nvalid, &bad_idx[b]);
      counts[2 * b] = nvalid;
      counts[2 * b + 1] = result[b] >= 0 ? int32_t(result[b]) : 0;
    }
  }
  int64_t total = 0;
  for (int32_t b = 0; b < B; ++b) {
    if (result[b] < 0) {
      err_info[0] = b;
      err_info[1] = bad_idx[b];
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

// Test/debug view of one row: slot -> position and the live slots from least
// to most recently used.  Returns the number of live ring entries written.
int32_t ao_res_inspect(void* h, int32_t layer, int32_t row, int32_t* slot_pos, int32_t* lru_order) {
  Table* t = static_cast<Table*>(h);
  if (layer < 0 || layer >= t->layers || row < 0 || row >= t->rows) return -kErrArgs;
  Row& r = t->state[size_t(layer) * t->rows + row];
  if (!r.allocated || !r.active) {
    for (int32_t s = 0; s < t->H; ++s) slot_pos[s] = -1;
    return 0;
  }
  std::memcpy(slot_pos, r.slot_pos.data(), size_t(t->H) * sizeof(int32_t));
  int32_t n = 0;
  for (uint32_t q = r.head; q != r.tail; ++q) {
    const uint16_t s = r.ring[q & t->mask];
    if (r.slot_seq[s] == q) lru_order[n++] = s;
  }
  return n;
}

}  // extern "C"

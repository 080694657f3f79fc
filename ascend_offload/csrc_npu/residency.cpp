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

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define AO_X86_AVX2 1  // AVX2 paths compiled per function, chosen at run time
#endif

namespace {

constexpr int32_t kAbiVersion = 3;
constexpr uint16_t kPending = 0xFFFF;  // map mark: claimed by the running call
constexpr int32_t kPrefetch = 64;      // top-k entries looked ahead in the lookup loop

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
  // K + 8 entries: the vector paths store whole 8-lane groups past the count.
  std::vector<int32_t> miss_idx;
  std::vector<int32_t> hits;
  std::vector<int32_t> uniq;
  std::vector<int32_t> dest;
  std::vector<uint16_t> tmp;      // H (compaction)
  void fit(int32_t K, int32_t H) {
    if (int32_t(miss_idx.size()) < K + 8) {
      miss_idx.resize(size_t(K) + 8);
      hits.resize(size_t(K) + 8);
      uniq.resize(size_t(K) + 8);
      dest.resize(size_t(K) + 8);
    }
    if (tmp.capacity() < size_t(H)) tmp.reserve(size_t(H));
  }
};

// Checks one batch entry before anything is mutated (a rejected call changes
// no state).  Returns 0 or -error; *bad_index gets the offending top-k index.
int64_t validate_row(const RowArgs& a, int32_t* bad_index) {
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

bool use_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2");
  return ok;
}

// Phase A on 8 positions at a time: gather the map entries, write out[],
// left-pack hit slots and miss indices.  Scalar left-packing stores to
// data-dependent addresses and measured ~2.5x slower.  Returns the number of
// entries handled (a multiple of 8); the caller finishes the rest.
__attribute__((target("avx2"))) int32_t lookup_avx2(
    const int32_t* topk, int32_t K, const uint16_t* map, int32_t base, int32_t* out,
    int32_t* hits, int32_t* miss_idx, int32_t* nh_out, int32_t* nm_out, int32_t* nvalid_out) {
  const __m256i neg1 = _mm256_set1_epi32(-1), low16 = _mm256_set1_epi32(0xFFFF);
  const __m256i zero = _mm256_setzero_si256(), one = _mm256_set1_epi32(1);
  const __m256i vbase = _mm256_set1_epi32(base - 1), iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int* map32 = reinterpret_cast<const int*>(map);
  int32_t nh = 0, nm = 0, nvalid = 0, i = 0;
  // Gathers do not overlap cache misses as well as scalar loads: prefetch
  // the map entries kPrefetch positions ahead (cold state at large batches).
  for (int32_t j = 0; j < std::min(K, kPrefetch); ++j)
    __builtin_prefetch(&map[uint32_t(topk[j]) & ~uint32_t(topk[j] >> 31)]);
  for (; i + 8 <= K; i += 8) {
    if (i + kPrefetch + 8 <= K) {
      for (int32_t j = i + kPrefetch; j < i + kPrefetch + 8; ++j)
        __builtin_prefetch(&map[uint32_t(topk[j]) & ~uint32_t(topk[j] >> 31)]);
    }
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(topk + i));
    const __m256i valid = _mm256_cmpgt_epi32(p, neg1);
    const __m256i m = _mm256_and_si256(
        _mm256_and_si256(_mm256_i32gather_epi32(map32, _mm256_and_si256(p, valid), 2), low16), valid);
    const __m256i absent = _mm256_cmpeq_epi32(m, zero);  // miss or padding
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm256_or_si256(_mm256_add_epi32(m, vbase), absent));
    const uint32_t vm = uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(valid)));
    const uint32_t am = uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(absent)));
    const uint32_t hm = ~am & 0xFFu, mm = am & vm;
    const __m256i hs = _mm256_permutevar8x32_epi32(
        _mm256_sub_epi32(m, one), _mm256_load_si256(reinterpret_cast<const __m256i*>(kPack.idx[hm])));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hits + nh), hs);
    nh += __builtin_popcount(hm);
    const __m256i ms = _mm256_permutevar8x32_epi32(
        _mm256_add_epi32(iota, _mm256_set1_epi32(i)),
        _mm256_load_si256(reinterpret_cast<const __m256i*>(kPack.idx[mm])));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(miss_idx + nm), ms);
    nm += __builtin_popcount(mm);
    nvalid += __builtin_popcount(vm);
  }
  *nh_out = nh;
  *nm_out = nm;
  *nvalid_out = nvalid;
  return i;
}

// Phase D on 8 ring entries at a time: an entry at sequence q is live iff
// seq[slot] == q; live entries are the LRU order.  Takes victims into
// dest[nv..nd) and advances *head past the last entry consumed; stops early
// (for the scalar loop) when fewer than 8 entries remain before call_start or
// the ring wraps inside the group.
__attribute__((target("avx2"))) int32_t evict_avx2(
    const uint16_t* ring, const uint32_t* seq, uint32_t mask, uint32_t call_start,
    uint32_t* head_io, int32_t* dest, int32_t nv, int32_t nd) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int* seq32 = reinterpret_cast<const int*>(seq);
  uint32_t head = *head_io;
  while (nv < nd && call_start - head >= 8 && (head & mask) + 8 <= mask + 1) {
    const __m256i slots = _mm256_cvtepu16_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(ring + (head & mask))));
    const __m256i q = _mm256_add_epi32(_mm256_set1_epi32(int32_t(head)), iota);
    const __m256i live = _mm256_cmpeq_epi32(_mm256_i32gather_epi32(seq32, slots, 4), q);
    uint32_t lm = uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(live)));
    const int32_t cnt = __builtin_popcount(lm), need = nd - nv;
    if (cnt <= need) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dest + nv),
                          _mm256_permutevar8x32_epi32(
                              slots, _mm256_load_si256(reinterpret_cast<const __m256i*>(kPack.idx[lm]))));
      nv += cnt;
      head += 8;
    } else {  // the last group: take only the first `need` live entries
      int32_t b = 0;
      for (int32_t k = 0; k < need; ++k) {
        b = __builtin_ctz(lm);
        lm &= lm - 1;
        dest[nv++] = ring[(head + uint32_t(b)) & mask];
      }
      head += uint32_t(b) + 1;
    }
  }
  *head_io = head;
  return nv;
}
#endif

// Returns the number of misses (>= 0) (inputs already validated).
int64_t resolve_row(const Table& t, Row& r, const RowArgs& a, Scratch& sc, int32_t* nvalid,
                    int32_t* bad_index) {
  *bad_index = -1;
  if (!r.active || r.tag != a.tag) {
    reset_row(t, r);
    r.tag = a.tag;
    r.active = true;
  }
  // One spare entry: the vector lookup reads 4 bytes at every position.
  if (int64_t(r.map.size()) < int64_t(std::max(a.len, 1)) + 1) {
    size_t n = std::max<size_t>(size_t(std::max(a.len, 1)) + 1, r.map.size() * 2);
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
  // Compact when this call could overflow the ring, and long before the
  // 32-bit sequence numbers could wrap (renumbering restarts them at 1).
  if (r.tail - r.head + uint32_t(a.K) > t.C || r.tail > 0xF0000000u) compact(t, r, sc.tmp);

  // The work is split into short loops with few live values each (so nothing
  // spills) and no data-dependent branches; every loop is O(K) or O(misses).
  const int32_t K = a.K;
  const uint32_t mask = t.mask;
  const uint32_t call_start = r.tail;
  const int32_t base = a.base;
  const int32_t* __restrict topk = a.topk;
  int32_t* __restrict out = a.out;
  uint16_t* __restrict map = r.map.data();
  uint16_t* __restrict ring = r.ring.data();
  uint32_t* __restrict seq = r.slot_seq.data();
  int32_t* __restrict slot_pos = r.slot_pos.data();
  int32_t* __restrict miss_idx = sc.miss_idx.data();
  int32_t* __restrict hits = sc.hits.data();

  // A: look every position up; list hit slots and miss indices.
  int32_t nh = 0, nm = 0, valid_count = 0;
  int32_t i0 = 0;
#ifdef AO_X86_AVX2
  if (use_avx2()) i0 = lookup_avx2(topk, K, map, base, out, hits, miss_idx, &nh, &nm, &valid_count);
#endif
  // Scalar lookup (the whole call without AVX2, else the last K % 8 entries).
  // Pure arithmetic on purpose: a setcc on a loaded value makes a
  // partial-register dependency from one iteration to the next and
  // serialises the loads.
  // The lookups are independent but this loop alone does not overlap their
  // cache misses well: prefetching the map entries far ahead halves the cost
  // of a call on cold state (measured, see docs/bench-sparse.md).
  for (int32_t i = i0; i < std::min(K, i0 + kPrefetch); ++i) {
    __builtin_prefetch(&map[uint32_t(topk[i]) & ~uint32_t(topk[i] >> 31)]);
  }
  for (int32_t i = i0; i < K; ++i) {
    if (i + kPrefetch < K) {
      const int32_t q = topk[i + kPrefetch];
      __builtin_prefetch(&map[uint32_t(q) & ~uint32_t(q >> 31)]);
    }
    const int32_t p = topk[i];
    const uint32_t vmask = ~uint32_t(p >> 31);       // all ones unless p == -1
    const uint32_t vbit = vmask & 1u;
    const uint32_t m = map[uint32_t(p) & vmask] & vmask;
    const uint32_t hit = (m + 0xFFFFu) >> 16;         // m != 0 (m <= 0xFFFF)
    out[i] = int32_t((uint32_t(base) + m) & (0u - hit)) - 1;
    hits[nh] = int32_t(m) - 1;
    nh += int32_t(hit);
    miss_idx[nm] = i;
    nm += int32_t(vbit - hit);
    valid_count += int32_t(vbit);
  }
  // B: hits become the most recent entries, in top-k order.
  uint32_t tail = r.tail;
  for (int32_t k = 0; k < nh; ++k) {
    ring[tail & mask] = hits[k];
    seq[hits[k]] = tail;
    ++tail;
  }
  // C: distinct misses in first-occurrence order (kPending marks a position
  // already claimed by this call).
  int32_t* __restrict uniq = sc.uniq.data();
  int32_t nd = 0;
  for (int32_t j = 0; j < nm; ++j) {
    const int32_t p = topk[miss_idx[j]];
    const uint32_t fresh = 1u - ((uint32_t(map[p]) + 0xFFFFu) >> 16);
    map[p] = kPending;
    uniq[nd] = p;
    nd += int32_t(fresh);
  }
  // D: slots for the distinct misses: lowest free slots first, then the
  // oldest live ring entries (least recently used, never one touched above).
  int32_t* __restrict dest = sc.dest.data();
  int32_t nf = 0;
  while (nf < nd && r.free_count > 0) dest[nf++] = take_free(r);
  uint32_t head = r.head;
  int32_t nv = nf;
#ifdef AO_X86_AVX2
  if (use_avx2()) nv = evict_avx2(ring, seq, mask, call_start, &head, dest, nv, nd);
#endif
  for (; nv < nd;) {
    if (__builtin_expect(head == call_start, 0)) {
      r.head = head;
      r.tail = tail;
      *bad_index = -1;
      return -kErrInternal;
    }
    const uint16_t v = ring[head & mask];
    dest[nv] = v;
    const uint32_t x = seq[v] ^ head;
    nv += int32_t(((x | (0u - x)) >> 31) ^ 1u);  // seq[v] == head, without setcc
    ++head;
  }
  r.head = head;
  // E: install the misses and emit their copy descriptors.
  const int32_t bs = a.block_size;
  const int32_t* __restrict bt = a.bt;
  int32_t* __restrict msrc = a.msrc;
  int32_t* __restrict mdst = a.mdst;
  int32_t hi = r.hi;
  for (int32_t k = nf; k < nd; ++k) __builtin_prefetch(&slot_pos[dest[k]]);
  for (int32_t k = nf; k < nd; ++k) map[slot_pos[dest[k]]] = 0;  // evicted positions
  if ((bs & (bs - 1)) == 0) {
    const int32_t shift = __builtin_ctz(uint32_t(bs));
    for (int32_t k = 0; k < nd; ++k) {
      const int32_t p = uniq[k];
      const int32_t s = dest[k];
      slot_pos[s] = p;
      map[p] = uint16_t(s + 1);
      hi = p >= hi ? p + 1 : hi;
      msrc[k] = bt[p >> shift] * bs + (p & (bs - 1));
      mdst[k] = base + s;
    }
  } else {
    for (int32_t k = 0; k < nd; ++k) {
      const int32_t p = uniq[k];
      const int32_t s = dest[k];
      slot_pos[s] = p;
      map[p] = uint16_t(s + 1);
      hi = p >= hi ? p + 1 : hi;
      msrc[k] = bt[p / bs] * bs + p % bs;
      mdst[k] = base + s;
    }
  }
  // F: every miss occurrence (duplicates included) gets its slot and a touch.
  for (int32_t j = 0; j < nm; ++j) {
    const int32_t i = miss_idx[j];
    const uint32_t s = uint32_t(map[topk[i]]) - 1;
    out[i] = base + int32_t(s);
    ring[tail & mask] = uint16_t(s);
    seq[s] = tail;
    ++tail;
  }
  const int32_t misses = nd;
  r.head = head;
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
  if (layers <= 0 || rows <= 0 || H <= 0 || H > 65534) return nullptr;
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
  std::vector<RowArgs> args(static_cast<size_t>(B));
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
    const int64_t rc = validate_row(a, &err_info[1]);
    if (rc < 0) {
      err_info[0] = b;
      return rc;
    }
  }
  Row* layer_rows = t->state.data() + size_t(layer) * t->rows;
  const int32_t nt = nthreads > 0 ? nthreads : 1;
  (void)nt;

#pragma omp parallel num_threads(nt) if (nt > 1 && B > 1)
  {
    thread_local Scratch sc;
    sc.fit(K, t->H);
#pragma omp for schedule(static)
    for (int32_t b = 0; b < B; ++b) {
      int32_t nvalid = 0;
      result[b] = resolve_row(*t, layer_rows[rows[b]], args[b], sc, &nvalid, &bad_idx[b]);
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

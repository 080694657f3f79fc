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
//
// The parts, one translation unit (this file includes them; codegen as one
// file): residency_table.h (row and table state, call arguments, scratch,
// validation), residency_simd.h (AVX2 / AVX-512 kernels, run-time choice),
// residency_row.h (the steps both policies share), residency_lru.h and
// residency_arc.h (the policies).  This file: the C ABI.
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "residency_table.h"
#include "residency_lru.h"  // before ARC: the original order of the code
#include "residency_arc.h"

namespace {

constexpr int32_t kAbiVersion = 10;  // 8: the ordered copy queue (copyqueue.cpp); 9: residency
                                     // policies (ao_res_create_policy, ao_res_policy_state);
                                     // 10: the device table's host kernels (device_table.cpp)

}  // namespace

extern "C" {

int32_t ao_res_abi_version() { return kAbiVersion; }

// The widest scan this process uses: 512 (AVX-512), 256 (AVX2) or 0 (scalar), after
// the CPU check and ASCEND_OFFLOAD_NATIVE_SIMD (tests assert which path ran).
int32_t ao_res_simd_width() {
#ifdef AO_X86_AVX2
  return use_avx512() ? 512 : use_avx2() ? 256 : 0;
#else
  return 0;
#endif
}

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

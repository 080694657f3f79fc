// The device residency table's resolve and miss gather as one host kernel each:
// what the device backend runs where the device IS the host (CPU engines).
//
// Why: the table's portable kernel (resolve_lru in
// ascend_offload/sparse/device_residency.py) is ~190 small tensor ops a layer.  On an
// accelerator they are kernels inside a captured decode graph; on a CPU each is a
// few microseconds of ATen dispatch (~0.5 ms a layer at batch 8), which cost the
// CPU engine more than the whole host resolver.  This file does the same work on
// the same state tensors in one pass per request: ~10 us a layer.  Same layout,
// same semantics, output for output (the tests compare it with the tensor ops, the
// host table and the pure-torch twin on random traces):
//
//   * state of one layer: pos_slot [R + 1, C + 1] (int16 or int32), slot_pos
//     [R + 1, H + 1] int32, stamp [R + 1, H + 1] int64, tag / clock [R + 1] int64,
//     report [8] int64; row R and column C / H are scratch (unspecified contents);
//   * the step: meta [Bp, 5] int64 (row, tag, stable, len, real) and block_table
//     [Bp, W] int32; top-k [Bp, K] int32 or int64, -1 padding;
//   * outputs: slots [Bp, K] int32, miss_src / miss_dst [Bp, K] int64,
//     copy_src / copy_dst [Bp * K] int64, counts [Bp, 2] int32 (see resolve_lru).
//
// An input error (a top-k position outside [-1, len) of a real entry) changes no
// state and is recorded in report (first offender only), exactly like the tensor ops;
// DeviceResidency.check raises it once per step.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

// Argument block of ao_dres_resolve (int64 slots; pointers as integers).
enum Arg : int {
  kPosSlot, kMapBytes, kSlotPos, kStamp, kTag, kClock, kReport,
  kTrashRow, kCap, kHot,
  kMeta, kPadded, kBlockTable, kWidth, kBlockSize,
  kTopkBytes, kK,
  kSlots, kMissSrc, kMissDst, kCopySrc, kCopyDst, kCounts,
  kNumArgs,
};

template <typename T>
T* ptr(const int64_t* a, int i) {
  return reinterpret_cast<T*>(static_cast<intptr_t>(a[i]));
}

struct Scratch {
  std::vector<int32_t> mrank;     // [K] miss rank of each top-k entry's position (-1: none)
  std::vector<int32_t> miss_pos;  // [K] position of distinct miss j
  std::vector<int32_t> chosen;    // [K] slot of distinct miss j
  std::vector<int32_t> hit_rank;  // [H] touch order of a slot hit in this call (-1: not hit)
  std::vector<int32_t> hits;      // the hit slots, in hit order
  std::vector<std::pair<int64_t, int32_t>> cand;  // (stamp, slot) of evictable live slots
  std::vector<std::pair<int64_t, int32_t>> tmp;   // radix sort buffer
};

// Sort (stamp, slot) pairs by stamp (distinct within a row). Why a radix sort: at
// DeepSeek-V3.2 scale a call evicts ~1800 of 4096 slots, and a comparison sort of the
// candidates was two thirds of the call; stamps relative to the smallest fit in a few
// 11-bit digits (a row's stamps span the touches since its oldest resident entry).
void sort_by_stamp(std::vector<std::pair<int64_t, int32_t>>& c,
                   std::vector<std::pair<int64_t, int32_t>>& tmp) {
  if (c.size() < 64) {
    std::sort(c.begin(), c.end());
    return;
  }
  int64_t lo = c[0].first, hi = c[0].first;
  for (const auto& x : c) {
    lo = std::min(lo, x.first);
    hi = std::max(hi, x.first);
  }
  const auto range = static_cast<uint64_t>(hi - lo);
  tmp.resize(c.size());
  constexpr int kBits = 11;
  constexpr size_t kBuckets = size_t{1} << kBits;
  for (int shift = 0; shift < 64 && (range >> shift) != 0; shift += kBits) {
    size_t count[kBuckets + 1] = {0};
    for (const auto& x : c) ++count[((static_cast<uint64_t>(x.first - lo) >> shift) & (kBuckets - 1)) + 1];
    for (size_t i = 1; i <= kBuckets; ++i) count[i] += count[i - 1];
    for (const auto& x : c) tmp[count[(static_cast<uint64_t>(x.first - lo) >> shift) & (kBuckets - 1)]++] = x;
    c.swap(tmp);
  }
}

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

template <typename Map, typename TopK>
void resolve(const int64_t* a, const TopK* topk) {
  Map* const pos_slot = ptr<Map>(a, kPosSlot);
  int32_t* const slot_pos = ptr<int32_t>(a, kSlotPos);
  int64_t* const stamp = ptr<int64_t>(a, kStamp);
  int64_t* const tag = ptr<int64_t>(a, kTag);
  int64_t* const clock = ptr<int64_t>(a, kClock);
  int64_t* const report = ptr<int64_t>(a, kReport);
  const int64_t cap = a[kCap], hot = a[kHot];
  const int64_t* const meta = ptr<const int64_t>(a, kMeta);
  const int64_t bp = a[kPadded], width = a[kWidth], bs = a[kBlockSize], k = a[kK];
  const int32_t* const block_table = ptr<const int32_t>(a, kBlockTable);
  int32_t* const slots = ptr<int32_t>(a, kSlots);
  int64_t* const miss_src = ptr<int64_t>(a, kMissSrc);
  int64_t* const miss_dst = ptr<int64_t>(a, kMissDst);
  int64_t* const copy_src = ptr<int64_t>(a, kCopySrc);
  int64_t* const copy_dst = ptr<int64_t>(a, kCopyDst);
  int32_t* const counts = ptr<int32_t>(a, kCounts);
  auto m = [meta](int64_t b, int f) { return meta[b * 5 + f]; };

  // Input check of the whole call: any bad position and the call changes nothing.
  int64_t first_bad = -1;
  for (int64_t b = 0; b < bp && first_bad < 0; ++b) {
    if (m(b, 4) == 0) continue;
    const int64_t len = m(b, 3);
    for (int64_t i = 0; i < k; ++i) {
      const int64_t p = static_cast<int64_t>(topk[b * k + i]);
      if (p < -1 || p >= len) {
        first_bad = b * k + i;
        break;
      }
    }
  }
  const bool any_bad = first_bad >= 0;
  if (any_bad && report[0] == 0) {
    const int64_t fb = first_bad / k;
    report[0] = 1;
    report[1] = fb;
    report[2] = first_bad % k;
    report[3] = static_cast<int64_t>(topk[first_bad]);
    report[4] = m(fb, 3);
    report[5] = m(fb, 0);
  }

  Scratch& s = scratch();
  s.mrank.resize(static_cast<size_t>(k));
  s.miss_pos.resize(static_cast<size_t>(k));
  s.chosen.resize(static_cast<size_t>(k));
  s.hit_rank.assign(static_cast<size_t>(hot), -1);
  int64_t total_valid = 0, total_miss = 0;

  for (int64_t b = 0; b < bp; ++b) {
    int32_t* const out_slots = slots + b * k;
    int64_t* const out_src = miss_src + b * k;
    int64_t* const out_dst = miss_dst + b * k;
    if (m(b, 4) == 0 || any_bad) {  // padding, or a call with an input error
      std::fill(out_slots, out_slots + k, -1);
      std::fill(out_src, out_src + k, -1);
      std::fill(out_dst, out_dst + k, -1);
      counts[b * 2] = counts[b * 2 + 1] = 0;
      if (b == 0) {  // the descriptors the other entries repeat: keep the last slot
        const int64_t keep = m(0, 0) * hot + hot - 1;
        std::fill(copy_src, copy_src + k, -1);
        std::fill(copy_dst, copy_dst + k, keep);
      }
      continue;  // other entries: entry 0's descriptors, written after the loop
    }
    const int64_t row = m(b, 0), stable = m(b, 2);
    Map* const ps = pos_slot + row * (cap + 1);
    int32_t* const sp = slot_pos + row * (hot + 1);
    int64_t* const st = stamp + row * (hot + 1);
    const bool fresh = tag[row] != m(b, 1);
    const int64_t clk = fresh ? 0 : clock[row];

    // A new request or positions at or past the stable length free their slots.
    for (int64_t h = 0; h < hot; ++h) {
      const int32_t p = sp[h];
      if (p >= 0 && (fresh || p >= stable)) {
        ps[p] = -1;
        sp[h] = -1;
        st[h] = 0;
      }
    }

    // Lookup; the first occurrence of a position counts. A missing position's map
    // entry holds -2 - (its miss rank) until the install below overwrites it.
    const TopK* const tk = topk + b * k;
    int32_t n_miss = 0, n_valid = 0;
    s.hits.clear();
    int32_t keep = -1;  // the slot of largest victim key: the newest hit, else the newest live
    for (int64_t i = 0; i < k; ++i) {
      const int64_t p = static_cast<int64_t>(tk[i]);
      s.mrank[i] = -1;
      if (p < 0) continue;
      ++n_valid;
      const int32_t v = static_cast<int32_t>(ps[p]);
      if (v >= 0) {
        if (s.hit_rank[v] < 0) {
          s.hit_rank[v] = static_cast<int32_t>(s.hits.size());
          s.hits.push_back(v);
          if (keep < 0 || st[v] > st[keep]) keep = v;
        }
      } else if (v == -1) {
        s.mrank[i] = n_miss;
        s.miss_pos[n_miss] = static_cast<int32_t>(p);
        ps[p] = static_cast<Map>(-2 - n_miss);
        ++n_miss;
      } else {
        s.mrank[i] = -2 - v;
      }
    }
    const int32_t n_hit = static_cast<int32_t>(s.hits.size());

    // Victims: free slots by index, then live slots not hit here by last touch.
    int32_t taken = 0;
    s.cand.clear();
    bool any_live = false;
    int32_t newest_live = -1;
    for (int64_t h = 0; h < hot; ++h) {
      if (sp[h] < 0) {
        if (taken < n_miss) s.chosen[taken++] = static_cast<int32_t>(h);
      } else if (s.hit_rank[h] < 0) {
        s.cand.emplace_back(st[h], static_cast<int32_t>(h));
        if (!any_live || st[h] > st[newest_live]) newest_live = static_cast<int32_t>(h);
        any_live = true;
      }
    }
    if (keep < 0) keep = any_live ? newest_live : static_cast<int32_t>(hot - 1);
    if (taken < n_miss) {
      const auto need = static_cast<std::ptrdiff_t>(n_miss - taken);
      sort_by_stamp(s.cand, s.tmp);
      for (std::ptrdiff_t j = 0; j < need; ++j) {
        const int32_t h = s.cand[static_cast<size_t>(j)].second;
        ps[sp[h]] = -1;  // evict
        s.chosen[taken++] = h;
      }
    }

    // Install the misses; touch the hits in top-k order, then the misses.
    for (int32_t j = 0; j < n_miss; ++j) {
      const int32_t h = s.chosen[j];
      ps[s.miss_pos[j]] = static_cast<Map>(h);
      sp[h] = s.miss_pos[j];
      st[h] = clk + 1 + n_hit + j;
    }
    for (int32_t r = 0; r < n_hit; ++r) {
      const int32_t h = s.hits[static_cast<size_t>(r)];
      st[h] = clk + 1 + r;
      s.hit_rank[h] = -1;
    }
    tag[row] = m(b, 1);
    clock[row] = clk + n_hit + n_miss;

    // Outputs.
    const int64_t base = row * hot;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t p = static_cast<int64_t>(tk[i]);
      out_slots[i] = p < 0 ? -1 : static_cast<int32_t>(base + static_cast<int64_t>(ps[p]));
    }
    const int32_t* const bt = block_table + b * width;
    int64_t* const c_src = copy_src + b * k;
    int64_t* const c_dst = copy_dst + b * k;
    for (int64_t j = 0; j < k; ++j) {
      if (j < n_miss) {
        const int64_t mp = s.miss_pos[j];
        const int64_t blk = bt[std::min(mp / bs, width - 1)];
        out_src[j] = c_src[j] = blk * bs + mp % bs;
        out_dst[j] = c_dst[j] = base + s.chosen[j];
      } else {
        out_src[j] = out_dst[j] = c_src[j] = -1;
        c_dst[j] = base + keep;
      }
    }
    counts[b * 2] = n_valid;
    counts[b * 2 + 1] = n_miss;
    total_valid += n_valid;
    total_miss += n_miss;
  }
  for (int64_t b = 1; b < bp; ++b) {
    if (m(b, 4) != 0 && !any_bad) continue;
    std::copy(copy_src, copy_src + k, copy_src + b * k);
    std::copy(copy_dst, copy_dst + k, copy_dst + b * k);
  }
  report[6] += total_valid;
  report[7] += total_miss;
}

}  // namespace

extern "C" {

// The number of int64 slots ao_dres_resolve's argument block has (native.py checks it).
int64_t ao_dres_num_args() { return kNumArgs; }

// One layer's resolve: `a` the argument block (see Arg), `topk` the layer's top-k.
// Three pointers: the fast-call trampoline's shape (fastcall.cpp). Returns 0, or -1
// for an argument block this build cannot run (element sizes).
int64_t ao_dres_resolve(const int64_t* a, const void* topk, const void*) {
  const int64_t map = a[kMapBytes], tk = a[kTopkBytes];
  if (map == 2 && tk == 8) {
    resolve<int16_t, int64_t>(a, static_cast<const int64_t*>(topk));
  } else if (map == 2 && tk == 4) {
    resolve<int16_t, int32_t>(a, static_cast<const int32_t*>(topk));
  } else if (map == 4 && tk == 8) {
    resolve<int32_t, int64_t>(a, static_cast<const int64_t*>(topk));
  } else if (map == 4 && tk == 4) {
    resolve<int32_t, int32_t>(a, static_cast<const int32_t*>(topk));
  } else {
    return -1;
  }
  return 0;
}

// The miss gather: hot[dst[i]] = pool[src[i]] for src[i] >= 0 (-1 keeps the hot row).
// `a` = {pool, pool_rows, hot, hot_rows, row_bytes}; `d` = {src, dst, n}. Returns 0,
// or -(i + 1) for the first descriptor outside its buffer (nothing copied from it on).
int64_t ao_dres_gather(const int64_t* a, const int64_t* d, const void*) {
  const char* const pool = reinterpret_cast<const char*>(static_cast<intptr_t>(a[0]));
  char* const hot = reinterpret_cast<char*>(static_cast<intptr_t>(a[2]));
  const int64_t pool_rows = a[1], hot_rows = a[3], rb = a[4];
  const int64_t* const src = reinterpret_cast<const int64_t*>(static_cast<intptr_t>(d[0]));
  const int64_t* const dst = reinterpret_cast<const int64_t*>(static_cast<intptr_t>(d[1]));
  const int64_t n = d[2];
  for (int64_t i = 0; i < n; ++i) {
    const int64_t sr = src[i], dr = dst[i];
    if (sr < 0) continue;
    if (sr >= pool_rows || dr < 0 || dr >= hot_rows) return -(i + 1);
    std::memcpy(hot + dr * rb, pool + sr * rb, static_cast<size_t>(rb));
  }
  return 0;
}

}  // extern "C"

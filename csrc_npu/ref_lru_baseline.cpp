// Benchmark baseline only (not used by the product): the reference Ascend
// host-side LRU design — per row a slot -> position array and a doubly linked
// LRU list of slots; per call ALL H slots are scanned against the top-k (hits
// move to the list front), then every miss takes the list tail.  Two top-k
// lookups: a hash map (lookup_kind 0, the straightforward choice) and a
// generation-tagged direct-address array (lookup_kind 1, the fastest honest
// one), so the comparison is not only against a strawman.  Not installed with
// the package: `ascend-offload bench sparse` compiles it from the checkout with
// the same compiler and flags as the product library.
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace {

struct BaseRow {
  bool init = false;
  std::vector<int32_t> slot_pos;  // -1 = free
  std::vector<int32_t> prev, next;
  int32_t head = -1, tail = -1;   // head = most recent
};

struct BaseTable {
  int32_t layers, rows, H;
  std::vector<BaseRow> state;
  int32_t lookup_kind;
  std::vector<uint32_t> mark_gen;  // position -> generation of the call that marked it
  std::vector<int32_t> mark_idx;   // position -> top-k index
  uint32_t gen = 0;
  std::unordered_map<int32_t, int32_t> where;  // lookup_kind 0: position -> top-k index
};

void unlink_slot(BaseRow& r, int32_t s) {
  if (r.prev[s] >= 0) r.next[r.prev[s]] = r.next[s]; else r.head = r.next[s];
  if (r.next[s] >= 0) r.prev[r.next[s]] = r.prev[s]; else r.tail = r.prev[s];
}

void push_front(BaseRow& r, int32_t s) {
  r.prev[s] = -1;
  r.next[s] = r.head;
  if (r.head >= 0) r.prev[r.head] = s;
  r.head = s;
  if (r.tail < 0) r.tail = s;
}

}  // namespace

extern "C" {

void* ao_base_create(int32_t layers, int32_t rows, int32_t H, int32_t lookup_kind) {
  BaseTable* t = new BaseTable{layers, rows, H, {}, lookup_kind, {}, {}, 0, {}};
  t->state.resize(size_t(layers) * rows);
  return t;
}

void ao_base_destroy(void* h) { delete static_cast<BaseTable*>(h); }

// Same inputs/outputs as ao_res_resolve (rows, top-k [B, K], block table);
// returns the total number of misses.
int64_t ao_base_resolve(void* h, int32_t layer, int32_t B, const int32_t* rows,
                        const int32_t* topk, int32_t K, const int32_t* block_table,
                        int32_t bt_stride, int32_t block_size, int32_t* out, int32_t* msrc,
                        int32_t* mdst) {
  BaseTable* t = static_cast<BaseTable*>(h);
  const int32_t H = t->H;
  int64_t total = 0;
  for (int32_t b = 0; b < B; ++b) {
    BaseRow& r = t->state[size_t(layer) * t->rows + rows[b]];
    if (!r.init) {
      r.slot_pos.assign(H, -1);
      r.prev.assign(H, -1);
      r.next.assign(H, -1);
      r.head = r.tail = -1;
      for (int32_t s = H - 1; s >= 0; --s) push_front(r, s);  // slot 0 at the tail
      r.init = true;
    }
    const int32_t* tk = topk + size_t(b) * K;
    int32_t* o = out + size_t(b) * K;
    const int32_t* bt = block_table + size_t(b) * bt_stride;
    const int32_t base = rows[b] * H;
    const uint32_t gen = ++t->gen;
    const bool hashed = t->lookup_kind == 0;
    if (hashed) t->where.clear();
    for (int32_t i = 0; i < K; ++i) {
      o[i] = -1;
      const int32_t p = tk[i];
      if (p < 0) continue;
      if (hashed) {
        t->where.emplace(p, i);
        continue;
      }
      if (size_t(p) >= t->mark_gen.size()) {
        t->mark_gen.resize(size_t(p) * 2 + 1, 0);
        t->mark_idx.resize(size_t(p) * 2 + 1, 0);
      }
      t->mark_gen[p] = gen;
      t->mark_idx[p] = i;
    }
    std::vector<char> hit(size_t(K), 0);
    for (int32_t s = 0; s < H; ++s) {  // the full scan of the hot buffer
      const int32_t p = r.slot_pos[s];
      if (p < 0) continue;
      int32_t i;
      if (hashed) {
        auto it = t->where.find(p);
        if (it == t->where.end()) continue;
        i = it->second;
      } else {
        if (size_t(p) >= t->mark_gen.size() || t->mark_gen[p] != gen) continue;
        i = t->mark_idx[p];
      }
      o[i] = base + s;
      hit[i] = 1;
      unlink_slot(r, s);
      push_front(r, s);
    }
    for (int32_t i = 0; i < K; ++i) {
      const int32_t p = tk[i];
      if (p < 0 || hit[i]) continue;
      const int32_t s = r.tail;  // least recently used
      unlink_slot(r, s);
      push_front(r, s);
      r.slot_pos[s] = p;
      o[i] = base + s;
      msrc[total] = bt[p / block_size] * block_size + p % block_size;
      mdst[total] = base + s;
      ++total;
    }
  }
  return total;
}

}  // extern "C"

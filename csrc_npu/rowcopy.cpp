// Batched row copy between host buffers: dst[didx[i]] = src[sidx[i]].
//
// Used for the miss-row onload on CPU, where the "device" hot buffer is host
// memory too.  Rows come from a large, cold pool in random order, so the cost
// is the first cache miss of every row; prefetching every line of a row a few
// rows ahead overlaps those misses (torch.index_select + index_copy_ does two
// passes and no prefetch).
//
// Long rows (over 4 KiB: store pages, a layer's KV block) are read with a
// software prefetch stream kStreamAhead bytes ahead of the copy, across the
// row's 4 KiB pages and on into the next row: the hardware streamer stops at
// every page boundary and never knows where the next (random) row starts.
// bench store's worker save (16 KiB layer blocks, random block ids -> pages,
// 2-vCPU Xeon VM, same process, alternating): 0.61-0.65x a contiguous copy of
// the same bytes with only the rows' first lines prefetched, 0.92-1.28x with
// an 8 KiB stream (1 KiB: 0.73-0.80; 4 KiB: 0.92-1.18).  Beside the stream,
// every 4 KiB page of the row two ahead gets one prefetch (prefetch_page_heads).
//
// Stores: non-temporal on x86 (no read-for-ownership of the destination
// line), 32 bytes at a time where the CPU has AVX2 and the rows are 32-byte
// aligned, else 16; memcpy elsewhere (aarch64, unaligned rows).  On Zen 4 the
// 32-byte streams moved random 1152-byte rows from a cold 256 MiB pool at
// 7.0-7.6 GB/s, against 4.6-6.7 GB/s with 16-byte streams and 5.5-6.6 GB/s
// with memcpy (standalone driver, same rows; docs/bench-sparse.md).
// ASCEND_OFFLOAD_NATIVE_SIMD=0 forces the 16-byte path (same bytes).
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define AO_X86 1
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// Two software prefetches per row: the rest of the row (from line kLines on)
// kFar rows ahead into L2 (prefetcht2), then its first kLines lines kAhead
// rows ahead into L1.  Why two: the far, L2-only requests keep more DRAM
// reads in flight without crowding L1's miss buffers, and the near ones
// make the head of the row ready when the copy reaches it.  Standalone
// driver, random 1152-byte rows from a cold 256 MiB pool into rotating hot
// buffers, Zen 4, same process, alternating: 9.4-10.7 GB/s against 7.0-8.0
// for the earlier 4 lines x 8 rows ahead into L1 only (0.75-0.78x the time);
// the far distance 12-20 and near 6-12 rows were within noise of it, every
// line into L1 was slower (1.1x), a non-temporal far hint too (1.1x).
constexpr int64_t kAhead = 8;
constexpr int64_t kLines = 2;
constexpr int64_t kFar = 16;

// prefetcht0, not prefetchnta: on Zen 3 the non-temporal hint fetched 1.2x
// slower for 1 KiB rows from a cold pool (docs/bench-sparse.md).
inline void prefetch_row(const uint8_t* p, int64_t row_bytes) {
  const int64_t end = row_bytes < kLines * 64 ? row_bytes : kLines * 64;
  for (int64_t off = 0; off < end; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// Only for rows of up to kFarMaxBytes: a 16-row lead of 1 MiB store pages would
// be 16 MiB ahead, far beyond L2 (evicted before use, each byte read twice);
// the hardware stream prefetcher covers long rows.
constexpr int64_t kFarMaxBytes = 4096;

inline void prefetch_rest(const uint8_t* p, int64_t row_bytes) {
  if (row_bytes > kFarMaxBytes) return;
  for (int64_t off = kLines * 64; off < row_bytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

// Both prefetches for rows [lo, lo + kFar) before the loop starts.
inline void prefetch_head(const uint8_t* src, const int32_t* sidx, int64_t lo, int64_t hi,
                          int64_t row_bytes) {
  for (int64_t i = lo; i < hi && i < lo + kFar; ++i) {
    const uint8_t* p = src + int64_t(sidx[i]) * row_bytes;
    prefetch_rest(p, row_bytes);
    if (i < lo + kAhead) prefetch_row(p, row_bytes);
  }
}

// Long rows: the prefetch stream's distance (see the top of this file).
constexpr int64_t kStreamAhead = 8192;
constexpr int64_t kChunk = 1024;  // long rows are copied in chunks, each after its prefetches

// The line kStreamAhead bytes past offset ``off`` of row ``s`` (or of the next row
// ``next``, if the stream has run past this one).
inline void prefetch_stream(const uint8_t* s, const uint8_t* next, int64_t off, int64_t row_bytes) {
  const int64_t ahead = off + kStreamAhead;
  if (ahead < row_bytes) {
    __builtin_prefetch(s + ahead, 0, 3);
  } else if (next != nullptr && ahead - row_bytes < row_bytes) {
    __builtin_prefetch(next + (ahead - row_bytes), 0, 3);
  }
}

// The stream's first kStreamAhead bytes: the head of the first row.
inline void prefetch_stream_start(const uint8_t* first, int64_t row_bytes) {
  for (int64_t off = 0; off < kStreamAhead && off < row_bytes; off += 64) {
    __builtin_prefetch(first + off, 0, 3);
  }
}

// Long rows of up to kPageHeadMaxBytes: one line of every 4 KiB page of the row
// kPageHeadRows ahead, into L2 (prefetcht2).  Why: the stream above reaches a
// random row's pages one after the other, each starting with a TLB walk and a
// DRAM row to open; touching every page of the row two ahead starts those
// early, overlapped with the copy of the current row.  bench store's worker
// save rows, same process, alternating with the stream alone (2-vCPU EPYC
// VM, three runs): 16 KiB rows 1.06-1.18x -> 1.13-1.28x a contiguous copy,
// 144 KiB rows 1.35-1.49x -> 1.49-1.57x; one row ahead more or a 2 KiB step
// were within noise of it, prefetcht0 did worse than prefetcht2.  Larger rows
// are left out: for 1 MiB store pages the row two ahead starts 2 MiB away, more
// than L2 holds, so its lines would be evicted before the copy reaches them.
constexpr int64_t kPageHeadRows = 2;
constexpr int64_t kPageHeadMaxBytes = 256 << 10;

inline void prefetch_page_heads(const uint8_t* src, const int32_t* sidx, int64_t i, int64_t hi,
                                int64_t row_bytes) {
  if (row_bytes > kPageHeadMaxBytes || i + kPageHeadRows >= hi) return;
  const uint8_t* p = src + int64_t(sidx[i + kPageHeadRows]) * row_bytes;
  for (int64_t off = 0; off < row_bytes; off += 4096) __builtin_prefetch(p + off, 0, 1);
}

inline const uint8_t* row_at(const uint8_t* src, const int32_t* sidx, int64_t i, int64_t hi,
                             int64_t row_bytes) {
  return i < hi ? src + int64_t(sidx[i]) * row_bytes : nullptr;
}

// Rows [lo, hi) of over kFarMaxBytes, copied kChunk bytes at a time behind the stream.
template <typename CopyRow>
__attribute__((always_inline)) inline void copy_long_with(
    const uint8_t* src, const int32_t* sidx, uint8_t* dst, const int32_t* didx, int64_t lo,
    int64_t hi, int64_t row_bytes, CopyRow copy_row) {
  if (lo >= hi) return;
  prefetch_stream_start(src + int64_t(sidx[lo]) * row_bytes, row_bytes);
  for (int64_t i = lo; i < hi; ++i) {
    uint8_t* d = dst + int64_t(didx[i]) * row_bytes;
    const uint8_t* s = src + int64_t(sidx[i]) * row_bytes;
    const uint8_t* next = row_at(src, sidx, i + 1, hi, row_bytes);
    prefetch_page_heads(src, sidx, i, hi, row_bytes);
    for (int64_t off = 0; off < row_bytes; off += kChunk) {
      const int64_t n = row_bytes - off < kChunk ? row_bytes - off : kChunk;
      for (int64_t line = 0; line < n; line += 64) prefetch_stream(s, next, off + line, row_bytes);
      copy_row(d + off, s + off, n);
    }
  }
}

// The prefetching loop over rows [lo, hi), with the row copy inlined into it (a
// call per row through a pointer cost 2-15 % of the throughput in a same-process
// A/B).  Used by the memcpy and 16-byte paths.
template <typename CopyRow>
__attribute__((always_inline)) inline void copy_range_with(
    const uint8_t* src, const int32_t* sidx, uint8_t* dst, const int32_t* didx, int64_t lo,
    int64_t hi, int64_t row_bytes, CopyRow copy_row) {
  if (row_bytes > kFarMaxBytes) {
    copy_long_with(src, sidx, dst, didx, lo, hi, row_bytes, copy_row);
    return;
  }
  prefetch_head(src, sidx, lo, hi, row_bytes);
  for (int64_t i = lo; i < hi; ++i) {
    if (i + kFar < hi) prefetch_rest(src + int64_t(sidx[i + kFar]) * row_bytes, row_bytes);
    if (i + kAhead < hi) prefetch_row(src + int64_t(sidx[i + kAhead]) * row_bytes, row_bytes);
    copy_row(dst + int64_t(didx[i]) * row_bytes, src + int64_t(sidx[i]) * row_bytes, row_bytes);
  }
}

using RangeCopy = void (*)(const uint8_t*, const int32_t*, uint8_t*, const int32_t*, int64_t,
                           int64_t, int64_t);

void copy_range_memcpy(const uint8_t* src, const int32_t* sidx, uint8_t* dst, const int32_t* didx,
                       int64_t lo, int64_t hi, int64_t row_bytes) {
  copy_range_with(src, sidx, dst, didx, lo, hi, row_bytes,
                  [](uint8_t* d, const uint8_t* s, int64_t n) { std::memcpy(d, s, size_t(n)); });
}

#ifdef AO_X86
struct Stream16 {
  void operator()(uint8_t* d, const uint8_t* s, int64_t n) const {
    for (int64_t off = 0; off < n; off += 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + off),
                       _mm_load_si128(reinterpret_cast<const __m128i*>(s + off)));
    }
  }
};

void copy_range_stream16(const uint8_t* src, const int32_t* sidx, uint8_t* dst,
                         const int32_t* didx, int64_t lo, int64_t hi, int64_t row_bytes) {
  copy_range_with(src, sidx, dst, didx, lo, hi, row_bytes, Stream16{});
  _mm_sfence();  // make the streamed rows visible before returning
}

// Long rows with 32-byte streams, written out like copy_range_stream32 (below).
__attribute__((target("avx2"))) void copy_long_stream32(const uint8_t* src, const int32_t* sidx,
                                                        uint8_t* dst, const int32_t* didx,
                                                        int64_t lo, int64_t hi,
                                                        int64_t row_bytes) {
  if (lo >= hi) return;
  prefetch_stream_start(src + int64_t(sidx[lo]) * row_bytes, row_bytes);
  for (int64_t i = lo; i < hi; ++i) {
    uint8_t* d = dst + int64_t(didx[i]) * row_bytes;
    const uint8_t* s = src + int64_t(sidx[i]) * row_bytes;
    const uint8_t* next = row_at(src, sidx, i + 1, hi, row_bytes);
    prefetch_page_heads(src, sidx, i, hi, row_bytes);
    for (int64_t off = 0; off < row_bytes; off += 32) {
      if ((off & 63) == 0) prefetch_stream(s, next, off, row_bytes);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + off),
                          _mm256_load_si256(reinterpret_cast<const __m256i*>(s + off)));
    }
  }
  _mm_sfence();
}

// Written out rather than through copy_range_with: inlining the AVX2 row copy into
// the template's default-target body is not allowed, and GCC unrolls this loop
// where it did not unroll the template's (~10 % faster in a same-process A/B).
__attribute__((target("avx2"))) void copy_range_stream32(const uint8_t* src, const int32_t* sidx,
                                                         uint8_t* dst, const int32_t* didx,
                                                         int64_t lo, int64_t hi,
                                                         int64_t row_bytes) {
  if (row_bytes > kFarMaxBytes) {
    copy_long_stream32(src, sidx, dst, didx, lo, hi, row_bytes);
    return;
  }
  prefetch_head(src, sidx, lo, hi, row_bytes);
  for (int64_t i = lo; i < hi; ++i) {
    if (i + kFar < hi) prefetch_rest(src + int64_t(sidx[i + kFar]) * row_bytes, row_bytes);
    if (i + kAhead < hi) prefetch_row(src + int64_t(sidx[i + kAhead]) * row_bytes, row_bytes);
    uint8_t* d = dst + int64_t(didx[i]) * row_bytes;
    const uint8_t* s = src + int64_t(sidx[i]) * row_bytes;
    for (int64_t off = 0; off < row_bytes; off += 32) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + off),
                          _mm256_load_si256(reinterpret_cast<const __m256i*>(s + off)));
    }
  }
  _mm_sfence();
}

bool use_avx2() {
  static const bool ok = [] {
    const char* env = std::getenv("ASCEND_OFFLOAD_NATIVE_SIMD");
    return __builtin_cpu_supports("avx2") && !(env && env[0] == '0');
  }();
  return ok;
}
#endif

// The widest row copy the CPU and the alignment of both buffers and the row allow.
RangeCopy pick_copy(const uint8_t* src, const uint8_t* dst, int64_t row_bytes) {
#ifdef AO_X86
  const uintptr_t a =
      reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | uintptr_t(row_bytes);
  if ((a & 31) == 0 && use_avx2()) return copy_range_stream32;
  if ((a & 15) == 0) return copy_range_stream16;
#else
  (void)src;
  (void)dst;
  (void)row_bytes;
#endif
  return copy_range_memcpy;
}

}  // namespace

extern "C" {

// Returns 0, or -(i + 1) for the first index outside [0, src_rows) / [0, dst_rows).
int64_t ao_copy_rows(const uint8_t* src, int64_t src_rows, const int32_t* sidx, uint8_t* dst,
                     int64_t dst_rows, const int32_t* didx, int64_t n, int64_t row_bytes,
                     int32_t nthreads) {
  for (int64_t i = 0; i < n; ++i) {
    if (sidx[i] < 0 || sidx[i] >= src_rows || didx[i] < 0 || didx[i] >= dst_rows) return -(i + 1);
  }
  const RangeCopy copy = pick_copy(src, dst, row_bytes);
  const int32_t nt = nthreads > 0 ? nthreads : 1;
  if (nt == 1 || n <= 256) {
    copy(src, sidx, dst, didx, 0, n, row_bytes);  // no parallel region (~1 us here)
    return 0;
  }
#pragma omp parallel num_threads(nt)
  {
    int64_t lo = 0, hi = n;
#ifdef _OPENMP
    const int64_t id = omp_get_thread_num(), cnt = omp_get_num_threads();
    lo = n * id / cnt;
    hi = n * (id + 1) / cnt;
#endif
    copy(src, sidx, dst, didx, lo, hi, row_bytes);
  }
  return 0;
}

// Every layer of a worker page pool in one call, one thread:
// dst_l[didx[i]] = src_l[sidx[i]] for each layer l, whose entry in ``table`` is
// {src, src_rows, dst, dst_rows, row_bytes} (int64).  Why one call: a save or load
// of a job copies the same rows of every layer, and a Python call per layer (with
// its checks) cost ~6 us each, 32-61 of them per job; the GIL is released once.
// Returns 0, or -(i + 1) for the first index pair out of range of some layer
// (checked for all layers before any byte moves).
int64_t ao_copy_rows_layers(const int64_t* table, int64_t layers, const int32_t* sidx,
                            const int32_t* didx, int64_t n) {
  int64_t src_rows = INT64_MAX, dst_rows = INT64_MAX;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t* e = table + 5 * l;
    if (e[1] < src_rows) src_rows = e[1];
    if (e[3] < dst_rows) dst_rows = e[3];
  }
  for (int64_t i = 0; i < n; ++i) {
    if (sidx[i] < 0 || sidx[i] >= src_rows || didx[i] < 0 || didx[i] >= dst_rows) return -(i + 1);
  }
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t* e = table + 5 * l;
    const auto* src = reinterpret_cast<const uint8_t*>(e[0]);
    auto* dst = reinterpret_cast<uint8_t*>(e[2]);
    pick_copy(src, dst, e[4])(src, sidx, dst, didx, 0, n, e[4]);
  }
  return 0;
}

// Rows that sit at a pitch wider than themselves (a field of each record of a staging
// buffer) into contiguous destination rows, every layer in one call, one thread:
// dst_l[didx[i]] = the row_bytes at src_l + sidx[i] * src_pitch_l, whose entry in
// ``table`` is {src, src_rows, src_pitch, dst, dst_rows, row_bytes} (int64).  Why:
// the SSD tier's O_DIRECT promote reads whole slots (header, then each layer's row)
// and a numpy copy a layer held the GIL 32-61 times a chunk.  A row at a time through
// the same streaming kernels (rows here are kilobytes).  Returns 0, or -(i + 1) for
// the first index pair out of range of some layer (checked before any byte moves).
int64_t ao_copy_rows_strided(const int64_t* table, int64_t layers, const int32_t* sidx,
                             const int32_t* didx, int64_t n) {
  int64_t src_rows = INT64_MAX, dst_rows = INT64_MAX;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t* e = table + 6 * l;
    if (e[2] < e[5] || e[5] < 0) return -1;  // rows would overlap: refuse the whole call
    if (e[1] < src_rows) src_rows = e[1];
    if (e[4] < dst_rows) dst_rows = e[4];
  }
  for (int64_t i = 0; i < n; ++i) {
    if (sidx[i] < 0 || sidx[i] >= src_rows || didx[i] < 0 || didx[i] >= dst_rows) return -(i + 1);
  }
  // Record by record, its layers in table order: the source is read front to back
  // (the hardware streams it), where layer by layer it jumped a pitch every row.
  static const int32_t zero = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t l = 0; l < layers; ++l) {
      const int64_t* e = table + 6 * l;
      const int64_t row = e[5];
      const uint8_t* s = reinterpret_cast<const uint8_t*>(e[0]) + int64_t(sidx[i]) * e[2];
      uint8_t* d = reinterpret_cast<uint8_t*>(e[3]) + int64_t(didx[i]) * row;
      pick_copy(s, d, row)(s, &zero, d, &zero, 0, 1, row);
    }
  }
  return 0;
}

}  // extern "C"

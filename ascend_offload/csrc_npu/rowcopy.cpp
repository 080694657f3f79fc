// Batched row copy between host buffers: dst[didx[i]] = src[sidx[i]].
//
// Used for the miss-row onload on CPU, where the "device" hot buffer is host
// memory too.  Rows come from a large, cold pool in random order, so the cost
// is the first cache miss of every row; prefetching every line of a row a few
// rows ahead overlaps those misses (torch.index_select + index_copy_ does two
// passes and no prefetch).
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#define AO_HAVE_SSE2 1
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int64_t kAhead = 16;  // rows prefetched ahead (measured best of 4/8/16 here)

// prefetcht0, not prefetchnta: on Zen 3 the non-temporal hint fetched 1.2x
// slower for 1 KiB rows from a cold pool (docs/bench-sparse.md).
inline void prefetch_row(const uint8_t* p, int64_t row_bytes) {
  for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// Non-temporal stores on x86 (no read-for-ownership of the destination line);
// plain memcpy elsewhere or when the row is not 16-byte aligned.
inline void copy_row(uint8_t* dst, const uint8_t* src, int64_t row_bytes) {
#ifdef AO_HAVE_SSE2
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | uintptr_t(row_bytes)) &
       15) == 0) {
    for (int64_t off = 0; off < row_bytes; off += 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + off),
                       _mm_load_si128(reinterpret_cast<const __m128i*>(src + off)));
    }
    return;
  }
#endif
  std::memcpy(dst, src, size_t(row_bytes));
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
  const int32_t nt = nthreads > 0 ? nthreads : 1;
#pragma omp parallel num_threads(nt) if (nt > 1 && n > 256)
  {
    int64_t lo = 0, hi = n;
#ifdef _OPENMP
    const int64_t id = omp_get_thread_num(), cnt = omp_get_num_threads();
    lo = n * id / cnt;
    hi = n * (id + 1) / cnt;
#endif
    for (int64_t i = lo; i < hi && i < lo + kAhead; ++i) prefetch_row(src + int64_t(sidx[i]) * row_bytes, row_bytes);
    for (int64_t i = lo; i < hi; ++i) {
      if (i + kAhead < hi) prefetch_row(src + int64_t(sidx[i + kAhead]) * row_bytes, row_bytes);
      copy_row(dst + int64_t(didx[i]) * row_bytes, src + int64_t(sidx[i]) * row_bytes, row_bytes);
    }
#ifdef AO_HAVE_SSE2
    _mm_sfence();  // make the streamed rows visible before returning
#endif
  }
  return 0;
}

}  // extern "C"

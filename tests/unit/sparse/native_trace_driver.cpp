// Deterministic trace through ao_res_resolve + ao_copy_rows; prints a checksum.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
extern "C" {
void* ao_res_create(int32_t, int32_t, int32_t);
int64_t ao_res_resolve(void*, int32_t, int32_t, const int32_t*, const int64_t*, const int32_t*, const int32_t*, const int32_t*, int32_t, const int32_t*, int32_t, int32_t, int32_t*, int32_t*, int32_t*, int32_t*, int32_t, int32_t*);
int32_t ao_res_release(void*, int32_t);
int32_t ao_res_simd_width();
int64_t ao_copy_rows(const uint8_t*, int64_t, const int32_t*, uint8_t*, int64_t, const int32_t*, int64_t, int64_t, int32_t);
}
static uint64_t st = 88172645463325252ull;
static uint32_t rnd() { st ^= st << 13; st ^= st >> 7; st ^= st << 17; return uint32_t(st); }
int main() {
  const int L = 2, R = 4, H = 64, K = 48, len0 = 700, bs = 16, nb = 64;
  void* h = ao_res_create(L, R, H);
  std::vector<int32_t> bt(R * nb); for (int i = 0; i < R * nb; i++) bt[i] = (i * 37) % (R * nb);
  std::vector<int32_t> rows(R), st_(R), lens(R), topk(R * K), out(R * K), ms(R * K), md(R * K), cnt(2 * R), err(2);
  std::vector<int64_t> tags(R, 1);
  uint64_t sum = 1469598103934665603ull;
  auto mix = [&](int64_t v) { sum = (sum ^ uint64_t(v)) * 1099511628211ull; };
  for (int step = 0; step < 3000; step++) {
    int B = 1 + rnd() % R; int layer = rnd() % L;
    for (int b = 0; b < B; b++) {
      rows[b] = (b + step) % R;
      if (rnd() % 50 == 0) tags[b]++;
      lens[b] = len0 + (rnd() % 200); st_[b] = lens[b] - (rnd() % 4);
      for (int i = 0; i < K; i++) { uint32_t r = rnd(); topk[b * K + i] = (r % 13 == 0) ? -1 : int32_t((r >> 4) % (r % 3 ? 120 : lens[b])); }
    }
    if (rnd() % 97 == 0) ao_res_release(h, rnd() % R);
    int64_t n = ao_res_resolve(h, layer, B, rows.data(), tags.data(), st_.data(), lens.data(), topk.data(), K, bt.data(), nb, bs, out.data(), ms.data(), md.data(), cnt.data(), 2, err.data());
    mix(n);
    for (int i = 0; i < B * K; i++) mix(out[i]);
    for (int64_t i = 0; i < n; i++) { mix(ms[i]); mix(md[i]); }
  }
  std::vector<uint8_t> src(1000 * 48), dst(300 * 48, 0); for (size_t i = 0; i < src.size(); i++) src[i] = uint8_t(i * 7);
  std::vector<int32_t> si(200), di(200); for (int i = 0; i < 200; i++) { si[i] = (i * 13) % 1000; di[i] = (i * 7) % 300; }
  mix(ao_copy_rows(src.data(), 1000, si.data(), dst.data(), 300, di.data(), 200, 48, 1));
  for (auto v : dst) mix(v);
  // 32-byte aligned 96-byte rows: the AVX2 streaming copy (SSE / memcpy elsewhere)
  uint8_t* a_src = static_cast<uint8_t*>(std::aligned_alloc(64, 500 * 96));
  uint8_t* a_dst = static_cast<uint8_t*>(std::aligned_alloc(64, 300 * 96));
  for (int i = 0; i < 500 * 96; i++) a_src[i] = uint8_t(i * 11 + 3);
  for (int i = 0; i < 300 * 96; i++) a_dst[i] = 0;
  for (int i = 0; i < 200; i++) { si[i] = (i * 17) % 500; di[i] = (i * 3) % 300; }
  mix(ao_copy_rows(a_src, 500, si.data(), a_dst, 300, di.data(), 200, 96, 1));
  for (int i = 0; i < 300 * 96; i++) mix(a_dst[i]);
  std::free(a_src);
  std::free(a_dst);
  printf("%016llx\n", (unsigned long long)sum);
  fprintf(stderr, "simd=%d\n", ao_res_simd_width());
}

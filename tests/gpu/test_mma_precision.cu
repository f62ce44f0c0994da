// What the FP8 tensor cores do to one 32-wide dot product (one MX block), measured against the exact
// sum: E2M1-valued operands must be exact (their products and sums fit easily in fp32); for E4M3
// the test records how far the hardware's accumulation is from the correctly rounded fp32 sum.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test.hpp"

#include <cmath>
#include <vector>

#include "cuda/ptx/mma.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"
#include "dmattn/synthetic.hpp"

using namespace dmattn;

namespace {
__global__ void one_mma(const uint32_t* a, const uint32_t* b, float* d) {
  const int lane = threadIdx.x;
  uint32_t af[4] = {a[lane * 4], a[lane * 4 + 1], a[lane * 4 + 2], a[lane * 4 + 3]};
  float out[4];
  cuda::mma_fp8_block<false>(out, af, b[lane * 2], b[lane * 2 + 1]);
  for (int i = 0; i < 4; ++i) d[lane * 4 + i] = out[i];
}

// Runs one m16n8k32 E4M3 MMA over A (16x32) and B (32x8) given as E4M3 codes; returns D (16x8).
std::vector<float> run_mma(const std::vector<uint8_t>& A, const std::vector<uint8_t>& B) {
  std::vector<uint32_t> af(32 * 4), bf(32 * 2);
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int r = 0; r < 4; ++r) {
      const int row = g + (r % 2) * 8, k0 = t * 4 + (r / 2) * 16;
      uint32_t w = 0;
      for (int i = 0; i < 4; ++i) w |= uint32_t(A[row * 32 + k0 + i]) << (8 * i);
      af[lane * 4 + r] = w;
    }
    for (int r = 0; r < 2; ++r) {
      uint32_t w = 0;
      for (int i = 0; i < 4; ++i) w |= uint32_t(B[(t * 4 + r * 16 + i) * 8 + g]) << (8 * i);
      bf[lane * 2 + r] = w;
    }
  }
  uint32_t *da, *db;
  float* dd;
  cudaMalloc(&da, af.size() * 4);
  cudaMalloc(&db, bf.size() * 4);
  cudaMalloc(&dd, 128 * 4);
  cudaMemcpy(da, af.data(), af.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(db, bf.data(), bf.size() * 4, cudaMemcpyHostToDevice);
  one_mma<<<1, 32>>>(da, db, dd);
  std::vector<float> lanes(128), D(128);
  cudaMemcpy(lanes.data(), dd, 128 * 4, cudaMemcpyDeviceToHost);
  cudaFree(da);
  cudaFree(db);
  cudaFree(dd);
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) D[(g + (i / 2) * 8) * 8 + t * 2 + i % 2] = lanes[lane * 4 + i];
  }
  return D;
}

double max_error_ulps(bool fp4_values, uint64_t seed, int* inexact) {
  Rng rng(seed);
  std::vector<uint8_t> A(16 * 32), B(32 * 8);
  auto pick = [&] {
    const uint8_t c = uint8_t(rng.next_u64() % (fp4_values ? 16 : 256));
    if (fp4_values) return encode_elem(Elem::e4m3, decode_elem(Elem::e2m1, c));
    return (c & 0x7F) == 0x7F ? uint8_t(0) : c;  // skip NaN codes
  };
  for (auto& x : A) x = pick();
  for (auto& x : B) x = pick();
  const std::vector<float> D = run_mma(A, B);
  double worst = 0;
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      double exact = 0, mag = 0;
      for (int k = 0; k < 32; ++k) {
        const double p = double(decode_elem(Elem::e4m3, A[m * 32 + k])) * decode_elem(Elem::e4m3, B[k * 8 + n]);
        exact += p;
        mag = std::max(mag, std::fabs(p));
      }
      const float rounded = float(exact);
      if (D[m * 8 + n] != rounded) ++*inexact;
      // Error in units of the fp32 ulp of the largest product (the scale the accumulator works at).
      const double ulp = std::ldexp(1.0, std::ilogb(mag == 0 ? 1.0 : mag) - 23);
      worst = std::max(worst, std::fabs(D[m * 8 + n] - exact) / ulp);
    }
  return worst;
}
// One warpgroup: A and B are [64 rows][128 bytes] E4M3 codes (four 32-wide blocks each). out[0..3]:
// the 64x64 block dots of blocks c = 0..3, each one wgmma into a fresh accumulator; out[4]: all four
// as one wgmma chain. Row-major [64][64] each.
__global__ void wgmma_dots(const uint8_t* a, const uint8_t* b, float* out) {
  __shared__ __align__(1024) uint8_t sa[64 * 128], sb[64 * 128];
  for (int i = threadIdx.x; i < 64 * 128; i += 128) {
    sa[cuda::wg::swizzled<128>(i / 128, i % 128)] = a[i];
    sb[cuda::wg::swizzled<128>(i / 128, i % 128)] = b[i];
  }
  cuda::wg::fence_async_smem();
  __syncthreads();
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  for (int c = 0; c <= 4; ++c) {
    float d[32];
    for (int i = 0; i < 32; ++i) d[i] = 0.0f;
    cuda::wg::fence();
    for (int k = (c == 4 ? 0 : c); k <= (c == 4 ? 3 : c); ++k)
      cuda::wg::mma_fp8<64, false>(d, cuda::wg::desc<128>(sa, k * 32), cuda::wg::desc<128>(sb, k * 32), k != (c == 4 ? 0 : c));
    cuda::wg::commit();
    cuda::wg::wait<0>();
    cuda::wg::pin(d);
    for (int i = 0; i < 32; ++i)
      out[c * 4096 + (16 * warp + g + 8 * ((i / 2) % 2)) * 64 + 8 * (i / 4) + 2 * t + i % 2] = d[i];
  }
}

// The decode's P.V with V in MXFP4: V^T's E2M1 codes placed as f16 (e2m1x8_to_f16x4, values x 2^-14,
// the codes of 0.5 as f16 subnormals) times P^T in f16, two m16n8k16. a: per lane the storage words of
// rows g and g + 8; b: per lane the four f16x2 B words (keys 8q + 2t, +1 of column g).
__global__ void placed_mma(const uint32_t* a, const uint32_t* b, float* d) {
  const int lane = threadIdx.x;
  uint32_t fl[4], fh[4];
  cuda::e2m1x8_to_f16x4(a[lane * 2], fl);
  cuda::e2m1x8_to_f16x4(a[lane * 2 + 1], fh);
  const uint32_t a1[4] = {fl[0], fh[0], fl[1], fh[1]}, a2[4] = {fl[2], fh[2], fl[3], fh[3]};
  const uint32_t bf[4] = {b[lane * 4], b[lane * 4 + 1], b[lane * 4 + 2], b[lane * 4 + 3]};
  float out[4];
  cuda::mma_f16_block(out, a1, a2, bf);
  for (int i = 0; i < 4; ++i) d[lane * 4 + i] = out[i];
}

// One 16x8 tile of E2M1 A (codes) times B (E4M3 codes, or E2M1 values as E4M3): returns (placed f16 path
// x 2^14, the E4M3 path it replaced (run_mma on A widened to E4M3), exact sum), each [16][8].
struct PlacedResult {
  std::vector<float> placed, fp8;
  std::vector<double> exact;
};
PlacedResult run_placed(const std::vector<uint8_t>& A, const std::vector<uint8_t>& B) {
  std::vector<uint32_t> af(64), bf(128);
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int h = 0; h < 2; ++h) {
      uint8_t codes[8];
      for (int j = 0; j < 8; ++j) codes[j] = A[(g + 8 * h) * 32 + 8 * (j / 2) + 2 * t + j % 2];
      af[lane * 2 + h] = cuda::e2m1x8_f16_pack(codes);
    }
    for (int q = 0; q < 4; ++q) {
      auto f16 = [&](int k) { return uint32_t(to_fp16(decode_elem(Elem::e4m3, B[k * 8 + g])).bits); };
      bf[lane * 4 + q] = f16(8 * q + 2 * t) | f16(8 * q + 2 * t + 1) << 16;
    }
  }
  uint32_t *da, *db;
  float* dd;
  cudaMalloc(&da, 64 * 4);
  cudaMalloc(&db, 128 * 4);
  cudaMalloc(&dd, 128 * 4);
  cudaMemcpy(da, af.data(), 64 * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(db, bf.data(), 128 * 4, cudaMemcpyHostToDevice);
  cudaMemset(dd, 0xFF, 128 * 4);  // poisoned: NaN unless written
  placed_mma<<<1, 32>>>(da, db, dd);
  std::vector<float> lanes(128);
  cudaMemcpy(lanes.data(), dd, 128 * 4, cudaMemcpyDeviceToHost);
  for (void* p : {(void*)da, (void*)db, (void*)dd}) cudaFree(p);
  std::vector<uint8_t> A8(A.size());
  for (size_t i = 0; i < A.size(); ++i) A8[i] = encode_elem(Elem::e4m3, decode_elem(Elem::e2m1, A[i]));
  PlacedResult r{std::vector<float>(128), run_mma(A8, B), std::vector<double>(128, 0.0)};
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i)
      r.placed[size_t((lane / 4 + (i / 2) * 8) * 8 + (lane % 4) * 2 + i % 2)] = std::ldexp(lanes[size_t(lane * 4 + i)], 14);
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n)
      for (int k = 0; k < 32; ++k)
        r.exact[size_t(m * 8 + n)] += double(decode_elem(Elem::e2m1, A[m * 32 + k])) * decode_elem(Elem::e4m3, B[k * 8 + n]);
  return r;
}

struct DotStats {
  int inexact = 0, total = 0;
  double worst_rel = 0;  // |got - exact| / (sum of |products|): the accumulator's own error
  void add(float got, double exact, double mag) {
    ++total;
    inexact += got != float(exact);
    if (mag > 0) worst_rel = std::max(worst_rel, std::fabs(got - exact) / mag);
  }
};

// Codes per class: 0 = random E4M3 values of an MX block (normal data scaled so the block's amax
// is near 448); 1 = E2M1 values; 2 = E2M1 values shifted down by 2^0..2^-8 per (row, block), as
// folding makes them.
void wgmma_precision(int cls, uint64_t seed, DotStats& single, DotStats& chain) {
  Rng rng(seed);
  std::vector<uint8_t> A(64 * 128), B(64 * 128);
  for (auto* m : {&A, &B})
    for (int r = 0; r < 64; ++r)
      for (int c = 0; c < 4; ++c) {
        const int shift = cls == 2 ? -int(rng.next_u64() % 9) : 0;
        for (int k = 0; k < 32; ++k) {
          float v = cls == 0 ? float(rng.normal() * 160.0) : decode_elem(Elem::e2m1, uint8_t(rng.next_u64() % 16));
          (*m)[size_t(r * 128 + c * 32 + k)] = encode_elem(Elem::e4m3, std::ldexp(v, shift));
        }
      }
  uint8_t *da, *db;
  float* dout;
  cudaMalloc(&da, A.size());
  cudaMalloc(&db, B.size());
  cudaMalloc(&dout, 5 * 4096 * sizeof(float));
  cudaMemcpy(da, A.data(), A.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(db, B.data(), B.size(), cudaMemcpyHostToDevice);
  wgmma_dots<<<1, 128>>>(da, db, dout);
  std::vector<float> out(5 * 4096);
  cudaMemcpy(out.data(), dout, out.size() * sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(da);
  cudaFree(db);
  cudaFree(dout);
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < 64; ++n) {
      double all = 0, all_mag = 0;
      for (int c = 0; c < 4; ++c) {
        double exact = 0, mag = 0;
        for (int k = 0; k < 32; ++k) {
          const double p = double(decode_elem(Elem::e4m3, A[size_t(m * 128 + c * 32 + k)])) *
                           decode_elem(Elem::e4m3, B[size_t(n * 128 + c * 32 + k)]);
          exact += p;
          mag += std::fabs(p);
        }
        single.add(out[size_t(c * 4096 + m * 64 + n)], exact, mag);
        all += exact;
        all_mag += mag;
      }
      chain.add(out[size_t(4 * 4096 + m * 64 + n)], all, all_mag);
    }
}
}  // namespace

// wgmma (the prefill kernel's instruction) on the value classes the kernel feeds it. The property
// the kernel relies on: E2M1 values (as MXFP4 tiles carry them, unfolded) sum exactly in one
// block. Everything else is recorded: Hopper's FP8 wgmma keeps fewer accumulator bits than fp32.
TEST(GpuMma, WgmmaFp8DotPrecision) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const char* names[3] = {"E4M3 MX block values", "E2M1 values", "E2M1 values shifted <= 2^-8"};
  for (int cls = 0; cls < 3; ++cls) {
    DotStats single, chain;
    for (uint64_t s = 0; s < 4; ++s) wgmma_precision(cls, 77 * cls + s, single, chain);
    std::printf("wgmma %-28s one block: %5d of %d inexact (worst %.2e of sum|p|); 4-block chain: %5d of %d (worst %.2e)\n",
                names[cls], single.inexact, single.total, single.worst_rel, chain.inexact, chain.total, chain.worst_rel);
    if (cls == 1) EXPECT_EQ(single.inexact, 0);
  }
}

TEST(GpuMma, Fp8BlockDotPrecision) {
  SKIP_WITHOUT_CUDA_DEVICE();
  int inexact4 = 0, inexact8 = 0;
  double worst4 = 0, worst8 = 0;
  for (uint64_t s = 0; s < 50; ++s) {
    worst4 = std::max(worst4, max_error_ulps(true, s, &inexact4));
    worst8 = std::max(worst8, max_error_ulps(false, 1000 + s, &inexact8));
  }
  std::printf("E2M1-valued: %d of 6400 dots differ from the correctly rounded fp32 sum (worst %.2f ulp)\n", inexact4, worst4);
  std::printf("E4M3:        %d of 6400 dots differ from the correctly rounded fp32 sum (worst %.2f ulp of the largest product)\n",
              inexact8, worst8);
  EXPECT_EQ(inexact4, 0);
}

// The placed-f16 E2M1 path (the decode's P.V with V in MXFP4): with E2M1-valued B it is exact (so the
// f16 mma keeps the subnormal codes), and with E4M3 B it is bit for bit 2^-14 times the E4M3 path it
// replaced (the same mma on operands scaled by a power of two).
TEST(GpuMma, PlacedE2M1F16BlockDot) {
  SKIP_WITHOUT_CUDA_DEVICE();
  int differ = 0, inexact = 0;
  for (uint64_t s = 0; s < 50; ++s) {
    Rng rng(500 + s);
    std::vector<uint8_t> A(16 * 32), B(32 * 8);
    for (auto& x : A) x = uint8_t(rng.next_u64() % 16);
    const bool e2m1_b = s % 2 == 0;
    for (auto& x : B) {
      const uint8_t c = uint8_t(rng.next_u64() % 256);
      x = e2m1_b ? encode_elem(Elem::e4m3, decode_elem(Elem::e2m1, c % 16)) : ((c & 0x7F) == 0x7F ? uint8_t(0) : c);
    }
    const PlacedResult r = run_placed(A, B);
    for (int i = 0; i < 128; ++i) {
      differ += !(r.placed[size_t(i)] == r.fp8[size_t(i)]);  // NaN (an unwritten output) counts too
      if (e2m1_b) inexact += !(double(r.placed[size_t(i)]) == r.exact[size_t(i)]);
    }
  }
  std::printf("placed f16 E2M1 dots: %d of 6400 differ from the E4M3 path; %d of 3200 E2M1 x E2M1 inexact\n", differ, inexact);
  EXPECT_EQ(differ, 0);
  EXPECT_EQ(inexact, 0);
}

// The CUDA decode kernel (cuda::decode_attention, not yet dispatched to by decode_attention) against
// the CPU decode (the oracle) on the same cache: rel. L2 <= 1e-5 and LSE, for ragged batches, GQA,
// several policies, one and several splits; outputs poisoned first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test.hpp"

#include <cmath>
#include <cstdio>
#include <limits>

#include "dmattn/error.hpp"
#include "dmattn/kv_cache.hpp"
#include "dmattn/metrics.hpp"
#include "dmattn/synthetic.hpp"
#include "problem.hpp"

using namespace dmattn;

TEST(GpuDecode, MatchesCpuDecode) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const Format e4 = Format::mxfp8_e4m3, f4 = Format::mxfp4;
  for (int64_t d : {64, 128})
    for (const Policy& pol : {Policy{}, Policy{e4, f4, 2, 1}, Policy{Format::mxfp8_e5m2, Format::mxfp6_e3m2, 1, 0}}) {
      const int64_t Hkv = 2, Hq = 8, Nq = 5, lens[3] = {5, 700, 1301};
      KVCache cache(Hkv, d, pol);
      std::vector<int> ids;
      for (int i = 0; i < 3; ++i) {
        const QKV x = llm_like_qkv({1, Hq, Hkv, lens[i], lens[i], d}, uint64_t(10 * d + i));
        ids.push_back(cache.new_sequence());
        cache.append(ids.back(), slice_tokens(x.k.view(), 0, lens[i] / 2), slice_tokens(x.v.view(), 0, lens[i] / 2));
        cache.append(ids.back(), slice_tokens(x.k.view(), lens[i] / 2, lens[i] - lens[i] / 2),
                     slice_tokens(x.v.view(), lens[i] / 2, lens[i] - lens[i] / 2));
      }
      const QKV qs = random_qkv({3, Hq, Hkv, Nq, Nq, d}, uint64_t(d), DType::f32, 2.0f);
      for (int splits : {1, 3}) {
        DecodeOptions o;
        o.splits = splits;
        HostTensor want(DType::f32, qs.q.shape());
        std::vector<float> want_lse(size_t(3 * Hq * Nq)), got_lse(want_lse.size());
        decode_attention(cache, ids, qs.q.view(), want.view(), want_lse.data(), o);
        void *dq, *dout;
        float* dlse;
        CUDA_OK(cudaMalloc(&dq, qs.q.nbytes()));
        CUDA_OK(cudaMalloc(&dout, want.nbytes()));
        CUDA_OK(cudaMalloc(&dlse, want_lse.size() * 4));
        CUDA_OK(cudaMemcpy(dq, qs.q.bytes(), qs.q.nbytes(), cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemset(dout, 0xFF, want.nbytes()));  // NaN poison
        CUDA_OK(cudaMemset(dlse, 0xFF, want_lse.size() * 4));
        const float scale = 1.0f / std::sqrt(float(d));
        cuda::decode_attention(cache, ids, TensorView::contiguous(dq, DType::f32, qs.q.shape(), Device::cuda),
                               TensorView::contiguous(dout, DType::f32, qs.q.shape(), Device::cuda), dlse, scale, splits);
        HostTensor got(DType::f32, qs.q.shape());
        CUDA_OK(cudaMemcpy(got.bytes(), dout, got.nbytes(), cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(got_lse.data(), dlse, got_lse.size() * 4, cudaMemcpyDeviceToHost));
        const Comparison c = compare(got.to_floats(), want.to_floats());
        std::printf("decode d=%lld %s splits=%d: rel_l2 %.3e\n", (long long)d, pol.describe().c_str(), splits, c.rel_l2);
        EXPECT_EQ(c.nan_count, 0);
        EXPECT_LE(c.rel_l2, 1e-5);
        for (size_t i = 0; i < want_lse.size(); ++i)
          ASSERT_NEAR(got_lse[i], want_lse[i], 1e-5f * (1 + std::fabs(want_lse[i]))) << "row " << i;
        // A NaN query is an error, not a NaN output.
        float nan = std::numeric_limits<float>::quiet_NaN();
        CUDA_OK(cudaMemcpy(dq, &nan, 4, cudaMemcpyHostToDevice));
        EXPECT_THROW(cuda::decode_attention(cache, ids, TensorView::contiguous(dq, DType::f32, qs.q.shape(), Device::cuda),
                                            TensorView::contiguous(dout, DType::f32, qs.q.shape(), Device::cuda), dlse,
                                            scale, splits),
                     Error);
        cudaFree(dq);
        cudaFree(dout);
        cudaFree(dlse);
      }
    }
}

// GGUF reader: a file written here with every metadata type and every supported tensor type,
// read back and dequantised against hand-computed values; malformed files rejected; the real
// model's header when it has been fetched.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "dmattn/error.hpp"
#include "dmattn/numeric.hpp"
#include "dmattn/synthetic.hpp"
#include "model/gguf.hpp"

using namespace dmattn;
using namespace dmattn::model;

namespace {

// A minimal GGUF writer for tests.
struct Writer {
  std::vector<uint8_t> b;
  template <class T>
  void put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
  }
  void str(const std::string& s) {
    put<uint64_t>(s.size());
    b.insert(b.end(), s.begin(), s.end());
  }
  void pad(size_t align) {
    while (b.size() % align) b.push_back(0);
  }
};

void put_half(std::vector<uint8_t>& b, float x) {
  const uint16_t h = to_fp16(x).bits;
  b.push_back(uint8_t(h & 0xFF));
  b.push_back(uint8_t(h >> 8));
}

struct Built {
  std::vector<uint8_t> bytes;
  std::vector<float> f32, f16, q40, q41, q80;  // expected values
};

Built build() {
  Built out;
  Writer w;
  w.put<uint32_t>(0x46554747u);
  w.put<uint32_t>(3);
  w.put<uint64_t>(5);  // tensors
  w.put<uint64_t>(6);  // metadata
  w.str("a.u32"); w.put<uint32_t>(4); w.put<uint32_t>(123456);
  w.str("a.i8"); w.put<uint32_t>(1); w.put<int8_t>(-7);
  w.str("a.f32"); w.put<uint32_t>(6); w.put<float>(0.25f);
  w.str("a.bool"); w.put<uint32_t>(7); w.put<uint8_t>(1);
  w.str("a.str"); w.put<uint32_t>(8); w.str("hello");
  w.str("a.arr"); w.put<uint32_t>(9); w.put<uint32_t>(8); w.put<uint64_t>(2); w.str("x y"); w.str("z");
  // Tensor data, each 64 elements (2 blocks), built alongside its expected values.
  std::vector<uint8_t> data;
  auto align = [&] { while (data.size() % 32) data.push_back(0); };
  std::vector<uint64_t> offs;
  Rng rng(3);
  offs.push_back(data.size());
  for (int i = 0; i < 64; ++i) {
    const float v = float(rng.normal());
    out.f32.push_back(v);
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    data.insert(data.end(), p, p + 4);
  }
  align();
  offs.push_back(data.size());
  for (int i = 0; i < 64; ++i) {
    const float v = float(i) * 0.5f - 7.0f;  // exact in fp16
    out.f16.push_back(v);
    put_half(data, v);
  }
  align();
  offs.push_back(data.size());
  for (int blk = 0; blk < 2; ++blk) {  // Q4_0: d = 0.5 (block 0) / 2 (block 1), nibbles 0..15
    const float d = blk ? 2.0f : 0.5f;
    put_half(data, d);
    std::vector<float> vals(32);
    for (int j = 0; j < 16; ++j) {
      const int lo = j, hi = 15 - j;
      data.push_back(uint8_t(lo | (hi << 4)));
      vals[j] = float(lo - 8) * d;
      vals[j + 16] = float(hi - 8) * d;
    }
    out.q40.insert(out.q40.end(), vals.begin(), vals.end());
  }
  align();
  offs.push_back(data.size());
  for (int blk = 0; blk < 2; ++blk) {  // Q4_1: d = 0.25, m = -1 / 3
    const float d = 0.25f, m = blk ? 3.0f : -1.0f;
    put_half(data, d);
    put_half(data, m);
    std::vector<float> vals(32);
    for (int j = 0; j < 16; ++j) {
      const int lo = (j * 3) % 16, hi = (j * 7 + 1) % 16;
      data.push_back(uint8_t(lo | (hi << 4)));
      vals[j] = float(lo) * d + m;
      vals[j + 16] = float(hi) * d + m;
    }
    out.q41.insert(out.q41.end(), vals.begin(), vals.end());
  }
  align();
  offs.push_back(data.size());
  for (int blk = 0; blk < 2; ++blk) {  // Q8_0: d = 0.125
    put_half(data, 0.125f);
    for (int j = 0; j < 32; ++j) {
      const int8_t q = int8_t(j * 8 - 128 + blk);
      data.push_back(uint8_t(q));
      out.q80.push_back(float(q) * 0.125f);
    }
  }
  const char* names[5] = {"t.f32", "t.f16", "t.q4_0", "t.q4_1", "t.q8_0"};
  const uint32_t types[5] = {0, 1, 2, 3, 8};
  for (int i = 0; i < 5; ++i) {
    w.str(names[i]);
    w.put<uint32_t>(2);
    w.put<uint64_t>(32);
    w.put<uint64_t>(2);
    w.put<uint32_t>(types[i]);
    w.put<uint64_t>(offs[size_t(i)]);
  }
  w.pad(32);
  w.b.insert(w.b.end(), data.begin(), data.end());
  out.bytes = w.b;
  return out;
}

}  // namespace

TEST(Gguf, ReadsMetadataAndDequantizesEveryType) {
  const Built b = build();
  const Gguf g = Gguf::parse(b.bytes, "test.gguf");
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(g.get_int("a.u32"), 123456);
  EXPECT_EQ(g.get_int("a.i8"), -7);
  EXPECT_EQ(g.get_float("a.f32"), 0.25);
  EXPECT_EQ(g.get_int("a.bool"), 1);
  EXPECT_EQ(g.get_string("a.str"), "hello");
  EXPECT_EQ(g.get_strings("a.arr"), (std::vector<std::string>{"x y", "z"}));
  EXPECT_THROW(g.get_int("a.str"), Error);
  EXPECT_THROW(g.get_string("missing"), Error);
  EXPECT_EQ(g.tensor("t.q4_1").dims, (std::vector<int64_t>{32, 2}));
  EXPECT_EQ(g.dequantize("t.f32"), b.f32);
  EXPECT_EQ(g.dequantize("t.f16"), b.f16);
  EXPECT_EQ(g.dequantize("t.q4_0"), b.q40);
  EXPECT_EQ(g.dequantize("t.q4_1"), b.q41);
  EXPECT_EQ(g.dequantize("t.q8_0"), b.q80);
  EXPECT_THROW(g.dequantize("t.nothing"), Error);
}

TEST(Gguf, RejectsMalformedFiles) {
  const Built b = build();
  // Every truncation of the file fails cleanly (or, past the header, at the tensor bounds check).
  for (size_t n = 0; n < b.bytes.size(); n += 7) {
    std::vector<uint8_t> cut(b.bytes.begin(), b.bytes.begin() + long(n));
    EXPECT_THROW(Gguf::parse(cut, "cut"), Error) << n;
  }
  auto with = [&](size_t at, uint64_t value, size_t width) {
    std::vector<uint8_t> c = b.bytes;
    std::memcpy(c.data() + at, &value, width);
    return c;
  };
  EXPECT_THROW(Gguf::parse(with(0, 0x12345678, 4), "magic"), Error);
  EXPECT_THROW(Gguf::parse(with(4, 9, 4), "version"), Error);
  EXPECT_THROW(Gguf::parse(with(8, uint64_t(1) << 60, 8), "tensors"), Error);
  EXPECT_THROW(Gguf::parse(with(16, uint64_t(1) << 60, 8), "kv"), Error);
  EXPECT_THROW(Gguf::parse(with(24, uint64_t(1) << 62, 8), "key length"), Error);
}

TEST(Gguf, RealModelHeader) {
  const char* path = ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  const std::string full = std::string(DMATTN_SOURCE_DIR) + "/" + path;
  if (!std::filesystem::exists(full)) GTEST_SKIP() << "model not fetched (bash scripts/fetch_model.sh)";
  const Gguf g = Gguf::load(full);
  EXPECT_EQ(g.get_string("general.architecture"), "llama");
  EXPECT_EQ(g.get_int("llama.block_count"), 30);
  EXPECT_EQ(g.get_int("llama.attention.head_count"), 9);
  EXPECT_EQ(g.get_int("llama.attention.head_count_kv"), 3);
  EXPECT_EQ(g.get_strings("tokenizer.ggml.tokens").size(), 49152u);
  EXPECT_EQ(g.tensors().size(), 272u);
  const std::vector<float> norm = g.dequantize("blk.0.attn_norm.weight");
  EXPECT_EQ(norm.size(), 576u);
  for (float x : norm) EXPECT_TRUE(std::isfinite(x));
}

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "dmattn/error.hpp"
#include "dmattn/npy.hpp"

using namespace dmattn;

namespace {
std::string tmp(const std::string& name) { return (std::filesystem::temp_directory_path() / ("dmattn_npy_" + name)).string(); }
void write_raw(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }
}  // namespace

TEST(Npy, RoundTripAllTypes) {
  const std::vector<float> f = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, -8.5f};
  write_npy(tmp("f.npy"), NpyType::f32, {2, 3}, f.data());
  NpyArray a = read_npy(tmp("f.npy"));
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(npy_to_floats(a), f);
  const std::vector<uint8_t> u = {1, 2, 255};
  write_npy(tmp("u.npy"), NpyType::u8, {3}, u.data());
  a = read_npy(tmp("u.npy"));
  EXPECT_EQ(a.type, NpyType::u8);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(npy_to_floats(a)[2], 255.0f);
  // The header block is a multiple of 64 bytes, as numpy requires.
  std::ifstream in(tmp("u.npy"), std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ((all.size() - 3) % 64, 0u);
}

TEST(Npy, RejectsBadFiles) {
  EXPECT_THROW(read_npy(tmp("does_not_exist.npy")), Error);
  write_raw(tmp("garbage.npy"), "hello world, not numpy");
  EXPECT_THROW(read_npy(tmp("garbage.npy")), Error);
  const std::string pre = std::string("\x93NUMPY\x01\x00", 8);
  auto hdr = [&](const std::string& dict) {
    std::string h = dict;
    while ((10 + h.size() + 1) % 64) h += ' ';
    h += '\n';
    return pre + char(h.size() & 0xFF) + char(h.size() >> 8) + h;
  };
  write_raw(tmp("f8.npy"), hdr("{'descr': '<f8', 'fortran_order': False, 'shape': (1,), }") + std::string(8, '\0'));
  EXPECT_THROW(read_npy(tmp("f8.npy")), Error);
  write_raw(tmp("big.npy"), hdr("{'descr': '>f4', 'fortran_order': False, 'shape': (1,), }") + std::string(4, '\0'));
  EXPECT_THROW(read_npy(tmp("big.npy")), Error);
  write_raw(tmp("fo.npy"), hdr("{'descr': '<f4', 'fortran_order': True, 'shape': (1,), }") + std::string(4, '\0'));
  EXPECT_THROW(read_npy(tmp("fo.npy")), Error);
  write_raw(tmp("trunc.npy"), hdr("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }") + std::string(20, '\0'));
  EXPECT_THROW(read_npy(tmp("trunc.npy")), Error);
  write_raw(tmp("shape.npy"), hdr("{'descr': '<f4', 'fortran_order': False, 'shape': (2, x), }"));
  EXPECT_THROW(read_npy(tmp("shape.npy")), Error);
  write_raw(tmp("huge.npy"), hdr("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999, 99999999999), }"));
  EXPECT_THROW(read_npy(tmp("huge.npy")), Error);
  write_raw(tmp("ok.npy"), hdr("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }") + std::string(24, '\0'));
  EXPECT_NO_THROW(read_npy(tmp("ok.npy")));
  EXPECT_THROW(read_npy_tensor(tmp("ok.npy"), "--q"), Error);  // 2-D, not [B,H,N,d]
}

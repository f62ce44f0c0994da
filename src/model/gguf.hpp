// GGUF files (v2/v3): header, metadata, tensor index, and dequantisation of F32, F16, Q4_0, Q4_1,
// Q5_0, Q8_0, Q4_K and Q6_K tensors. The whole file is read into memory; every offset, length and count is
// checked against it, so a malformed file gives a dmattn::Error, never a crash or a huge allocation.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dmattn::model {

enum class GgmlType : uint32_t { f32 = 0, f16 = 1, q4_0 = 2, q4_1 = 3, q5_0 = 6, q8_0 = 8, q4_k = 12, q6_k = 14 };

struct GgufValue {
  enum Kind { integer, real, boolean, string, array } kind = integer;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<GgufValue> items;  // arrays
};

struct GgufTensor {
  std::string name;
  std::vector<int64_t> dims;  // dims[0] is the row length (fastest)
  uint32_t type = 0;
  uint64_t offset = 0;  // from the start of the data section
  int64_t numel() const;
};

class Gguf {
 public:
  static Gguf parse(std::vector<uint8_t> bytes, const std::string& what = "gguf");
  static Gguf load(const std::string& path);

  uint32_t version() const { return version_; }
  const std::map<std::string, GgufValue>& metadata() const { return kv_; }
  const std::vector<GgufTensor>& tensors() const { return tensors_; }

  bool has(const std::string& key) const { return kv_.count(key) != 0; }
  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;
  std::string get_string(const std::string& key) const;
  std::vector<std::string> get_strings(const std::string& key) const;

  const GgufTensor& tensor(const std::string& name) const;  // throws when absent
  bool has_tensor(const std::string& name) const;
  // The tensor as fp32, row-major with dims[0] fastest.
  std::vector<float> dequantize(const std::string& name) const;

 private:
  std::string what_;
  uint32_t version_ = 0;
  std::map<std::string, GgufValue> kv_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t> by_name_;
  std::vector<uint8_t> bytes_;
  uint64_t data_start_ = 0;
  const GgufValue& get(const std::string& key) const;
};

// Bytes a tensor of `numel` elements of `type` occupies; throws for unsupported types or ragged blocks.
uint64_t ggml_nbytes(uint32_t type, int64_t numel);
void ggml_dequantize(uint32_t type, const uint8_t* src, int64_t numel, float* dst);

}  // namespace dmattn::model

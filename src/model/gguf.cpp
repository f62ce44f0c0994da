#include "model/gguf.hpp"

#include <cstring>
#include <fstream>
#include <limits>

#include "dmattn/error.hpp"
#include "dmattn/numeric.hpp"

namespace dmattn::model {

namespace {

// A bounds-checked little-endian reader over the file's bytes.
class Reader {
 public:
  Reader(const std::vector<uint8_t>& b, const std::string& what) : b_(b), what_(what) {}
  uint64_t pos() const { return pos_; }
  void need(uint64_t n) const {
    if (n > b_.size() - pos_) throw Error(what_ + ": truncated (need " + std::to_string(n) + " bytes at offset " + std::to_string(pos_) + ")");
  }
  template <class T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string str() {
    const uint64_t n = get<uint64_t>();
    need(n);
    std::string s(reinterpret_cast<const char*>(b_.data() + pos_), size_t(n));
    pos_ += n;
    return s;
  }
  uint64_t remaining() const { return b_.size() - pos_; }

 private:
  const std::vector<uint8_t>& b_;
  std::string what_;
  uint64_t pos_ = 0;
};

// GGUF value types.
enum : uint32_t { U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 };

GgufValue read_value(Reader& r, uint32_t type, const std::string& what, int depth) {
  GgufValue v;
  switch (type) {
    case U8: v.i = r.get<uint8_t>(); break;
    case I8: v.i = r.get<int8_t>(); break;
    case U16: v.i = r.get<uint16_t>(); break;
    case I16: v.i = r.get<int16_t>(); break;
    case U32: v.i = r.get<uint32_t>(); break;
    case I32: v.i = r.get<int32_t>(); break;
    case U64: {
      const uint64_t u = r.get<uint64_t>();
      if (u > uint64_t(std::numeric_limits<int64_t>::max())) throw Error(what + ": uint64 value out of range");
      v.i = int64_t(u);
      break;
    }
    case I64: v.i = r.get<int64_t>(); break;
    case F32: v.kind = GgufValue::real; v.f = r.get<float>(); break;
    case F64: v.kind = GgufValue::real; v.f = r.get<double>(); break;
    case BOOL: v.kind = GgufValue::boolean; v.i = r.get<uint8_t>() != 0; break;
    case STRING: v.kind = GgufValue::string; v.s = r.str(); break;
    case ARRAY: {
      if (depth > 2) throw Error(what + ": nested arrays too deep");
      v.kind = GgufValue::array;
      const uint32_t et = r.get<uint32_t>();
      const uint64_t n = r.get<uint64_t>();
      // Every element takes at least one byte: a count beyond the remaining bytes is corrupt.
      if (n > r.remaining()) throw Error(what + ": array length " + std::to_string(n) + " exceeds the file");
      v.items.reserve(size_t(n));
      for (uint64_t k = 0; k < n; ++k) v.items.push_back(read_value(r, et, what, depth + 1));
      break;
    }
    default: throw Error(what + ": unknown metadata value type " + std::to_string(type));
  }
  return v;
}

uint64_t block_size(uint32_t type) {
  switch (GgmlType(type)) {
    case GgmlType::f32:
    case GgmlType::f16: return 1;
    case GgmlType::q4_k:
    case GgmlType::q6_k: return 256;
    default: return 32;
  }
}
uint64_t block_bytes(uint32_t type) {
  switch (GgmlType(type)) {
    case GgmlType::f32: return 4;
    case GgmlType::f16: return 2;
    case GgmlType::q4_0: return 18;
    case GgmlType::q4_1: return 20;
    case GgmlType::q5_0: return 22;
    case GgmlType::q8_0: return 34;
    case GgmlType::q4_k: return 144;
    case GgmlType::q6_k: return 210;
  }
  throw Error("unsupported ggml tensor type " + std::to_string(type) +
              " (supported: F32, F16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K)");
}

// Q4_K's 6-bit scale and min of sub-block j (0..7) from its 12 packed bytes: sub-blocks 0..3 hold
// theirs in the low 6 bits of bytes j and j + 4; 4..7 take 4 bits from byte j + 4 (low nibble for
// the scale, high for the min) and their top 2 bits from the spare high bits of bytes j - 4 and j.
void q4k_scale_min(const uint8_t* sc, int j, int& scale, int& min) {
  if (j < 4) {
    scale = sc[j] & 63;
    min = sc[j + 4] & 63;
  } else {
    scale = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
    min = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
  }
}

float half(const uint8_t* p) {
  fp16 h;
  std::memcpy(&h.bits, p, 2);
  return to_float(h);
}

}  // namespace

int64_t GgufTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

uint64_t ggml_nbytes(uint32_t type, int64_t numel) {
  const uint64_t bb = block_bytes(type), bs = block_size(type);
  if (numel < 0 || uint64_t(numel) % bs != 0)
    throw Error("tensor of " + std::to_string(numel) + " elements is not a whole number of blocks");
  return uint64_t(numel) / bs * bb;
}

void ggml_dequantize(uint32_t type, const uint8_t* src, int64_t numel, float* dst) {
  switch (GgmlType(type)) {
    case GgmlType::f32: std::memcpy(dst, src, size_t(numel) * 4); return;
    case GgmlType::f16:
      for (int64_t i = 0; i < numel; ++i) dst[i] = half(src + 2 * i);
      return;
    case GgmlType::q4_0:  // d (f16), 16 bytes: low nibbles are elements 0..15, high 16..31; value (q - 8) * d
      for (int64_t b = 0; b < numel / 32; ++b, src += 18, dst += 32) {
        const float d = half(src);
        for (int j = 0; j < 16; ++j) {
          dst[j] = float(int(src[2 + j] & 0xF) - 8) * d;
          dst[j + 16] = float(int(src[2 + j] >> 4) - 8) * d;
        }
      }
      return;
    case GgmlType::q4_1:  // d, m (f16), 16 bytes of nibbles as Q4_0; value q * d + m
      for (int64_t b = 0; b < numel / 32; ++b, src += 20, dst += 32) {
        const float d = half(src), m = half(src + 2);
        for (int j = 0; j < 16; ++j) {
          dst[j] = float(src[4 + j] & 0xF) * d + m;
          dst[j + 16] = float(src[4 + j] >> 4) * d + m;
        }
      }
      return;
    case GgmlType::q5_0:  // d (f16), 32 high bits (u32), 16 bytes of low nibbles as Q4_0; value (q - 16) * d
      for (int64_t b = 0; b < numel / 32; ++b, src += 22, dst += 32) {
        const float d = half(src);
        uint32_t qh;
        std::memcpy(&qh, src + 2, 4);
        for (int j = 0; j < 16; ++j) {
          dst[j] = float(int((src[6 + j] & 0xF) | ((qh >> j) & 1) << 4) - 16) * d;
          dst[j + 16] = float(int((src[6 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - 16) * d;
        }
      }
      return;
    case GgmlType::q4_k:  // super-blocks of 256: d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
      for (int64_t b = 0; b < numel / 256; ++b, src += 144, dst += 256) {
        const float d = half(src), dmin = half(src + 2);
        const uint8_t *sc = src + 4, *q = src + 16;
        // Each 32 bytes of nibbles hold two sub-blocks of 32: low nibbles the first, high the second.
        for (int pair = 0; pair < 4; ++pair) {
          int s0, m0, s1, m1;
          q4k_scale_min(sc, 2 * pair, s0, m0);
          q4k_scale_min(sc, 2 * pair + 1, s1, m1);
          for (int l = 0; l < 32; ++l) {
            dst[64 * pair + l] = d * float(s0) * float(q[32 * pair + l] & 0xF) - dmin * float(m0);
            dst[64 * pair + 32 + l] = d * float(s1) * float(q[32 * pair + l] >> 4) - dmin * float(m1);
          }
        }
      }
      return;
    case GgmlType::q6_k:  // super-blocks of 256: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d (f16)
      for (int64_t b = 0; b < numel / 256; ++b, src += 210, dst += 256) {
        const uint8_t *ql = src, *qh = src + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(src + 192);
        const float d = half(src + 208);
        // Two halves of 128: in each, byte l of 32 carries four 2-bit highs for elements l, l + 32,
        // l + 64, l + 96; element l (and l + 64) takes the low (high) nibble of ql[l], l + 32 (and
        // l + 96) those of ql[l + 32]; a scale per 16 elements; value (q - 32) * d * scale.
        for (int part = 0; part < 2; ++part, ql += 64, qh += 32, sc += 8)
          for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            const int q1 = int((ql[l] & 0xF) | ((qh[l] >> 0) & 3) << 4) - 32;
            const int q2 = int((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4) - 32;
            const int q3 = int((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
            const int q4 = int((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
            float* y = dst + 128 * part;
            y[l] = d * float(sc[is]) * float(q1);
            y[l + 32] = d * float(sc[is + 2]) * float(q2);
            y[l + 64] = d * float(sc[is + 4]) * float(q3);
            y[l + 96] = d * float(sc[is + 6]) * float(q4);
          }
      }
      return;
    case GgmlType::q8_0:  // d (f16), 32 int8; value q * d
      for (int64_t b = 0; b < numel / 32; ++b, src += 34, dst += 32) {
        const float d = half(src);
        for (int j = 0; j < 32; ++j) dst[j] = float(int8_t(src[2 + j])) * d;
      }
      return;
  }
  throw Error("unsupported ggml tensor type " + std::to_string(type));
}

Gguf Gguf::parse(std::vector<uint8_t> bytes, const std::string& what) {
  Gguf g;
  g.what_ = what;
  g.bytes_ = std::move(bytes);
  Reader r(g.bytes_, what);
  if (r.get<uint32_t>() != 0x46554747u) throw Error(what + ": not a GGUF file (bad magic)");
  g.version_ = r.get<uint32_t>();
  if (g.version_ != 2 && g.version_ != 3) throw Error(what + ": unsupported GGUF version " + std::to_string(g.version_));
  const uint64_t n_tensors = r.get<uint64_t>(), n_kv = r.get<uint64_t>();
  // Each record takes well over 8 bytes: counts beyond that are corrupt, not a reason to allocate.
  if (n_tensors > r.remaining() / 8 || n_kv > r.remaining() / 8) throw Error(what + ": tensor or metadata count exceeds the file");
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = r.str();
    const uint32_t type = r.get<uint32_t>();
    g.kv_[key] = read_value(r, type, what + " [" + key + "]", 0);
  }
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensor t;
    t.name = r.str();
    const uint32_t nd = r.get<uint32_t>();
    if (nd == 0 || nd > 4) throw Error(what + ": tensor " + t.name + " has " + std::to_string(nd) + " dimensions");
    int64_t n = 1;
    for (uint32_t k = 0; k < nd; ++k) {
      const uint64_t d = r.get<uint64_t>();
      if (d == 0 || d > (uint64_t(1) << 40) || uint64_t(n) > (uint64_t(1) << 50) / d)
        throw Error(what + ": tensor " + t.name + " has an invalid dimension");
      t.dims.push_back(int64_t(d));
      n *= int64_t(d);
    }
    t.type = r.get<uint32_t>();
    t.offset = r.get<uint64_t>();
    if (g.by_name_.count(t.name)) throw Error(what + ": duplicate tensor " + t.name);
    g.by_name_[t.name] = g.tensors_.size();
    g.tensors_.push_back(std::move(t));
  }
  uint64_t align = 32;
  if (g.has("general.alignment")) {
    const int64_t a = g.get_int("general.alignment");
    if (a <= 0 || a > 65536 || (a & (a - 1))) throw Error(what + ": invalid general.alignment");
    align = uint64_t(a);
  }
  g.data_start_ = (r.pos() + align - 1) / align * align;
  for (const GgufTensor& t : g.tensors_) {
    if (t.offset % align) throw Error(what + ": tensor " + t.name + " is misaligned");
    uint64_t nbytes;
    try {
      nbytes = ggml_nbytes(t.type, t.numel());
    } catch (const Error& e) {
      throw Error(what + ": tensor " + t.name + ": " + e.what());
    }
    if (g.data_start_ > g.bytes_.size() || t.offset > g.bytes_.size() - g.data_start_ ||
        nbytes > g.bytes_.size() - g.data_start_ - t.offset)
      throw Error(what + ": tensor " + t.name + " extends past the end of the file");
  }
  return g;
}

Gguf Gguf::load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error(path + ": cannot open file");
  f.seekg(0, std::ios::end);
  const std::streamoff size = f.tellg();
  f.seekg(0);
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  if (!f.read(reinterpret_cast<char*>(bytes.data()), size)) throw Error(path + ": read failed");
  return parse(std::move(bytes), path);
}

const GgufValue& Gguf::get(const std::string& key) const {
  const auto it = kv_.find(key);
  if (it == kv_.end()) throw Error(what_ + ": missing metadata " + key);
  return it->second;
}

int64_t Gguf::get_int(const std::string& key) const {
  const GgufValue& v = get(key);
  if (v.kind != GgufValue::integer && v.kind != GgufValue::boolean) throw Error(what_ + ": metadata " + key + " is not an integer");
  return v.i;
}

double Gguf::get_float(const std::string& key) const {
  const GgufValue& v = get(key);
  if (v.kind == GgufValue::real) return v.f;
  if (v.kind == GgufValue::integer) return double(v.i);
  throw Error(what_ + ": metadata " + key + " is not a number");
}

std::string Gguf::get_string(const std::string& key) const {
  const GgufValue& v = get(key);
  if (v.kind != GgufValue::string) throw Error(what_ + ": metadata " + key + " is not a string");
  return v.s;
}

std::vector<std::string> Gguf::get_strings(const std::string& key) const {
  const GgufValue& v = get(key);
  if (v.kind != GgufValue::array) throw Error(what_ + ": metadata " + key + " is not an array");
  std::vector<std::string> out;
  out.reserve(v.items.size());
  for (const GgufValue& it : v.items) {
    if (it.kind != GgufValue::string) throw Error(what_ + ": metadata " + key + " holds a non-string");
    out.push_back(it.s);
  }
  return out;
}

bool Gguf::has_tensor(const std::string& name) const { return by_name_.count(name) != 0; }

const GgufTensor& Gguf::tensor(const std::string& name) const {
  const auto it = by_name_.find(name);
  if (it == by_name_.end()) throw Error(what_ + ": missing tensor " + name);
  return tensors_[it->second];
}

std::vector<float> Gguf::dequantize(const std::string& name) const {
  const GgufTensor& t = tensor(name);
  std::vector<float> out(static_cast<size_t>(t.numel()));
  ggml_dequantize(t.type, bytes_.data() + data_start_ + t.offset, t.numel(), out.data());
  return out;
}

}  // namespace dmattn::model

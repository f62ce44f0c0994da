#include "dmattn/npy.hpp"

#include <cstring>
#include <fstream>
#include <limits>

#include "dmattn/error.hpp"
#include "dmattn/numeric.hpp"

namespace dmattn {

namespace {
size_t item_size(NpyType t) { return t == NpyType::f32 ? 4 : t == NpyType::f16 ? 2 : 1; }
const char* descr_of(NpyType t) { return t == NpyType::f32 ? "<f4" : t == NpyType::f16 ? "<f2" : "|u1"; }

// Value text following 'key': in the header dict, or empty when absent.
std::string dict_value(const std::string& h, const std::string& key) {
  const size_t k = h.find("'" + key + "'");
  if (k == std::string::npos) return {};
  size_t p = h.find(':', k);
  if (p == std::string::npos) return {};
  ++p;
  while (p < h.size() && h[p] == ' ') ++p;
  if (p >= h.size()) return {};
  if (h[p] == '(') {
    const size_t e = h.find(')', p);
    return e == std::string::npos ? std::string{} : h.substr(p, e - p + 1);
  }
  if (h[p] == '\'') {
    const size_t e = h.find('\'', p + 1);
    return e == std::string::npos ? std::string{} : h.substr(p + 1, e - p - 1);
  }
  size_t e = p;
  while (e < h.size() && h[e] != ',' && h[e] != '}') ++e;
  return h.substr(p, e - p);
}

std::vector<int64_t> parse_shape(const std::string& s, const std::string& path) {
  if (s.size() < 2 || s.front() != '(' || s.back() != ')') throw Error(path + ": bad npy header (shape)");
  std::vector<int64_t> shape;
  size_t i = 1;
  while (i < s.size() - 1) {
    while (i < s.size() - 1 && (s[i] == ' ' || s[i] == ',')) ++i;
    if (i >= s.size() - 1) break;
    int64_t v = 0;
    size_t digits = 0;
    while (i < s.size() - 1 && s[i] >= '0' && s[i] <= '9') {
      if (v > (std::numeric_limits<int64_t>::max() - 9) / 10) throw Error(path + ": bad npy header (shape too large)");
      v = v * 10 + (s[i] - '0');
      ++i;
      ++digits;
    }
    if (digits == 0 || (i < s.size() - 1 && s[i] != ',' && s[i] != ' ')) throw Error(path + ": bad npy header (shape)");
    shape.push_back(v);
  }
  return shape;
}
}  // namespace

int64_t NpyArray::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

NpyArray read_npy(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error(path + ": cannot open file");
  char magic[8];
  if (!f.read(magic, 8) || std::memcmp(magic, "\x93NUMPY", 6) != 0) throw Error(path + ": not a .npy file (bad magic)");
  const int major = static_cast<unsigned char>(magic[6]);
  uint32_t hlen = 0;
  if (major == 1) {
    unsigned char b[2];
    if (!f.read(reinterpret_cast<char*>(b), 2)) throw Error(path + ": truncated npy header");
    hlen = b[0] | (b[1] << 8);
  } else if (major == 2 || major == 3) {
    unsigned char b[4];
    if (!f.read(reinterpret_cast<char*>(b), 4)) throw Error(path + ": truncated npy header");
    hlen = b[0] | (b[1] << 8) | (b[2] << 16) | (uint32_t(b[3]) << 24);
    if (hlen > (1u << 20)) throw Error(path + ": npy header too long");
  } else {
    throw Error(path + ": unsupported npy version " + std::to_string(major));
  }
  std::string h(hlen, '\0');
  if (!f.read(h.data(), hlen)) throw Error(path + ": truncated npy header");

  NpyArray a;
  const std::string descr = dict_value(h, "descr");
  if (descr == "<f4" || descr == "=f4" || descr == "f4")
    a.type = NpyType::f32;
  else if (descr == "<f2" || descr == "=f2" || descr == "f2")
    a.type = NpyType::f16;
  else if (descr == "|u1" || descr == "u1" || descr == "<u1")
    a.type = NpyType::u8;
  else
    throw Error(path + ": unsupported dtype '" + descr + "' (need little-endian float32, float16 or uint8)");
  const std::string fo = dict_value(h, "fortran_order");
  if (fo != "False") throw Error(path + (fo == "True" ? ": Fortran-order arrays are not supported (save C order)" : ": bad npy header (fortran_order)"));
  a.shape = parse_shape(dict_value(h, "shape"), path);

  int64_t n = 1;
  for (int64_t s : a.shape) {
    if (s != 0 && n > std::numeric_limits<int64_t>::max() / 8 / s) throw Error(path + ": array too large");
    n *= s;
  }
  const std::streampos data_start = f.tellg();
  f.seekg(0, std::ios::end);
  const int64_t available = int64_t(f.tellg() - data_start);
  const int64_t need = n * int64_t(item_size(a.type));
  if (available < need)
    throw Error(path + ": truncated data (" + std::to_string(available) + " bytes, need " + std::to_string(need) + ")");
  f.seekg(data_start);
  a.data.resize(static_cast<size_t>(need));
  f.read(reinterpret_cast<char*>(a.data.data()), need);
  return a;
}

void write_npy(const std::string& path, NpyType type, const std::vector<int64_t>& shape, const void* data) {
  std::string h = "{'descr': '" + std::string(descr_of(type)) + "', 'fortran_order': False, 'shape': (";
  int64_t n = 1;
  for (int64_t s : shape) {
    h += std::to_string(s) + ",";
    if (shape.size() > 1) h += " ";
    n *= s;
  }
  if (shape.size() > 1) h.resize(h.size() - 2);  // numpy writes (3,) but (2, 3)
  h += "), }";
  const size_t total = 10 + h.size() + 1;
  h.append((64 - total % 64) % 64, ' ');
  h += '\n';
  std::ofstream f(path, std::ios::binary);
  if (!f) throw Error(path + ": cannot write file");
  const uint16_t hl = uint16_t(h.size());
  const char pre[10] = {'\x93', 'N', 'U', 'M', 'P', 'Y', 1, 0, char(hl & 0xFF), char(hl >> 8)};
  f.write(pre, 10);
  f.write(h.data(), std::streamsize(h.size()));
  f.write(static_cast<const char*>(data), std::streamsize(n * int64_t(item_size(type))));
  if (!f) throw Error(path + ": write failed");
}

std::vector<float> npy_to_floats(const NpyArray& a) {
  std::vector<float> v(size_t(a.numel()));
  if (a.type == NpyType::f32) {
    std::memcpy(v.data(), a.data.data(), v.size() * 4);
  } else if (a.type == NpyType::f16) {
    for (size_t i = 0; i < v.size(); ++i) {
      fp16 h;
      std::memcpy(&h.bits, a.data.data() + 2 * i, 2);
      v[i] = to_float(h);
    }
  } else {
    for (size_t i = 0; i < v.size(); ++i) v[i] = float(uint8_t(a.data[i]));
  }
  return v;
}

HostTensor read_npy_tensor(const std::string& path, const std::string& what) {
  NpyArray a = read_npy(path);
  if (a.type == NpyType::u8) throw Error(what + " " + path + ": dtype uint8 is not a float tensor (need float32 or float16)");
  if (a.shape.size() != 4)
    throw Error(what + " " + path + ": expected 4 dimensions [B,H,N,d], got " + std::to_string(a.shape.size()));
  const Shape s{a.shape[0], a.shape[1], a.shape[2], a.shape[3]};
  HostTensor t(a.type == NpyType::f32 ? DType::f32 : DType::f16, s);
  std::memcpy(t.bytes(), a.data.data(), t.nbytes());
  return t;
}

}  // namespace dmattn

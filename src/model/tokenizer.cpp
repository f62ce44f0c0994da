#include "model/tokenizer.hpp"

#include <climits>

#include "dmattn/error.hpp"

namespace dmattn::model {

namespace {

std::string utf8(unsigned cp) {
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

enum Cls { Space, Letter, Digit, Other };
Cls cls(unsigned char c) {
  if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f') return Space;
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80) return Letter;
  if (c >= '0' && c <= '9') return Digit;
  return Other;
}

// The GPT-2 pattern  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// applied to one piece; returns the length of the match at i.
size_t match(const std::string& s, size_t i) {
  const size_t n = s.size();
  if (s[i] == '\'') {
    for (const char* c : {"s", "t", "re", "ve", "m", "ll", "d"}) {
      const size_t len = std::char_traits<char>::length(c);
      if (s.compare(i + 1, len, c) == 0) return 1 + len;
    }
  }
  size_t j = i;
  if (s[j] == ' ' && j + 1 < n && cls(s[j + 1]) != Space) ++j;  // the optional leading space
  const Cls c = cls(s[j]);
  if (c != Space) {
    size_t k = j + 1;
    while (k < n && cls(s[k]) == c) ++k;
    return k - i;
  }
  size_t k = i;
  while (k < n && cls(s[k]) == Space) ++k;
  if (k == n || k - i == 1) return k - i;
  return k - i - 1;  // leave the last whitespace to lead the next word
}

}  // namespace

Tokenizer::Tokenizer(const Gguf& g) {
  if (g.get_string("tokenizer.ggml.model") != "gpt2")
    throw Error("tokenizer: only byte-level BPE (tokenizer.ggml.model = gpt2) is supported");
  const std::string pre = g.has("tokenizer.ggml.pre") ? g.get_string("tokenizer.ggml.pre") : "default";
  split_digits_ = pre == "smollm";
  tokens_ = g.get_strings("tokenizer.ggml.tokens");
  for (size_t i = 0; i < tokens_.size(); ++i) ids_.emplace(tokens_[i], int(i));
  const std::vector<std::string> merges = g.get_strings("tokenizer.ggml.merges");
  for (size_t i = 0; i < merges.size(); ++i) merge_rank_.emplace(merges[i], int(i));
  if (g.has("tokenizer.ggml.bos_token_id")) bos_ = int(g.get_int("tokenizer.ggml.bos_token_id"));
  if (g.has("tokenizer.ggml.eos_token_id")) eos_ = int(g.get_int("tokenizer.ggml.eos_token_id"));
  // GPT-2's byte <-> symbol table: printable bytes map to themselves, the rest to 256 + k.
  unsigned next = 256;
  for (unsigned b = 0; b < 256; ++b) {
    const bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    byte_to_sym_[b] = utf8(keep ? b : next++);
    sym_to_byte_[byte_to_sym_[b]] = static_cast<unsigned char>(b);
  }
}

std::vector<std::string> Tokenizer::pretokenize(const std::string& text) const {
  // Pieces: each digit alone (smollm), runs of non-digits; the GPT-2 pattern within each piece.
  std::vector<std::string> pieces, words;
  for (size_t i = 0; i < text.size();) {
    size_t k = i + 1;
    if (!(split_digits_ && cls(text[i]) == Digit))
      while (k < text.size() && !(split_digits_ && cls(text[k]) == Digit)) ++k;
    pieces.push_back(text.substr(i, k - i));
    i = k;
  }
  for (const std::string& p : pieces)
    for (size_t i = 0; i < p.size();) {
      const size_t len = match(p, i);
      words.push_back(p.substr(i, len));
      i += len;
    }
  return words;
}

void Tokenizer::bpe(const std::string& word, std::vector<int>& out) const {
  std::vector<std::string> sym;
  for (unsigned char c : word) sym.push_back(byte_to_sym_[c]);
  while (sym.size() > 1) {
    int best = INT_MAX;
    size_t at = 0;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      const auto it = merge_rank_.find(sym[i] + " " + sym[i + 1]);
      if (it != merge_rank_.end() && it->second < best) {
        best = it->second;
        at = i;
      }
    }
    if (best == INT_MAX) break;
    sym[at] += sym[at + 1];
    sym.erase(sym.begin() + long(at) + 1);
  }
  for (const std::string& s : sym) {
    const auto it = ids_.find(s);
    if (it == ids_.end()) throw Error("tokenizer: symbol without a token id (vocabulary and merges disagree)");
    out.push_back(it->second);
  }
}

std::vector<int> Tokenizer::encode(const std::string& text) const {
  std::vector<int> ids;
  for (const std::string& w : pretokenize(text)) bpe(w, ids);
  return ids;
}

std::string Tokenizer::decode(const std::vector<int>& ids) const {
  std::string out;
  for (int id : ids) {
    if (id < 0 || id >= int(tokens_.size())) throw Error("tokenizer: token id out of range");
    const std::string& t = tokens_[size_t(id)];
    for (size_t i = 0; i < t.size();) {  // split the token into UTF-8 symbols, map each to its byte
      size_t len = 1;
      const unsigned char c = static_cast<unsigned char>(t[i]);
      if (c >= 0xE0) len = 3;
      else if (c >= 0xC0) len = 2;
      const auto it = sym_to_byte_.find(t.substr(i, len));
      out += it != sym_to_byte_.end() ? char(it->second) : '?';
      i += len;
    }
  }
  return out;
}

}  // namespace dmattn::model

#include "model/tokenizer.hpp"

#include <algorithm>
#include <climits>
#include <queue>

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
  const std::string model = g.get_string("tokenizer.ggml.model");
  if (model != "gpt2" && model != "llama")
    throw Error("tokenizer: '" + model + "' is not supported (gpt2: byte-level BPE; llama: SentencePiece BPE)");
  kind_ = model == "gpt2" ? Kind::gpt2 : Kind::spm;
  const std::string pre = g.has("tokenizer.ggml.pre") ? g.get_string("tokenizer.ggml.pre") : "default";
  split_digits_ = pre == "smollm";
  tokens_ = g.get_strings("tokenizer.ggml.tokens");
  for (size_t i = 0; i < tokens_.size(); ++i) ids_.emplace(tokens_[i], int(i));
  if (g.has("tokenizer.ggml.bos_token_id")) bos_ = int(g.get_int("tokenizer.ggml.bos_token_id"));
  if (g.has("tokenizer.ggml.eos_token_id")) eos_ = int(g.get_int("tokenizer.ggml.eos_token_id"));
  add_bos_ = g.has("tokenizer.ggml.add_bos_token") && g.get_int("tokenizer.ggml.add_bos_token") != 0;
  if (kind_ == Kind::spm) {
    const GgufValue& sc = g.metadata().at("tokenizer.ggml.scores");
    const GgufValue& ty = g.metadata().at("tokenizer.ggml.token_type");
    if (sc.items.size() != tokens_.size() || ty.items.size() != tokens_.size())
      throw Error("tokenizer: scores and token types must list every token");
    constexpr int kUserDefined = 4, kByte = 6;
    std::fill(std::begin(byte_token_), std::end(byte_token_), -1);
    for (size_t i = 0; i < tokens_.size(); ++i) {
      scores_.push_back(float(sc.items[i].f));
      const std::string& t = tokens_[i];
      if (ty.items[i].i == kUserDefined) user_defined_.push_back(t);
      if (ty.items[i].i == kByte && t.size() == 6 && t.rfind("<0x", 0) == 0)
        byte_token_[std::stoi(t.substr(3, 2), nullptr, 16)] = int(i);
    }
    for (int b = 0; b < 256; ++b)
      if (byte_token_[b] < 0) throw Error("tokenizer: the vocabulary lacks byte token " + std::to_string(b));
    std::stable_sort(user_defined_.begin(), user_defined_.end(),
                     [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
    return;
  }
  const std::vector<std::string> merges = g.get_strings("tokenizer.ggml.merges");
  for (size_t i = 0; i < merges.size(); ++i) merge_rank_.emplace(merges[i], int(i));
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

// SentencePiece BPE over one fragment without user-defined pieces: symbols in a linked list, the
// candidate pairs in a heap by (score, -position); a popped pair whose symbols changed since it was
// queued is stale and skipped.
void Tokenizer::spm(const std::string& raw, std::vector<int>& out) const {
  static const std::string kSpace = "\xE2\x96\x81";  // U+2581
  std::string text;
  for (char c : raw) text += c == ' ' ? kSpace : std::string(1, c);
  struct Sym {
    int prev, next;
    size_t at, len;
  };
  std::vector<Sym> sym;
  for (size_t i = 0; i < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    const size_t len = std::min(text.size() - i, size_t(c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1));
    sym.push_back({int(sym.size()) - 1, int(sym.size()) + 1, i, len});
    i += len;
  }
  if (sym.empty()) return;
  sym.back().next = -1;
  struct Pair {
    float score;
    int left;
    size_t len;  // the merged length when queued: a stale entry no longer matches it
    bool operator<(const Pair& o) const { return score != o.score ? score < o.score : left > o.left; }
  };
  std::priority_queue<Pair> heap;
  auto consider = [&](int l) {
    if (l < 0 || sym[size_t(l)].next < 0) return;
    const Sym &a = sym[size_t(l)], &b = sym[size_t(a.next)];
    const auto it = ids_.find(text.substr(a.at, a.len + b.len));
    if (it != ids_.end()) heap.push({scores_[size_t(it->second)], l, a.len + b.len});
  };
  for (int i = 0; i + 1 < int(sym.size()); ++i) consider(i);
  while (!heap.empty()) {
    const Pair p = heap.top();
    heap.pop();
    Sym& a = sym[size_t(p.left)];
    if (a.len == 0 || a.next < 0 || a.len + sym[size_t(a.next)].len != p.len) continue;
    Sym& b = sym[size_t(a.next)];
    a.len += b.len;
    b.len = 0;
    a.next = b.next;
    if (a.next >= 0) sym[size_t(a.next)].prev = p.left;
    consider(a.prev);
    consider(p.left);
  }
  for (int i = 0; i >= 0; i = sym[size_t(i)].next) {
    const std::string piece = text.substr(sym[size_t(i)].at, sym[size_t(i)].len);
    const auto it = ids_.find(piece);
    if (it != ids_.end()) {
      out.push_back(it->second);
    } else {
      for (unsigned char c : piece) out.push_back(byte_token_[c]);
    }
  }
}

std::vector<int> Tokenizer::encode(const std::string& text) const {
  std::vector<int> ids;
  if (kind_ == Kind::gpt2) {
    for (const std::string& w : pretokenize(text)) bpe(w, ids);
    return ids;
  }
  // Fragments: (text, id) with id >= 0 for a user-defined piece, split out longest first.
  std::vector<std::pair<std::string, int>> frags{{text, -1}};
  for (const std::string& u : user_defined_) {
    std::vector<std::pair<std::string, int>> next;
    const int id = ids_.at(u);
    for (auto& f : frags) {
      if (f.second >= 0) {
        next.push_back(std::move(f));
        continue;
      }
      size_t from = 0;
      for (size_t at; (at = f.first.find(u, from)) != std::string::npos; from = at + u.size()) {
        if (at > from) next.emplace_back(f.first.substr(from, at - from), -1);
        next.emplace_back(u, id);
      }
      if (from < f.first.size()) next.emplace_back(f.first.substr(from), -1);
    }
    frags = std::move(next);
  }
  for (const auto& f : frags)
    if (f.second >= 0)
      ids.push_back(f.second);
    else
      spm(f.first, ids);
  return ids;
}

std::string Tokenizer::decode(const std::vector<int>& ids) const {
  std::string out;
  for (int id : ids) {
    if (id < 0 || id >= int(tokens_.size())) throw Error("tokenizer: token id out of range");
    const std::string& t = tokens_[size_t(id)];
    if (kind_ == Kind::spm) {
      const int* b = std::find(std::begin(byte_token_), std::end(byte_token_), id);
      if (b != std::end(byte_token_)) {
        out += char(b - byte_token_);
        continue;
      }
      for (size_t i = 0; i < t.size(); ++i) {
        if (t.compare(i, 3, "\xE2\x96\x81") == 0) {
          out += ' ';
          i += 2;
        } else {
          out += t[i];
        }
      }
      continue;
    }
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

// Byte-level BPE (GPT-2 family) from GGUF metadata: tokenizer.ggml.tokens / merges, with the
// pre-tokenizer of the model ("smollm": digits split one by one, then the GPT-2 pattern).
// Approximation, stated: non-ASCII bytes count as letters in the pre-tokenizer (the Unicode
// classes \p{L}/\p{N} are not implemented); English ASCII text tokenizes as the reference does.
#pragma once
#include <string>
#include <unordered_map>
#include <vector>

#include "model/gguf.hpp"

namespace dmattn::model {

class Tokenizer {
 public:
  explicit Tokenizer(const Gguf& g);
  std::vector<int> encode(const std::string& text) const;
  std::string decode(const std::vector<int>& ids) const;
  int vocab_size() const { return int(tokens_.size()); }
  int bos() const { return bos_; }
  int eos() const { return eos_; }

  // The pre-tokenizer alone (exposed for tests).
  std::vector<std::string> pretokenize(const std::string& text) const;

 private:
  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int> ids_;
  std::unordered_map<std::string, int> merge_rank_;  // "left right" -> rank
  std::string byte_to_sym_[256];                     // GPT-2 byte -> unicode symbol (UTF-8)
  std::unordered_map<std::string, unsigned char> sym_to_byte_;
  bool split_digits_ = false;
  int bos_ = -1, eos_ = -1;
  void bpe(const std::string& word, std::vector<int>& out) const;
};

}  // namespace dmattn::model

// Tokenizers from GGUF metadata, of two kinds:
//  - byte-level BPE (tokenizer.ggml.model = gpt2, SmolLM2): tokenizer.ggml.tokens / merges, with the
//    pre-tokenizer of the model ("smollm": digits split one by one, then the GPT-2 pattern).
//    Approximation, stated: non-ASCII bytes count as letters in the pre-tokenizer (the Unicode
//    classes \p{L}/\p{N} are not implemented); English ASCII text tokenizes as the reference does.
//  - SentencePiece BPE (tokenizer.ggml.model = llama, Gemma 3): the user-defined pieces (newline
//    runs, space runs, ...) are split out of the text first, longest first; in what remains spaces
//    become U+2581 and adjacent symbols merge while some pair forms a vocabulary piece, the
//    highest-scored pair first (leftmost on ties); a symbol left without a piece is emitted as its
//    UTF-8 bytes' byte tokens (<0xXX>).
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
  bool add_bos() const { return add_bos_; }  // the model expects BOS before a text

  // The pre-tokenizer alone (exposed for tests).
  std::vector<std::string> pretokenize(const std::string& text) const;

 private:
  enum class Kind { gpt2, spm } kind_ = Kind::gpt2;
  std::vector<std::string> tokens_;
  std::vector<float> scores_;                 // spm: merge priority of each piece
  std::vector<std::string> user_defined_;     // spm: pieces split out before merging, longest first
  int byte_token_[256] = {};                  // spm: <0xXX>
  std::unordered_map<std::string, int> ids_;
  std::unordered_map<std::string, int> merge_rank_;  // "left right" -> rank
  std::string byte_to_sym_[256];                     // GPT-2 byte -> unicode symbol (UTF-8)
  std::unordered_map<std::string, unsigned char> sym_to_byte_;
  bool split_digits_ = false;
  int bos_ = -1, eos_ = -1;
  bool add_bos_ = false;
  void bpe(const std::string& word, std::vector<int>& out) const;
  void spm(const std::string& text, std::vector<int>& out) const;
};

}  // namespace dmattn::model

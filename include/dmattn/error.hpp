#pragma once
#include <stdexcept>
#include <string>

namespace dmattn {
// Every error the library reports about its inputs: one line, saying what is wrong and why.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
}  // namespace dmattn

// ikbo/error.hpp — the library's exception types.
//
// ikbo::Error is thrown for every invalid argument: its message names the
// argument, what was expected and what was given, e.g.
//   "cand_to_user[17] = 40 is out of range [0, 15)".
// When an op throws ikbo::Error nothing has been written to its outputs.
// ikbo::RuntimeError reports a failure of the platform underneath (a CUDA or
// cuBLAS call that failed), not of the caller's input.
#pragma once

#include <stdexcept>
#include <string>

namespace ikbo {

class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class RuntimeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace ikbo

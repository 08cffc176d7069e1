#pragma once
// Bad input: a flag, a file, a spec or a combination the user gave. The CLI exits 2 on it, with its message naming
// the thing; any other exception is an internal error (exit 70, "please report"), so that a bug never passes for a
// user's mistake. It is a std::invalid_argument, so code that adds context to the standard type keeps working.
#include <stdexcept>

namespace sbp {

struct InputError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

}  // namespace sbp

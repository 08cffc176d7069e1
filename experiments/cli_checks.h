// Command-line range checks whose messages say what was wrong in words. CLI11's own Range answers a word with
// "Value abc not in range 2 to 1099511627776" and shows [2 - 1099511627776] in the help; these say "'abc' is not a
// whole number" and show [2, 2^40].
#pragma once

#include <string>
#include <type_traits>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

namespace sbp {

// A bound as a person reads it: 2^40 for a large power of two.
template <typename T>
std::string bound_text(T v) {
  if constexpr (std::is_integral_v<T>) {
    if (v >= (T(1) << 20) && (v & (v - 1)) == 0) {
      int e = 0;
      while ((T(1) << e) < v) ++e;
      return fmt::format("2^{}", e);
    }
    return std::to_string(v);
  } else {
    return fmt::format("{:g}", v);
  }
}

// The value must be a T in [lo, hi].
template <typename T>
CLI::Validator within(T lo, T hi) {
  const std::string kind = std::is_integral_v<T> ? "a whole number" : "a number";
  const std::string range = "[" + bound_text(lo) + ", " + bound_text(hi) + "]";
  return CLI::Validator(
      [=](std::string& input) -> std::string {
        T value{};
        if (!CLI::detail::lexical_cast(input, value)) return "'" + input + "' is not " + kind + " (expected one in " + range + ")";
        if (value < lo || value > hi) return input + " is outside " + range;
        return {};
      },
      kind + " in " + range);
}

}  // namespace sbp

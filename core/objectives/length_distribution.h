// How long the sequences of a random packed batch are (`run --pack`): each row of T positions is filled with
// sequences drawn in order from the distribution, the last one cut to fit the row (a ragged last pack: a short
// sequence, down to one token, as packers that wrap leave it). Seeded: one seed gives the same rows everywhere.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sbp {

struct LengthDistribution {
  // "" (not packed), "uniform" (min..max, each length equally likely), "lognormal" (documents: round(median *
  // exp(sigma * N(0, 1))), at least 1) or "fixed" (every sequence `length` long).
  std::string kind;
  std::int64_t min = 1, max = 1, length = 1;
  double median = 1, sigma = 1;

  bool packed() const { return !kind.empty(); }
  // "uniform:min=16,max=64", "lognormal:median=512,sigma=1", "fixed:length=100"; parse(spec()) gives the same.
  std::string spec() const;
  // Throws InputError naming `flag`, the kind or the option.
  static LengthDistribution parse(const std::string& text, const std::string& flag = "--pack");
  // Each of `rows` rows of T positions: its sequences' lengths, each >= 1, summing to T.
  std::vector<std::vector<std::int64_t>> draw(std::int64_t rows, std::int64_t T, std::uint64_t seed) const;
};

}  // namespace sbp

#include "core/objectives/length_distribution.h"

#include <algorithm>
#include <cmath>
#include <random>

#include <fmt/format.h>

#include "core/io/input_error.h"
#include "core/io/spec.h"

namespace sbp {

std::string LengthDistribution::spec() const {
  if (kind == "uniform") return fmt::format("uniform:min={},max={}", min, max);
  if (kind == "lognormal") return fmt::format("lognormal:median={},sigma={}", median, sigma);
  if (kind == "fixed") return fmt::format("fixed:length={}", length);
  return "";
}

LengthDistribution LengthDistribution::parse(const std::string& text, const std::string& flag) {
  const auto spec = parse_spec(text, flag + " length distribution");
  LengthDistribution d;
  d.kind = spec.name;
  if (d.kind == "uniform") {
    spec.check_keys({"min", "max"});
    d.min = spec.get_int("min", 1, 1);
    d.max = spec.get_int("max", 0, 1);
    if (!spec.options.count("max")) throw InputError(flag + " " + text + ": uniform needs max=N (and optionally min=N)");
    if (d.max < d.min) throw InputError(fmt::format("{} {}: max={} is below min={}", flag, text, d.max, d.min));
  } else if (d.kind == "lognormal") {
    spec.check_keys({"median", "sigma"});
    if (!spec.options.count("median")) throw InputError(flag + " " + text + ": lognormal needs median=N");
    d.median = spec.get_double("median", 1, 1, 1e12);
    d.sigma = spec.get_double("sigma", 1, 0, 10);
  } else if (d.kind == "fixed") {
    spec.check_keys({"length"});
    if (!spec.options.count("length")) throw InputError(flag + " " + text + ": fixed needs length=N");
    d.length = spec.get_int("length", 1, 1);
  } else {
    throw InputError(flag + " " + text + ": unknown length distribution '" + d.kind +
                     "' (uniform:min=A,max=B, lognormal:median=M,sigma=S or fixed:length=L)");
  }
  return d;
}

std::vector<std::vector<std::int64_t>> LengthDistribution::draw(std::int64_t rows, std::int64_t T,
                                                                std::uint64_t seed) const {
  std::mt19937_64 rng(seed ^ 0x9ac4ed5eULL);
  const auto one = [&]() -> std::int64_t {
    if (kind == "uniform") return std::uniform_int_distribution<std::int64_t>(min, max)(rng);
    if (kind == "lognormal") {  // clamped to T before rounding: a long tail must not overflow the integer
      const auto x = median * std::exp(sigma * std::normal_distribution<double>()(rng));
      return x >= double(T) ? T : std::max<std::int64_t>(1, std::llround(x));
    }
    return length;
  };
  std::vector<std::vector<std::int64_t>> out(static_cast<std::size_t>(rows));
  for (auto& row : out)
    for (std::int64_t used = 0; used < T;) {
      const auto L = std::min(one(), T - used);  // the row's last sequence is cut to fit
      row.push_back(L);
      used += L;
    }
  return out;
}

}  // namespace sbp

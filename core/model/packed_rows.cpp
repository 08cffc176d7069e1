#include "core/model/packed_rows.h"

#include <algorithm>
#include <stdexcept>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "core/io/input_error.h"

namespace sbp {
namespace {

// An integer tensor as int64 values on the CPU, contiguous; InputError naming it otherwise.
at::Tensor integer_values(const at::Tensor& t, const std::string& name, const std::string& source) {
  if (!at::isIntegralType(t.scalar_type(), /*includeBool=*/false))
    throw InputError(fmt::format("{}: {} must be an integer tensor (int64 or int32), got {}", source, name,
                                 c10::toString(t.scalar_type())));
  return t.to(at::kCPU, at::kLong).contiguous();
}

}  // namespace

PackedRows::PackedRows(std::vector<std::vector<std::int64_t>> starts, std::int64_t seq_len)
    : starts_(std::move(starts)), seq_len_(seq_len) {
  if (starts_.empty() || seq_len_ < 1) throw std::logic_error("PackedRows: no rows or no positions");
  position_ids_ = at::empty({rows(), seq_len_}, at::kLong);
  auto ids = position_ids_.accessor<std::int64_t, 2>();
  for (std::int64_t b = 0; b < rows(); ++b) {
    const auto& s = starts_[std::size_t(b)];
    if (s.empty() || s.front() != 0 || !std::is_sorted(s.begin(), s.end()) ||
        std::adjacent_find(s.begin(), s.end()) != s.end() || s.back() >= seq_len_)
      throw std::logic_error("PackedRows: the starts of a row ascend from 0 below T");
    for (std::size_t i = 0; i < s.size(); ++i) {
      const auto end = i + 1 < s.size() ? s[i + 1] : seq_len_;
      for (auto t = s[i]; t < end; ++t) ids[b][t] = t - s[i];
    }
  }
}

std::shared_ptr<const PackedRows> PackedRows::from_position_ids(const at::Tensor& position_ids,
                                                                const std::string& source) {
  if (position_ids.dim() != 2 || position_ids.size(0) < 1 || position_ids.size(1) < 1)
    throw InputError(fmt::format("{}: position_ids must be [B, T], got {}", source, c10::str(position_ids.sizes())));
  const auto ids = integer_values(position_ids, "position_ids", source);
  const auto a = ids.accessor<std::int64_t, 2>();
  const auto B = ids.size(0), T = ids.size(1);
  std::vector<std::vector<std::int64_t>> starts(static_cast<std::size_t>(B));
  for (std::int64_t b = 0; b < B; ++b) {
    if (a[b][0] != 0)
      throw InputError(fmt::format("{}: position_ids row {}, position 0 is {}: a row starts with a sequence, at 0",
                                   source, b, a[b][0]));
    for (std::int64_t t = 0; t < T; ++t) {
      if (a[b][t] == 0) {
        starts[std::size_t(b)].push_back(t);
      } else if (a[b][t] != a[b][t - 1] + 1) {
        throw InputError(fmt::format("{}: position_ids row {}, position {} is {} after {}: within a sequence the "
                                     "positions count 0, 1, 2, ..., and each sequence starts at 0 (as "
                                     "DataCollatorWithFlattening writes them)", source, b, t, a[b][t], a[b][t - 1]));
      }
    }
  }
  return std::make_shared<const PackedRows>(std::move(starts), T);
}

std::shared_ptr<const PackedRows> PackedRows::from_cu_seqlens(const at::Tensor& cu_seqlens, std::int64_t rows,
                                                              std::int64_t seq_len, const std::string& source) {
  if (cu_seqlens.dim() != 1 || cu_seqlens.size(0) < 2)
    throw InputError(fmt::format("{}: cu_seqlens must be [n + 1] (n >= 1 sequences), got {}", source,
                                 c10::str(cu_seqlens.sizes())));
  const auto cu = integer_values(cu_seqlens, "cu_seqlens", source);
  const auto c = cu.accessor<std::int64_t, 1>();
  const auto n = cu.size(0) - 1, total = rows * seq_len;
  // Where a flattened token is: "row r, position p".
  const auto where = [&](std::int64_t token) { return fmt::format("row {}, position {}", token / seq_len, token % seq_len); };
  if (c[0] != 0) throw InputError(fmt::format("{}: cu_seqlens[0] is {}: the first sequence starts at 0", source, c[0]));
  std::vector<std::vector<std::int64_t>> starts(static_cast<std::size_t>(rows));
  for (std::int64_t i = 1; i <= n; ++i) {
    const auto start = c[i - 1], end = c[i];
    if (end <= start)
      throw InputError(fmt::format("{}: cu_seqlens[{}] = {} after {}: sequence {} (at {}) is {}; every sequence holds "
                                   "a token", source, i, end, start, i - 1, where(start),
                                   end == start ? "empty" : "of negative length"));
    if (end > total)
      throw InputError(fmt::format("{}: cu_seqlens[{}] = {} is past the batch's {} tokens ({} rows of T = {}): "
                                   "sequence {} from {} ends beyond it", source, i, end, total, rows, seq_len, i - 1,
                                   where(start)));
    if (start / seq_len != (end - 1) / seq_len)
      throw InputError(fmt::format("{}: cu_seqlens[{}] = {}: sequence {} from {} runs past the end of its row (T = {}); "
                                   "a sequence lies within one row", source, i, end, i - 1, where(start), seq_len));
    starts[std::size_t(start / seq_len)].push_back(start % seq_len);
  }
  if (c[n] != total)
    throw InputError(fmt::format("{}: cu_seqlens ends at {}, before the batch's {} tokens ({} rows of T = {}): every "
                                 "position belongs to a sequence (a right-padded tail too)", source, c[n], total, rows,
                                 seq_len));
  return std::make_shared<const PackedRows>(std::move(starts), seq_len);
}

std::shared_ptr<const PackedRows> PackedRows::from_lengths(const std::vector<std::vector<std::int64_t>>& lengths,
                                                           std::int64_t seq_len) {
  std::vector<std::vector<std::int64_t>> starts;
  for (const auto& row : lengths) {
    std::vector<std::int64_t> s;
    std::int64_t start = 0;
    for (const auto L : row) {
      if (L < 1) throw std::logic_error("PackedRows::from_lengths: an empty sequence");
      s.push_back(start);
      start += L;
    }
    if (start != seq_len) throw std::logic_error("PackedRows::from_lengths: a row's lengths do not sum to T");
    starts.push_back(std::move(s));
  }
  return std::make_shared<const PackedRows>(std::move(starts), seq_len);
}

std::int64_t PackedRows::sequences() const {
  std::int64_t n = 0;
  for (const auto& s : starts_) n += std::int64_t(s.size());
  return n;
}

std::int64_t PackedRows::sequence_start(std::int64_t row, std::int64_t position) const {
  const auto& s = starts(row);
  return *(std::upper_bound(s.begin(), s.end(), position) - 1);
}

std::int64_t PackedRows::sequence_end(std::int64_t row, std::int64_t position) const {
  const auto& s = starts(row);
  const auto next = std::upper_bound(s.begin(), s.end(), position);
  return next == s.end() ? seq_len_ : *next;
}

at::Tensor PackedRows::cu_seqlens() const {
  std::vector<std::int32_t> cu = {0};
  for (std::int64_t b = 0; b < rows(); ++b)
    for (std::size_t i = 0; i < starts_[std::size_t(b)].size(); ++i) {
      const auto& s = starts_[std::size_t(b)];
      cu.push_back(std::int32_t(b * seq_len_ + (i + 1 < s.size() ? s[i + 1] : seq_len_)));
    }
  return at::tensor(cu, at::kInt);
}

std::shared_ptr<const PackedRows> PackedRows::select_rows(const std::vector<std::int64_t>& index) const {
  std::vector<std::vector<std::int64_t>> starts;
  for (const auto b : index) starts.push_back(this->starts(b));
  return std::make_shared<const PackedRows>(std::move(starts), seq_len_);
}

at::Tensor PackedRows::positions(std::int64_t s, std::int64_t e) const { return position_ids_.slice(1, s, e); }

std::vector<PackedRows::Run> PackedRows::runs(std::int64_t row, std::int64_t s, std::int64_t e) const {
  std::vector<Run> out;
  for (auto begin = s; begin < e;) {
    const auto end = std::min(e, sequence_end(row, begin));
    out.push_back({begin, end, sequence_start(row, begin)});
    begin = end;
  }
  return out;
}

}  // namespace sbp

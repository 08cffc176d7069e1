#include "core/model/packed_attention.h"

#include <vector>

#include <ATen/ATen.h>

#include "core/model/chunk_attention.h"
#include "core/model/kv_source.h"
#include "core/model/packed_rows.h"

namespace sbp {
namespace {

// x cut along `dim` into pieces of `lengths` (summing to its size), as one split: its backward is one concatenation
// of the pieces' gradients, where a narrow per piece would pad a zero-filled copy of x for each.
std::vector<at::Tensor> pieces(const at::Tensor& x, std::int64_t dim, const std::vector<std::int64_t>& lengths) {
  if (lengths.size() == 1) return {x};
  return x.split_with_sizes(lengths, dim);
}

std::vector<at::Tensor> batch_rows(const at::Tensor& x) {
  if (x.size(0) == 1) return {x};
  return x.split(1, 0);
}

}  // namespace

at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::int64_t q_start,
                            double scale, const KVGradSums* sums, const PackedRows& rows) {
  const auto B = q.size(0), e = q_start + q.size(2);
  TORCH_CHECK(B == rows.rows() && e <= rows.seq_len(), "packed_attention: queries of ", B, " rows up to position ", e,
              " for packed rows of ", rows.rows(), " x ", rows.seq_len());
  TORCH_CHECK(k.size(2) == e && v.size(2) == e, "packed_attention: keys must be [0, q_start + c) = [0, ", e, ")");
  const auto qs = batch_rows(q), ks = batch_rows(k), vs = batch_rows(v);
  std::vector<at::Tensor> out_rows;
  for (std::int64_t b = 0; b < B; ++b) {
    const auto runs = rows.runs(b, q_start, e);
    // The keys the row's queries can see begin at the start of its first run's sequence: everything before it is
    // left unread. After the first run every run starts its own sequence, so the runs' key ranges tile [first, e).
    const auto first = runs.front().sequence_start;
    std::vector<std::int64_t> query_lengths, key_lengths;
    for (std::size_t i = 0; i < runs.size(); ++i) {
      const auto& r = runs[i];
      TORCH_CHECK(r.begin == (i ? runs[i - 1].end : q_start) && r.begin < r.end && r.sequence_start <= r.begin &&
                      (i == 0 || r.sequence_start == r.begin),
                  "packed_attention: the runs of row ", b, " do not cut [", q_start, ", ", e, ") at sequence starts");
      query_lengths.push_back(r.end - r.begin);
      key_lengths.push_back(r.end - r.sequence_start);
    }
    const auto q_runs = pieces(qs[b], 2, query_lengths);
    const auto k_runs = pieces(narrow_or_whole(ks[b], 2, first, e - first), 2, key_lengths);
    const auto v_runs = pieces(narrow_or_whole(vs[b], 2, first, e - first), 2, key_lengths);
    std::vector<at::Tensor> outs;
    for (std::size_t i = 0; i < runs.size(); ++i) {
      const auto& r = runs[i];
      // A run: its sequence's keys [sequence_start, end), its queries the last end - begin of them (bottom-right).
      if (!sums) {
        outs.push_back(prefix_attention(q_runs[i], k_runs[i], v_runs[i], r.begin - r.sequence_start, scale));
        continue;
      }
      const auto length = r.end - r.sequence_start;
      const KVGradSums run_sums{narrow_or_whole(sums->dK, 0, b, 1).narrow(2, r.sequence_start, length),
                                narrow_or_whole(sums->dV, 0, b, 1).narrow(2, r.sequence_start, length)};
      outs.push_back(prefix_attention(q_runs[i], k_runs[i], v_runs[i], r.begin - r.sequence_start, scale, &run_sums));
    }
    out_rows.push_back(cat_or_one(outs, 2));
  }
  return cat_or_one(out_rows, 0);
}

}  // namespace sbp

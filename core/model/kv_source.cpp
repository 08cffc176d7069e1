#include "core/model/kv_source.h"

#include <algorithm>

#include <ATen/ATen.h>

namespace sbp {

namespace {

// Whole sequences on one process: every answer is the tensor asked about, so that the model and the methods do
// exactly one process's work through the same calls an exchange answers.
class LocalKV final : public KVSource {
 public:
  SequenceShard shard_of(std::int64_t rows) const override { return {0, 1, rows, {{0, rows}}}; }
  bool is_local() const override { return true; }
  at::Tensor own_positions(const at::Tensor& whole, std::int64_t) const override { return whole; }
  at::Tensor gather(const at::Tensor& local) override { return local; }
  std::pair<at::Tensor, at::Tensor> gather_with_graph(const at::Tensor& k, const at::Tensor& v) override {
    return {k, v};
  }
  at::Tensor scatter_sum(const at::Tensor& whole) override { return whole; }
  void sum_over_group(at::Tensor&) override {}
};

}  // namespace

void KVSource::for_each_chunk(std::int64_t rows, std::int64_t c,
                              const std::function<void(std::int64_t s, std::int64_t e, std::int64_t position)>& f) const {
  shard_of(rows).for_each_block([&](const SequenceShard::Block& b, std::int64_t offset) {
    for (std::int64_t s = 0; s < b.length(); s += c) f(offset + s, offset + std::min(b.length(), s + c), b.start + s);
  });
}

KVSource& local_kv_source() {
  static LocalKV local;
  return local;
}

at::Tensor narrow_or_whole(const at::Tensor& x, std::int64_t dim, std::int64_t start, std::int64_t length) {
  return start == 0 && length == x.size(dim) ? x : x.narrow(dim, start, length);
}

at::Tensor cat_or_one(const std::vector<at::Tensor>& parts, std::int64_t dim) {
  return parts.size() == 1 ? parts.front() : at::cat(parts, dim);
}

}  // namespace sbp

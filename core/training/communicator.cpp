#include "core/training/communicator.h"

#include <ATen/ATen.h>

namespace sbp {

std::optional<Disagreement> first_disagreement(Communicator& comm, const std::vector<std::int64_t>& values) {
  const auto mine = at::tensor(values, at::TensorOptions(at::kLong)).to(comm.device());
  const auto all = comm.all_gather(mine).cpu();  // [world, values]
  const auto* v = all.data_ptr<std::int64_t>();
  const auto n = values.size();
  for (std::size_t i = 0; i < n; ++i)
    for (int r = 1; r < comm.world_size(); ++r)
      if (v[std::size_t(r) * n + i] != v[i]) return Disagreement{r, i, v[std::size_t(r) * n + i], v[i]};
  return std::nullopt;
}

}  // namespace sbp

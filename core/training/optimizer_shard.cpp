#include "core/training/optimizer_shard.h"

#include <algorithm>

namespace sbp {

std::vector<ParamShape> optimizer_shard(const std::vector<ParamShape>& params, const Workload& w) {
  if (!w.data_parallel() || w.zero_stage() == 0) return params;
  std::vector<ParamShape> out;
  for (const auto& p : params) {
    std::int64_t numel = 1;
    for (const auto n : p.shape) numel *= n;
    out.push_back({p.name, {(numel + w.world_size() - 1) / w.world_size()}, p.dtype});
  }
  return out;
}

void add_projected_optimizer(Workload& w, const OptimizerOptions& options) {
  const auto& c = w.config;
  const bool lora = w.lora_rank > 0;
  const std::int64_t total = lora ? w.lora_parameters : c.num_parameters();
  const std::int64_t largest =
      std::min(total, lora ? w.lora_rank * std::max({c.intermediate_size, c.hidden_size,
                                                      c.num_attention_heads * c.head_dim})
                           : c.vocab_size * c.hidden_size);
  std::vector<ParamShape> shapes;
  for (std::int64_t left = total; left > 0; left -= largest)
    shapes.push_back({"weight", {std::min(left, largest)}, w.gradient_dtype()});
  const auto m = optimizer_memory(options, optimizer_shard(shapes, w));
  w.optimizer_state_bytes = m.state_bytes;
  w.optimizer_update_bytes = m.step_temporary_bytes;
}

}  // namespace sbp

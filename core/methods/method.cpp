#include "core/methods/method.h"

#include <stdexcept>

#include <ATen/core/grad_mode.h>

#include "core/methods/method_entry.h"
#include "core/model/kv_source.h"
#include "core/model/model.h"
#include "core/io/input_error.h"

namespace sbp {

StepResult BackpropMethod::step(Model& model, const Objective& objective, const Batch& batch,
                                const StepOptions& options) {
  if (!model.kv_source().is_local() && !runs_sequence_shards())
    throw InputError("method " + spec() + " does not run on a sequence-parallel rank's shard yet (standard "
                                "BP and checkpointing do)");
  if (!options.accumulate) model.zero_grad();
  const auto prepared = objective.prepare(batch, model.config(), options.step_totals);
  // Every piece of the model reads the batch's sequences (RoPE positions, attention within each sequence); on a
  // sequence-parallel rank too, at the global positions of its shard (the K/V source keeps each query within its
  // sequence across ranks).
  const Model::PackedRowsInUse packed(model, batch.packed.get());
  PhaseClock clock;
  const auto start = std::chrono::steady_clock::now();
  // The embedding and the head (final norm, lm_head) are used at both ends of the step: in use throughout.
  auto outer = model.embedding_trainable();
  for (const auto& t : model.head_trainable()) outer.push_back(t);
  parameter_use({"embedding+head", outer, true});
  double loss = 0;
  try {
    loss = backprop(model, prepared, batch, clock);
  } catch (...) {
    parameter_use({"embedding+head", outer, false});
    throw;
  }
  parameter_use({"embedding+head", outer, false});
  return StepResult::finish(loss, start, clock, model.device());
}

void BackpropMethod::parameter_use(ParameterUse use) const {
  if (!parameter_use_.empty() && !use.tensors.empty()) parameter_use_(use);
}

void BackpropMethod::layer_use(const Model& model, int layer, bool begin) const {
  if (!parameter_use_.empty()) parameter_use({"layer." + std::to_string(layer), model.layer_trainable(layer), begin});
}

LayerCheckpoints BackpropMethod::checkpointed_forward(
    const Model& model, const Batch& batch, PhaseClock& clock,
    const std::function<at::Tensor(int layer, const at::Tensor& h)>& layer) const {
  const int L = int(model.config().num_hidden_layers);
  LayerCheckpoints H(L + 1, checkpoint_tier_);
  Phase phase(clock, "forward");
  at::NoGradGuard no_grad;
  H.set(0, model.embed(rank_tokens(model, batch)));
  for (int l = 0; l < L; ++l) {
    const LayerInUse use(*this, model, l);
    H.set(l + 1, layer(l, H.get(l)));
    H.done_reading(l);
  }
  return H;
}

at::Tensor BackpropMethod::rank_tokens(const Model& model, const Batch& batch) {
  return model.kv_source().own_positions(batch.input_ids, 1);
}

at::Tensor BackpropMethod::rank_loss(const Model& model, const PreparedObjective& prepared, const at::Tensor& logits) {
  auto& source = model.kv_source();
  const auto rows = logits.size(1);
  auto objective = prepared;
  if (prepared.needs_statistics() && !source.chunk_holds_sequence(rows, rows)) {
    // A row term couples positions across ranks: its statistics summed over the group first (each block's logits
    // copied, as the pass overwrites what it reads).
    at::NoGradGuard no_grad;
    StatisticsPass statistics(prepared);
    source.for_each_chunk(rows, rows, [&](std::int64_t s, std::int64_t e, std::int64_t position) {
      auto copy = logits.narrow(1, s, e - s).clone();
      statistics.add(copy, position);
    });
    objective = statistics.finish([&](at::Tensor& values) { source.sum_over_group(values); });
  }
  // Block by block at each block's global start (locally one block: the whole logits at 0).
  at::Tensor loss;
  source.for_each_chunk(rows, rows, [&](std::int64_t s, std::int64_t e, std::int64_t position) {
    auto term = objective.chunk_loss(narrow_or_whole(logits, 1, s, e - s), position);
    loss = loss.defined() ? loss + term : term;
  });
  return loss;
}

BackpropMethod::LayerInUse::LayerInUse(const BackpropMethod& method, const Model& model, int layer)
    : method_(method), layer_(layer) {
  mark_layer(layer, true);
  if (method.parameter_use_.empty()) return;
  use_ = {"layer." + std::to_string(layer), model.layer_trainable(layer), true};
  method_.parameter_use(use_);
}

BackpropMethod::LayerInUse::~LayerInUse() {
  mark_layer(layer_, false);
  if (method_.parameter_use_.empty() || use_.tensors.empty()) return;
  use_.begin = false;
  method_.parameter_use(use_);
}

void BackpropMethod::gradient_ready(std::string name, std::vector<at::Tensor> tensors) const {
  if (!gradient_ready_.empty() && !tensors.empty()) gradient_ready_({std::move(name), std::move(tensors)});
}

void BackpropMethod::layer_ready(const Model& model, int layer) const {
  if (!gradient_ready_.empty()) gradient_ready("layer." + std::to_string(layer), model.layer_trainable(layer));
}

void BackpropMethod::head_ready(const Model& model) const {
  if (!gradient_ready_.empty()) gradient_ready("head", model.head_trainable());
}

void BackpropMethod::embedding_ready(const Model& model) const {
  if (!gradient_ready_.empty()) gradient_ready("embedding", model.embedding_trainable());
}

std::int64_t MethodArgs::get(const std::string& key) const {
  for (const auto& o : options_)
    if (o.key == key) return spec_.get_int(key, o.default_value, o.minimum);
  throw std::logic_error("method '" + spec_.name + "' reads option '" + key + "', which its entry does not declare");
}

std::string MethodEntry::usage() const {
  std::string out = name;
  for (std::size_t i = 0; i < options.size(); ++i)
    out += (i ? "," : "[:") + options[i].key + "=" + std::to_string(options[i].default_value);
  return options.empty() ? out : out + "]";
}

}  // namespace sbp

#include "core/training/data_parallel.h"

#include <cmath>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/accumulate.h>

#include "core/methods/phase.h"
#include "core/offload/offload_tier.h"
#include "core/training/optimizer.h"
#include "core/io/input_error.h"

namespace sbp {
namespace {

const void* key(const at::Tensor& t) { return t.unsafeGetTensorImpl(); }

// Stage 3 frees a tensor by giving it empty data: the tensor object (the model's, autograd's saved reference) stays.
void free_data(const at::Tensor& p) { p.set_data(at::empty({0}, p.options())); }

}  // namespace

std::vector<std::int64_t> DataParallel::full_sizes(const at::Tensor& p) const {
  const auto it = residence_.find(key(p));
  return it == residence_.end() ? p.sizes().vec() : it->second.sizes;
}

// A group's gradients, defined (zeros where a rank has none; full-size even when stage 3 has freed the tensor).
std::vector<at::Tensor> DataParallel::group_gradients(const GradientGroup& group) const {
  std::vector<at::Tensor> grads;
  for (const auto& p : group.tensors) {
    if (!p.grad().defined()) p.mutable_grad() = at::zeros(full_sizes(p), p.options());
    grads.push_back(p.grad());
  }
  return grads;
}

DataParallel::DataParallel(Communicator& communicator, int zero_stage, OffloadTier* parameter_tier)
    : communicator_(communicator), stage_(zero_stage), parameter_tier_(parameter_tier) {
  if (zero_stage < 0 || zero_stage > 3)
    throw InputError("--zero " + std::to_string(zero_stage) + ": the stages are 0 (DDP), 1, 2 and 3");
  if (parameter_tier && zero_stage != 3)
    throw InputError("--offload params: the parameters move as ZeRO-3's slices (--zero 3), not at stage " +
                                std::to_string(zero_stage));
}

at::TensorOptions DataParallel::on_device(at::ScalarType dtype) const {
  return at::TensorOptions().dtype(dtype).device(communicator_.device());
}

DataParallel::Slice DataParallel::slice_of(std::int64_t numel, int rank) const {
  const std::int64_t n = communicator_.world_size();
  const auto chunk = (numel + n - 1) / n;
  const auto start = std::min(numel, rank * chunk);
  return {start, std::min(numel, start + chunk), chunk};
}

TensorList DataParallel::optimizer_params(const TensorList& trainable) {
  if (stage_ == 0) return trainable;
  TensorList out;
  for (const auto& [name, p] : trainable) {
    const auto s = slice_of(p.numel(), communicator_.rank());
    auto shard = p.detach().view({-1}).slice(0, s.start, s.end);  // stages 1-2: writes land in the model's tensor
    if (stage_ == 3) {
      // The rank's part of the parameter, the only one it keeps (in the tier with parameter offload).
      shard = parameter_tier_ ? parameter_tier_->store(shard) : shard.clone();
      residence_[key(p)] = {p.sizes().vec(), 0};
      free_data(p);
    }
    shards_[key(p)] = shard;
    by_name_[name] = p;
    out.push_back({name, shard});
  }
  // The slices' copies into the tier done before the optimizer or a gather reads them on the host.
  if (parameter_tier_ && !trainable.empty()) synchronize(trainable.front().tensor.device());
  return out;
}

const at::Tensor* DataParallel::sliced_tensor_of(const std::string& state_name) const {
  const auto dot = state_name.rfind('.');
  if (dot == std::string::npos) return nullptr;
  const auto it = by_name_.find(state_name.substr(0, dot));
  return it == by_name_.end() ? nullptr : &it->second;
}

TensorList DataParallel::whole_state(const TensorList& state) {
  at::NoGradGuard no_grad;
  TensorList out;
  for (const auto& [name, t] : state) {
    const auto* p = sliced_tensor_of(name);
    if (!p || t.dim() == 0) {
      out.push_back({name, t});
      continue;
    }
    const auto sizes = full_sizes(*p);
    const auto numel = c10::multiply_integers(sizes);
    auto mine = at::zeros({slice_of(numel, 0).padded}, t.options());
    mine.slice(0, 0, t.numel()).copy_(t.reshape({-1}));
    const auto all = communicator_.all_gather(mine);
    auto whole = at::empty({numel}, t.options());
    for (int q = 0; q < communicator_.world_size(); ++q) {
      const auto s = slice_of(numel, q);
      whole.slice(0, s.start, s.end).copy_(all[q].slice(0, 0, s.end - s.start));
    }
    out.push_back({name, whole.view(sizes)});
  }
  return out;
}

TensorList DataParallel::sliced_state(const TensorList& whole) {
  TensorList out;
  for (const auto& [name, t] : whole) {
    const auto* p = sliced_tensor_of(name);
    if (!p || t.dim() == 0 || t.numel() != c10::multiply_integers(full_sizes(*p))) {
      out.push_back({name, t});  // not a slice's; a misshapen one is refused by Optimizer::load_state
      continue;
    }
    const auto s = slice_of(t.numel(), communicator_.rank());
    out.push_back({name, t.reshape({-1}).slice(0, s.start, s.end)});
  }
  return out;
}

std::int64_t DataParallel::sliced_parameter_bytes() const {
  std::int64_t bytes = 0;
  if (stage_ == 3 && !parameter_tier_)
    for (const auto& [k, shard] : shards_) bytes += std::int64_t(shard.nbytes());
  return bytes;
}

void DataParallel::unshard() {
  if (stage_ < 3 || residence_.empty()) return;
  ParameterUse all{"model", {}, true};
  for (const auto& [name, p] : by_name_) all.tensors.push_back(p);
  use(all);
  residence_.clear();
  shards_.clear();
  by_name_.clear();
}

void DataParallel::keep_slices() {
  if (stage_ < 3) return;
  at::NoGradGuard no_grad;
  for (const auto& [name, p] : by_name_) {
    const auto s = slice_of(p.numel(), communicator_.rank());
    shards_.at(key(p)).copy_(p.detach().reshape({-1}).slice(0, s.start, s.end));
  }
}

void DataParallel::use(const ParameterUse& use) {
  if (stage_ < 3) return;
  at::NoGradGuard no_grad;
  if (!use.begin) {
    for (const auto& p : use.tensors) {
      const auto it = residence_.find(key(p));
      if (it != residence_.end() && it->second.users > 0 && --it->second.users == 0) free_data(p);
    }
    return;
  }
  std::vector<at::Tensor> missing;  // tensors of this use that are not present yet
  for (const auto& p : use.tensors) {
    const auto it = residence_.find(key(p));
    if (it != residence_.end() && it->second.users++ == 0) missing.push_back(p);
  }
  if (missing.empty()) return;
  // One all-gather: every rank's block holds its slice of each missing tensor, each padded to the slice length.
  const auto options = shards_.at(key(missing.front())).options();
  std::int64_t length = 0;
  for (const auto& p : missing) {
    if (p.scalar_type() != options.dtype())
      throw std::logic_error("ZeRO-3: the tensors of '" + use.name + "' do not share one dtype");
    length += slice_of(c10::multiply_integers(residence_.at(key(p)).sizes), 0).padded;
  }
  auto mine = at::zeros({length}, options);
  std::int64_t offset = 0;
  for (const auto& p : missing) {
    const auto& shard = shards_.at(key(p));
    mine.slice(0, offset, offset + shard.numel()).copy_(shard);
    offset += slice_of(c10::multiply_integers(residence_.at(key(p)).sizes), 0).padded;
  }
  const auto all = communicator_.all_gather(mine);  // [N, length]
  mine.reset();
  offset = 0;
  for (const auto& p : missing) {
    const auto& sizes = residence_.at(key(p)).sizes;
    const auto numel = c10::multiply_integers(sizes);
    auto full = at::empty({numel}, options);
    for (int q = 0; q < communicator_.world_size(); ++q) {
      const auto s = slice_of(numel, q);
      full.slice(0, s.start, s.end).copy_(all[q].slice(0, offset, offset + (s.end - s.start)));
    }
    offset += slice_of(numel, 0).padded;
    p.set_data(full.view(sizes));
  }
}

DataParallel::WholeModel::WholeModel(DataParallel& parallel, const TensorList& trainable)
    : parallel_(parallel), use_{"model", {}, true} {
  for (const auto& p : trainable) use_.tensors.push_back(p.tensor);
  parallel_.use(use_);
}

DataParallel::WholeModel::~WholeModel() {
  use_.begin = false;
  parallel_.use(use_);
}

StepTotals DataParallel::global_totals(const StepTotals& local) {
  std::vector<at::Tensor> t = {at::tensor(std::vector<std::int64_t>{local.rows, local.tokens}, on_device(at::kLong))};
  communicator_.all_reduce_sum(t);
  return {t[0][0].item<std::int64_t>(), t[0][1].item<std::int64_t>()};
}

void DataParallel::reduce(const GradientGroup& group, OffloadTier* tier) {
  at::NoGradGuard no_grad;
  auto grads = group_gradients(group);
  if (grads.empty()) return;
  groups_.push_back({group.name, group.tensors});
  if (stage_ < 2) {
    // One collective per group: the gradients flattened into one buffer (a group's tensors share one dtype).
    std::vector<at::Tensor> views;
    for (const auto& g : grads) views.push_back(g.reshape({-1}));
    std::vector<at::Tensor> flat = {at::cat(views)};
    communicator_.all_reduce_sum(flat);
    std::int64_t offset = 0;
    for (auto& g : grads) {
      g.copy_(flat[0].slice(0, offset, offset + g.numel()).view(g.sizes()));
      offset += g.numel();
    }
    if (tier) store_gradients(*tier, group.tensors);
    return;
  }
  // Stage 2: block q of the buffer holds every tensor's slice q (each padded to its slice length), so that the
  // reduce-scatter hands each rank the sums of its own slices.
  const int n = communicator_.world_size(), rank = communicator_.rank();
  std::int64_t length = 0;
  for (const auto& g : grads) length += slice_of(g.numel(), 0).padded;
  auto buffer = at::zeros({n, length}, grads.front().options());
  std::int64_t offset = 0;
  for (const auto& g : grads) {
    const auto flat = g.reshape({-1});
    for (int q = 0; q < n; ++q) {
      const auto s = slice_of(g.numel(), q);
      buffer[q].slice(0, offset, offset + (s.end - s.start)).copy_(flat.slice(0, s.start, s.end));
    }
    offset += slice_of(g.numel(), 0).padded;
  }
  const auto mine = communicator_.reduce_scatter_sum(buffer);
  buffer.reset();
  offset = 0;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const auto& p = group.tensors[i];
    const auto s = slice_of(grads[i].numel(), rank);
    const auto slice = mine.slice(0, offset, offset + (s.end - s.start));
    shard_grads_[key(p)] = tier ? tier->store(slice) : slice;
    offset += s.padded;
    p.mutable_grad().reset();  // the full-size gradient is not kept (the bucket is one group)
  }
}

double DataParallel::global_loss(double local) {
  std::vector<at::Tensor> t = {at::tensor(std::vector<double>{local}, on_device(at::kDouble))};
  communicator_.all_reduce_sum(t);
  return t[0].item<double>();
}

double DataParallel::clip_grad_norm(const TensorList& optimizer_params, double max_norm) {
  at::NoGradGuard no_grad;
  if (stage_ == 0) {
    std::vector<at::Tensor> params;
    for (const auto& p : optimizer_params) params.push_back(p.tensor);
    return sbp::clip_grad_norm(params, max_norm);  // every rank holds the same full gradients
  }
  // The slices' gradients: views of the reduced full gradients (stage 1) or the reduce-scattered slices (stage 2).
  for (const auto& [group_name, tensors] : groups_)
    for (const auto& p : tensors) {
      auto& shard = shards_.at(key(p));
      if (stage_ == 1) {
        const auto s = slice_of(p.numel(), communicator_.rank());
        shard.mutable_grad() = p.grad().reshape({-1}).slice(0, s.start, s.end);
      } else {
        shard.mutable_grad() = shard_grads_.at(key(p));
      }
    }
  shard_grads_.clear();
  // torch's clip_grad_norm_ over the whole model's gradients: the 2-norm of all of them (summed over the ranks'
  // slices here, in fp64), each gradient multiplied by min(max_norm / (norm + 1e-6), 1).
  std::vector<at::Tensor> sum = {at::zeros({1}, on_device(at::kDouble))};
  for (const auto& p : optimizer_params)
    if (p.tensor.grad().defined()) sum[0] += p.tensor.grad().to(at::kDouble).square().sum();
  communicator_.all_reduce_sum(sum);
  const double norm = std::sqrt(sum[0].item<double>());
  const double coefficient = std::min(max_norm / (norm + 1e-6), 1.0);
  for (const auto& p : optimizer_params)
    if (p.tensor.grad().defined()) p.tensor.grad().mul_(coefficient);
  return norm;
}

void DataParallel::gather_updated() {
  at::NoGradGuard no_grad;
  if (stage_ == 0 || stage_ == 3) {
    for (auto& [k, shard] : shards_) shard.mutable_grad().reset();
    groups_.clear();
    return;
  }
  const int n = communicator_.world_size();
  for (const auto& [group_name, tensors] : groups_) {
    std::int64_t length = 0;
    for (const auto& p : tensors) length += slice_of(p.numel(), 0).padded;
    auto mine = at::zeros({length}, tensors.front().options());
    std::int64_t offset = 0;
    for (const auto& p : tensors) {
      const auto& shard = shards_.at(key(p));
      mine.slice(0, offset, offset + shard.numel()).copy_(shard);
      offset += slice_of(p.numel(), 0).padded;
    }
    const auto all = communicator_.all_gather(mine);  // [N, length]
    offset = 0;
    for (const auto& p : tensors) {
      auto flat = p.detach().view({-1});
      for (int q = 0; q < n; ++q) {
        const auto s = slice_of(p.numel(), q);
        flat.slice(0, s.start, s.end).copy_(all[q].slice(0, offset, offset + (s.end - s.start)));
      }
      offset += slice_of(p.numel(), 0).padded;
    }
  }
  for (auto& [k, shard] : shards_) shard.mutable_grad().reset();
  groups_.clear();
}

}  // namespace sbp

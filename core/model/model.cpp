#include "core/model/model.h"

#include <algorithm>

#include <cmath>
#include <map>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include "core/model/chunk_attention.h"
#include "core/model/packed_attention.h"
#include "core/model/packed_rows.h"
#include "core/model/gemm.h"
#include "core/model/vector_math.h"
#include "core/io/dtype.h"
#include "core/model/chunk_gradients.h"
#include "core/io/input_error.h"

namespace sbp {
namespace {

using Shape = std::vector<std::int64_t>;

std::string layer_prefix(std::int64_t i) { return "model.layers." + std::to_string(i) + "."; }

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

at::Tensor rotate_half(const at::Tensor& x) {  // [..., hd] -> [-x2, x1]
  const auto half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

}  // namespace

std::vector<std::pair<std::string, Shape>> parameter_shapes(const ModelConfig& c) {
  const auto d = c.hidden_size, qw = c.q_width(), kw = c.kv_width(), inter = c.intermediate_size;
  std::vector<std::pair<std::string, Shape>> out;
  out.push_back({"model.embed_tokens.weight", {c.vocab_size, d}});
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const auto p = layer_prefix(i);
    out.push_back({p + "input_layernorm.weight", {d}});
    out.push_back({p + "self_attn.q_proj.weight", {qw, d}});
    if (c.attention_bias) out.push_back({p + "self_attn.q_proj.bias", {qw}});
    out.push_back({p + "self_attn.k_proj.weight", {kw, d}});
    if (c.attention_bias) out.push_back({p + "self_attn.k_proj.bias", {kw}});
    out.push_back({p + "self_attn.v_proj.weight", {kw, d}});
    if (c.attention_bias) out.push_back({p + "self_attn.v_proj.bias", {kw}});
    out.push_back({p + "self_attn.o_proj.weight", {d, qw}});
    if (c.o_proj_bias) out.push_back({p + "self_attn.o_proj.bias", {d}});
    if (c.qk_norm) {
      out.push_back({p + "self_attn.q_norm.weight", {c.head_dim}});
      out.push_back({p + "self_attn.k_norm.weight", {c.head_dim}});
    }
    out.push_back({p + "post_attention_layernorm.weight", {d}});
    out.push_back({p + "mlp.gate_proj.weight", {inter, d}});
    out.push_back({p + "mlp.up_proj.weight", {inter, d}});
    out.push_back({p + "mlp.down_proj.weight", {d, inter}});
  }
  out.push_back({"model.norm.weight", {d}});
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", {c.vocab_size, d}});
  return out;
}

Model::Model(ModelConfig config, c10::ScalarType dtype, std::uint64_t seed)
    : config_(std::move(config)), dtype_(dtype), grad_dtype_(dtype) {
  config_.validate();
  dtype_name(dtype_);  // rejects non-floating dtypes
  gemm_paths(dtype_);  // a narrow dtype's GEMM paths are chosen now, before any step (core/model/gemm.h)
  spend_first_vector_math_calls();  // before the random weights (core/model/vector_math.h)
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  for (const auto& [name, shape] : parameter_shapes(config_)) {
    at::Tensor x;
    if (ends_with(name, "norm.weight") || ends_with(name, "layernorm.weight"))
      x = 1.0 + at::normal(0.0, 0.02, shape, gen, f32);
    else
      x = at::normal(0.0, 0.02, shape, gen, f32);
    parameters_.push_back({name, x.to(dtype_).requires_grad_(true)});
  }
  register_parameters();
}

Model::Model(ModelConfig config, c10::ScalarType dtype, const std::vector<NamedTensor>& tensors,
             const std::string& source)
    : config_(std::move(config)), dtype_(dtype), grad_dtype_(dtype) {
  config_.validate();
  dtype_name(dtype_);
  gemm_paths(dtype_);
  std::map<std::string, at::Tensor> by_name;
  for (const auto& t : tensors) by_name[t.name] = t.tensor;
  for (const auto& [name, shape] : parameter_shapes(config_)) {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw InputError(source + ": missing tensor '" + name + "'");
    if (it->second.sizes() != at::IntArrayRef(shape))
      throw InputError(source + ": tensor '" + name + "' has shape " + c10::str(it->second.sizes()) +
                               ", the config needs " + c10::str(at::IntArrayRef(shape)));
    if (!at::isFloatingType(it->second.scalar_type()))
      throw InputError(source + ": tensor '" + name + "' is not floating point");
    parameters_.push_back({name, it->second.to(dtype_).detach().requires_grad_(true)});
    by_name.erase(it);
  }
  // Tied checkpoints sometimes store lm_head.weight as a copy of the embedding: accept only an exact copy.
  if (auto it = by_name.find("lm_head.weight"); it != by_name.end() && config_.tie_word_embeddings) {
    if (!it->second.to(dtype_).equal(parameters_.front().tensor.detach()))
      throw InputError(source + ": tensor 'lm_head.weight' differs from the embedding, but the config ties them");
    by_name.erase(it);
  }
  if (!by_name.empty()) throw InputError(source + ": unexpected tensor '" + by_name.begin()->first + "'");
  register_parameters();
}

void Model::register_parameters() {
  std::map<std::string, at::Tensor> p;
  for (const auto& np : parameters_) p[np.name] = np.tensor;
  auto get = [&](const std::string& name) { return p.count(name) ? p[name] : at::Tensor(); };
  embed_ = get("model.embed_tokens.weight");
  lm_head_ = config_.tie_word_embeddings ? embed_ : get("lm_head.weight");
  norm_ = get("model.norm.weight");
  layers_.clear();
  for (std::int64_t i = 0; i < config_.num_hidden_layers; ++i) {
    const auto pre = layer_prefix(i);
    LayerWeights w;
    w.input_norm = get(pre + "input_layernorm.weight");
    w.q_w = get(pre + "self_attn.q_proj.weight");
    w.q_b = get(pre + "self_attn.q_proj.bias");
    w.k_w = get(pre + "self_attn.k_proj.weight");
    w.k_b = get(pre + "self_attn.k_proj.bias");
    w.v_w = get(pre + "self_attn.v_proj.weight");
    w.v_b = get(pre + "self_attn.v_proj.bias");
    w.o_w = get(pre + "self_attn.o_proj.weight");
    w.o_b = get(pre + "self_attn.o_proj.bias");
    w.q_norm = get(pre + "self_attn.q_norm.weight");
    w.k_norm = get(pre + "self_attn.k_norm.weight");
    w.post_norm = get(pre + "post_attention_layernorm.weight");
    w.gate_w = get(pre + "mlp.gate_proj.weight");
    w.up_w = get(pre + "mlp.up_proj.weight");
    w.down_w = get(pre + "mlp.down_proj.weight");
    layers_.push_back(w);
  }
  if (lora_.enabled()) attach_adapters();
  // Before the first VML call of the model (pow here, cos and sin in every rope): core/model/vector_math.h.
  spend_first_vector_math_calls();
  // HF: inv_freq = 1 / theta^(2i/hd), in fp32.
  const auto exponents = at::arange(0, config_.head_dim, 2, at::kLong).to(at::kFloat) / double(config_.head_dim);
  inv_freq_ = at::reciprocal(at::pow(config_.rope_theta, exponents)).to(embed_.device());
}

void Model::to(c10::Device device) {
  // Detached and re-marked: the moved tensor is the new leaf (a frozen base stays without requires_grad).
  for (auto* list : {&parameters_, &adapters_})
    for (auto& p : *list) p.tensor = p.tensor.detach().to(device).requires_grad_(p.tensor.requires_grad());
  register_parameters();
}

std::vector<NamedTensor> Model::gradients() const {
  std::vector<NamedTensor> out;
  for (const auto& p : trainable()) {
    const auto& g = p.tensor.grad();
    out.push_back({p.name, g.defined() ? g.detach() : at::zeros_like(p.tensor).detach()});
  }
  return out;
}

void Model::zero_grad() {
  for (const auto& p : trainable()) p.tensor.mutable_grad().reset();
}

namespace {

// [out, in] of a target's base weight.
std::pair<std::int64_t, std::int64_t> target_shape(const ModelConfig& c, const std::string& target) {
  if (target == "q") return {c.q_width(), c.hidden_size};
  if (target == "k" || target == "v") return {c.kv_width(), c.hidden_size};
  if (target == "o") return {c.hidden_size, c.q_width()};
  if (target == "down") return {c.hidden_size, c.intermediate_size};
  return {c.intermediate_size, c.hidden_size};  // gate, up
}

}  // namespace

std::int64_t lora_parameter_count(const ModelConfig& config, const LoraConfig& lora) {
  std::int64_t n = 0;
  for (const auto& t : lora.targets) {
    const auto [out, in] = target_shape(config, t);
    n += lora.rank * (in + out);
  }
  return n * config.num_hidden_layers;
}

void Model::add_lora(const LoraConfig& config, std::uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed ^ 0x10a4ULL);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  std::vector<NamedTensor> tensors;
  for (std::int64_t i = 0; i < config_.num_hidden_layers; ++i)
    for (const auto& t : lora_target_names()) {
      if (!config.targets.count(t)) continue;
      const auto [out, in] = target_shape(config_, t);
      // PEFT: kaiming_uniform_(A, a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)); B = 0 (or N(0, 0.02²) for init=random).
      const double bound = 1.0 / std::sqrt(double(in));
      tensors.push_back({lora_tensor_name(i, t, "A"), at::empty({config.rank, in}, f32).uniform_(-bound, bound, gen)});
      tensors.push_back({lora_tensor_name(i, t, "B"), config.init == "random" ? at::normal(0.0, 0.02, {out, config.rank}, gen, f32)
                                                                             : at::zeros({out, config.rank}, f32)});
    }
  load_lora(config, tensors, "new adapters");
}

void Model::load_lora(const LoraConfig& config, const std::vector<NamedTensor>& tensors, const std::string& source) {
  if (!config.enabled()) throw InputError(source + ": LoRA rank must be > 0");
  std::map<std::string, at::Tensor> by_name;
  for (const auto& t : tensors) by_name[t.name] = t.tensor;
  std::vector<NamedTensor> adapters;
  for (std::int64_t i = 0; i < config_.num_hidden_layers; ++i)
    for (const auto& t : lora_target_names()) {
      if (!config.targets.count(t)) continue;
      const auto [out, in] = target_shape(config_, t);
      for (const auto& [which, shape] : {std::pair{"A", std::vector<std::int64_t>{config.rank, in}},
                                         std::pair{"B", std::vector<std::int64_t>{out, config.rank}}}) {
        const auto name = lora_tensor_name(i, t, which);
        auto it = by_name.find(name);
        if (it == by_name.end()) throw InputError(source + ": missing tensor '" + name + "'");
        if (it->second.sizes() != at::IntArrayRef(shape))
          throw InputError(source + ": tensor '" + name + "' has shape " + c10::str(it->second.sizes()) +
                                      ", this base model and rank " + std::to_string(config.rank) + " need " +
                                      c10::str(at::IntArrayRef(shape)));
        adapters.push_back({name, it->second.to(embed_.device(), grad_dtype_).detach().clone().requires_grad_(true)});
        by_name.erase(it);
      }
    }
  if (!by_name.empty())
    throw InputError(source + ": unexpected tensor '" + by_name.begin()->first +
                                "' (not an adapter of this base model and these targets)");
  lora_ = config;
  adapters_ = std::move(adapters);
  // The base is frozen (no gradient buffer ever) and, if it was a set of wider masters, back in the compute dtype.
  for (auto& p : parameters_) p.tensor = p.tensor.detach().to(dtype_);
  register_parameters();
}

void Model::attach_adapters() {
  std::size_t k = 0;
  for (auto& layer : layers_) {
    layer.lora.clear();
    for (const auto& t : lora_target_names())
      if (lora_.targets.count(t)) {
        layer.lora[t] = {adapters_[k].tensor, adapters_[k + 1].tensor};
        k += 2;
      }
  }
}

void Model::set_grad_dtype(c10::ScalarType dtype) {
  const bool narrow = dtype_ == at::kBFloat16 || dtype_ == at::kHalf;
  if (dtype != dtype_ && !(narrow && dtype == at::kFloat))
    throw InputError("--grad-dtype " + dtype_name(dtype) + " with --dtype " + dtype_name(dtype_) +
                                ": gradients can be kept in the model dtype, or in fp32 for a bf16/fp16 model");
  grad_dtype_ = dtype;
  auto& tensors = lora_.enabled() ? adapters_ : parameters_;
  for (auto& p : tensors) p.tensor = p.tensor.detach().to(dtype).requires_grad_(true);
  register_parameters();
}

at::Tensor Model::compute(const at::Tensor& t) const {
  return t.defined() && t.scalar_type() != dtype_ ? t.to(dtype_) : t;
}

at::Tensor Model::project(const LayerWeights& w, const char* target, const at::Tensor& x, const at::Tensor& weight,
                          const at::Tensor& bias) const {
  auto y = sbp::linear(x, compute(weight), compute(bias));
  if (!adapters_enabled_ || w.lora.empty()) return y;
  const auto it = w.lora.find(target);
  if (it == w.lora.end()) return y;
  return y + sbp::linear(sbp::linear(x, compute(it->second.A)), compute(it->second.B)) * lora_.scaling();
}

void Model::embed_backward(const at::Tensor& input_ids, const at::Tensor& grad) const {
  if (!embed_.requires_grad()) return;
  // Rows of dL/dH added straight into the embedding gradient: autograd's embedding backward would first build a
  // dense [V, d] gradient and then add it (311 MB on qwen3-small fp32 when tied, where the gradient already exists).
  at::NoGradGuard no_grad;
  auto& acc = embed_.mutable_grad();
  if (!acc.defined()) acc = at::zeros_like(embed_);
  acc.index_add_(0, input_ids.reshape({-1}), grad.reshape({-1, grad.size(-1)}).to(embed_.scalar_type()));
}

at::Tensor Model::rms_norm(const at::Tensor& x, const at::Tensor& weight) const {
  // HF Qwen3RMSNorm: statistics in (at least) fp32, cast back, then scale.
  const auto xc = x.to(compute_dtype(dtype_));
  const auto normed = xc * at::rsqrt(xc.pow(2).mean(-1, /*keepdim=*/true) + config_.rms_norm_eps);
  return compute(weight) * normed.to(x.scalar_type());
}

at::Tensor Model::rope(const at::Tensor& x, std::int64_t start) const {
  const auto c = x.size(2);
  // Absolute positions: a chunk at `start` is rotated exactly like the same rows of the full sequence.
  spend_first_vector_math_calls();  // again only if the thread count grew since the model was made
  at::Tensor angles;
  if (packed_rows_) {  // each row's own positions, restarting at every sequence (HF's position_ids)
    TORCH_CHECK(x.size(0) == packed_rows_->rows(), "rope: ", x.size(0), " rows for packed rows of ", packed_rows_->rows());
    const auto positions = packed_rows_->positions(start, start + c).to(inv_freq_.options());  // [B, c]
    const auto freqs = positions.unsqueeze(-1) * inv_freq_;  // [B, c, hd/2] fp32: the products outer() makes
    angles = at::cat({freqs, freqs}, -1).unsqueeze(1);      // [B, 1, c, hd]
  } else {
    const auto positions = at::arange(start, start + c, inv_freq_.options());
    const auto freqs = at::outer(positions, inv_freq_);  // [c, hd/2] fp32
    angles = at::cat({freqs, freqs}, -1);                // [c, hd]
  }
  const auto cos = angles.cos().to(x.scalar_type()), sin = angles.sin().to(x.scalar_type());
  return x * cos + rotate_half(x) * sin;
}

// Rows gathered, then cast: the same values as gathering from a cast table, without a [V, d] copy.
at::Tensor Model::embed(const at::Tensor& input_ids) const { return compute(at::embedding(embed_, input_ids)); }

std::pair<at::Tensor, at::Tensor> Model::kv_from_normed(const LayerWeights& w, const at::Tensor& hn,
                                                        std::int64_t start) const {
  const auto B = hn.size(0), c = hn.size(1), n_kv = config_.num_key_value_heads, hd = config_.head_dim;
  auto k = project(w, "k", hn, w.k_w, w.k_b).view({B, c, n_kv, hd});  // [B, c, n_kv, hd]
  if (config_.qk_norm) k = rms_norm(k, w.k_norm);
  k = rope(k.transpose(1, 2), start);                                                       // [B, n_kv, c, hd]
  auto v = project(w, "v", hn, w.v_w, w.v_b).view({B, c, n_kv, hd}).transpose(1, 2);  // [B, n_kv, c, hd]
  return {k, v};
}

at::Tensor Model::q_from_normed(const LayerWeights& w, const at::Tensor& hn, std::int64_t start) const {
  const auto B = hn.size(0), c = hn.size(1), n_h = config_.num_attention_heads, hd = config_.head_dim;
  auto q = project(w, "q", hn, w.q_w, w.q_b).view({B, c, n_h, hd});  // [B, c, n_h, hd]
  if (config_.qk_norm) q = rms_norm(q, w.q_norm);
  return rope(q.transpose(1, 2), start);  // [B, n_h, c, hd]
}

std::pair<at::Tensor, at::Tensor> Model::kv(int layer, const at::Tensor& h, std::int64_t start) const {
  const auto& w = layers_.at(layer);
  return kv_from_normed(w, rms_norm(h, w.input_norm), start);
}

at::Tensor Model::q(int layer, const at::Tensor& h, std::int64_t start) const {
  const auto& w = layers_.at(layer);
  return q_from_normed(w, rms_norm(h, w.input_norm), start);
}

at::Tensor Model::attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::int64_t q_start,
                         const KVGradSums* sums) const {
  const auto B = q.size(0), c = q.size(2), e = k.size(2);
  TORCH_CHECK(e == q_start + c, "attend: keys must be the prefix [0, q_start + c) = [0, ", q_start + c, "), got ", e);
  const auto o = packed_rows_ ? packed_attention(q, k, v, q_start, attention_scale(), sums, *packed_rows_)
                              : prefix_attention(q, k, v, q_start, attention_scale(), sums);  // [B, n_h, c, hd]
  return o.transpose(1, 2).reshape({B, c, q.size(1) * q.size(3)});  // [B, c, n_h*hd]
}

double Model::attention_scale() const { return config_.attention_scale(); }

AttentionRule Model::attention_rule() const { return {attention_scale(), packed_rows_}; }

at::Tensor Model::after_attention(int layer, const at::Tensor& h, const at::Tensor& o) const {
  const auto& w = layers_.at(layer);
  return mlp_block(layer, h + project(w, "o", o, w.o_w, w.o_b));  // [B, c, d]
}

at::Tensor Model::mlp_block(int layer, const at::Tensor& h_mid) const {
  const auto& w = layers_.at(layer);
  const auto hn = rms_norm(h_mid, w.post_norm);
  const auto mlp = project(w, "down", at::silu(project(w, "gate", hn, w.gate_w)) * project(w, "up", hn, w.up_w), w.down_w);
  return h_mid + mlp;
}

at::Tensor Model::attention_block(int layer, const at::Tensor& h) const {
  const auto& w = layers_.at(layer);
  const auto hn = rms_norm(h, w.input_norm);
  const auto B = h.size(0), T = h.size(1);  // T: the rows this process holds
  // Each block of the rows (the source's: one process has one, [0, T)) gives its q and K/V at its global positions;
  // the source attends the queries over every key of the sequence (an all-gather: one exchange for K and V; a ring:
  // block by block).
  std::vector<at::Tensor> qs, ks, vs;
  kv_source_->for_each_chunk(T, T, [&](std::int64_t s, std::int64_t e, std::int64_t position) {
    // One contiguous copy of a block (a view when B = 1 or for the whole): the q, k and v projections (and LoRA's A)
    // would each fold a strided narrow into a copy of their own and keep it, three to six [B, t, d] per layer.
    const auto hb = narrow_or_whole(hn, 1, s, e - s).contiguous();
    auto kv = kv_from_normed(w, hb, position);
    ks.push_back(kv.first), vs.push_back(kv.second), qs.push_back(q_from_normed(w, hb, position));
  });
  const auto q = cat_or_one(qs, 2), k = cat_or_one(ks, 2), v = cat_or_one(vs, 2);  // [B, n_h or n_kv, T, hd]
  const auto o = kv_source_->attend_shard(q, k, v, attention_rule());  // [B, n_h, T, hd]
  return h + project(w, "o", o.transpose(1, 2).reshape({B, T, q.size(1) * q.size(3)}), w.o_w, w.o_b);
}

at::Tensor Model::layer_forward(int layer, const at::Tensor& h) const { return mlp_block(layer, attention_block(layer, h)); }

at::Tensor Model::final_norm(const at::Tensor& h) const { return rms_norm(h, norm_); }

namespace {

// A [rows, cols] view of `block`, which is (re)made in `dtype` when it is missing or too small (the old block goes
// first: never two at once).
at::Tensor reused_block(at::Tensor& block, std::int64_t rows, std::int64_t cols, const at::TensorOptions& options) {
  if (!block.defined() || block.numel() < rows * cols) {
    block.reset();
    block = at::empty({rows * cols}, options);
  }
  return block.narrow(0, 0, rows * cols).view({rows, cols});
}

}  // namespace

at::Tensor Model::logits(const at::Tensor& h_normed, HeadBuffers* buffers) const {
  const auto out_dtype = compute_dtype(dtype_);
  if (buffers == nullptr) return sbp::linear(h_normed, compute(lm_head_)).to(out_dtype);
  auto sizes = h_normed.sizes().vec();
  sizes.back() = lm_head_.size(0);
  const auto rows = h_normed.numel() / h_normed.size(-1), V = lm_head_.size(0);
  const auto h = h_normed.reshape({rows, h_normed.size(-1)});
  auto out = reused_block(buffers->logits, rows, V, h_normed.options().dtype(out_dtype));
  if (dtype_ == out_dtype) {
    at::mm_out(out, h, lm_head_.t());
  } else {  // the model-dtype GEMM, widened like HF's logits.float()
    auto product = reused_block(buffers->product, rows, V, h_normed.options());
    if (!widened(h, GemmLayout::nt))
      at::mm_out(product, h, compute(lm_head_).t());
    else  // the fp32 product rounded straight into the block (core/model/gemm.h)
      product.copy_(at::mm(h.to(at::kFloat), compute(lm_head_).to(at::kFloat).t()));
    out.copy_(product);
  }
  return out.view(sizes);
}

at::Tensor Model::logits_backward(const at::Tensor& grad_logits, const at::Tensor& h_normed, at::Tensor& lm_sum,
                                  HeadBuffers* buffers) const {
  at::NoGradGuard no_grad;
  // Like autograd's backward of .to(compute_dtype): the gradient is rounded to the model dtype before the GEMMs.
  const auto V = grad_logits.size(-1);
  const auto g = buffers && dtype_ != grad_logits.scalar_type()
                     ? reused_block(buffers->product, grad_logits.numel() / V, V, h_normed.options())
                           .copy_(grad_logits.reshape({-1, V}))
                     : grad_logits.to(dtype_).reshape({-1, V});  // [B*c, V]
  if (lm_head_.requires_grad()) {
    const auto hn = h_normed.detach().reshape({-1, h_normed.size(-1)});  // [B*c, d]
    const auto sum_dtype = ChunkGradients::accumulation_dtype(dtype_);
    if (sum_dtype == dtype_) {
      if (!lm_sum.defined())
        lm_sum = at::mm(g.t(), hn);
      else
        lm_sum.addmm_(g.t(), hn);  // accumulated inside the GEMM: no [V, d] temporary
    } else {
      // bf16: each chunk's GEMM rounds once and is added into the fp32 sum, kLmHeadRows vocabulary rows at a time:
      // the mixed-dtype add makes an fp32 copy of its operand, and a whole [V, d] product plus that copy was the
      // head's peak (+25% over the model on tiny; 2.3 GB at Qwen3-4B's V x d).
      if (!lm_sum.defined()) lm_sum = at::zeros(lm_head_.sizes(), lm_head_.options().dtype(sum_dtype));
      const auto V = lm_head_.size(0);
      for (std::int64_t r = 0; r < V; r += kLmHeadRows) {
        const auto n = std::min(kLmHeadRows, V - r);
        lm_sum.narrow(0, r, n).add_(gemm(g.narrow(1, r, n).t(), hn, GemmLayout::tn));  // [n, d]
      }
    }
  }
  return gemm(g, compute(lm_head_.detach()), GemmLayout::nn).view(h_normed.sizes());  // [B, c, d]
}

void Model::commit_lm_head_gradient(at::Tensor& lm_sum) const {
  if (!lm_sum.defined()) return;
  ChunkGradients sums({lm_head_});
  sums.add({lm_sum});
  lm_sum.reset();
  sums.commit();
}

std::vector<at::Tensor> Model::head_trainable() const {
  std::vector<at::Tensor> out;
  if (norm_.requires_grad()) out.push_back(norm_);
  if (!config_.tie_word_embeddings && lm_head_.requires_grad()) out.push_back(lm_head_);
  return out;
}

std::vector<at::Tensor> Model::embedding_trainable() const {
  if (!embed_.requires_grad()) return {};
  return {embed_};
}

std::vector<at::Tensor> Model::layer_trainable(int layer) const {
  const auto& w = layers_.at(layer);
  std::vector<at::Tensor> out;
  if (lora_.enabled()) {
    for (const auto& t : lora_target_names())
      if (auto it = w.lora.find(t); it != w.lora.end()) out.insert(out.end(), {it->second.A, it->second.B});
    return out;
  }
  for (const auto* t : {&w.input_norm, &w.q_w, &w.q_b, &w.k_w, &w.k_b, &w.v_w, &w.v_b, &w.o_w, &w.o_b, &w.q_norm,
                        &w.k_norm, &w.post_norm, &w.gate_w, &w.up_w, &w.down_w})
    if (t->defined()) out.push_back(*t);
  return out;
}

}  // namespace sbp

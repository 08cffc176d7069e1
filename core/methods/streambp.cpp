#include "core/methods/streambp.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <fmt/format.h>

#include "core/model/chunk_attention.h"
#include "core/methods/memory_model.h"
#include "core/methods/method_entry.h"
#include "core/model/kv_source.h"
#include "core/model/model.h"
#include "core/methods/streaming.h"

namespace sbp {
namespace {

at::Tensor leaf(const at::Tensor& t) { return t.detach().requires_grad_(true); }

}  // namespace

std::string StreamBP::spec() const {
  return "streambp:layer_chunk=" + std::to_string(options_.layer_chunk) +
         ",head_chunk=" + std::to_string(options_.head_chunk);
}

at::Tensor StreamBP::attend(const Model& model, const at::Tensor& q, const at::Tensor& K, const at::Tensor& V,
                            std::int64_t q_start, const KVGradSums& sums) const {
  const auto e = q_start + q.size(2);
  return model.attend(q, K.slice(2, 0, e), V.slice(2, 0, e), q_start, &sums);
}

HeadResult StreamBP::head_and_loss(const Model& model, const PreparedObjective& objective, const at::Tensor& h_last,
                                   PhaseClock& clock) const {
  return streamed_head(model, objective, h_last, options_.head_chunk, clock);
}

c10::ScalarType StreamBP::accumulation_dtype(c10::ScalarType dtype) const {
  return ChunkGradients::accumulation_dtype(dtype);
}

double StreamBP::backprop(Model& model, const PreparedObjective& objective, const Batch& batch, PhaseClock& clock) {
  const int L = int(model.config().num_hidden_layers);

  // Forward without a graph, itself chunked: keeps the input of every layer (H[l]: [B, T, d]) and the last hidden
  // state H[L]; per chunk only the Q path, attention and MLP of c tokens exist. With an offload tier H[l] leaves the
  // device once layer l has read it (layer_checkpoints.h).
  auto H = checkpointed_forward(model, batch, clock, [&](int l, const at::Tensor& h) {
    return layer_forward_chunked(model, l, h, options_.layer_chunk);
  });
  // LM head + loss per head chunk: logits of c_h positions at a time. G: dLoss/dH[L].
  auto [loss, G] = head_and_loss(model, objective, H.take(L), clock);
  head_ready(model);

  for (int l = L - 1; l >= 0; --l) {
    {
      const LayerInUse use(*this, model, l);  // gathered once for the whole chunk loop (ZeRO-3)
      // The checkpoint dies with its layer: the only reference is this one.
      stream_layer_backward(model, l, H.take(l), G, clock);  // G: dLoss/dH[l+1] in, dLoss/dH[l] out
    }
    layer_ready(model, l);  // its chunk loop has committed the layer's sums
  }
  {
    Phase phase(clock, "embedding");
    model.embed_backward(rank_tokens(model, batch), G);  // tied: adds into the lm_head gradient (one tensor)
  }
  embedding_ready(model);
  return loss;
}

namespace {

// Step 2 of a layer's backward as the model's K/V source runs it (kv_source.h): with the whole sequence's K/V at hand,
// each chunk's backward at once (StreamBP::layer_chunk_backward); with keys block by block, each chunk from its
// output to its attention output, then (every block through) from its queries. Each writes the chunk's input
// gradient into g and sums the layer's weight gradients.
class LayerChunksBackward final : public StreamedBackward {
 public:
  LayerChunksBackward(const StreamBP& method, const Model& model, int layer, const at::Tensor& h_in, at::Tensor& g,
                      ChunkGradients& weights)
      : method_(method), model_(model), layer_(layer), h_in_(h_in), g_(g), weights_(weights) {}

  void chunk(const ChunkRows& r, const at::Tensor& K, const at::Tensor& V, const KVGradSums& sums) override {
    const auto grads = method_.layer_chunk_backward(model_, layer_, h_in_, r.s, r.e, r.position, K, V, sums,
                                                    g_.slice(1, r.s, r.e), weights_.params());
    g_.slice(1, r.s, r.e).copy_(grads[0]);  // dLoss/dH_out of these rows is spent: their dLoss/dH_in replaces it
    weights_.add(at::ArrayRef<at::Tensor>(grads).slice(1));
  }

  at::Tensor q(const ChunkRows& r) override {
    at::NoGradGuard no_grad;
    return model_.q(layer_, h_in_.slice(1, r.s, r.e), r.position);
  }

  at::Tensor output_backward(const ChunkRows& r, const at::Tensor& o) override {  // o: [B, n_h, c, hd]
    auto h = leaf(h_in_.slice(1, r.s, r.e));  // [B, c, d]
    auto o_leaf = leaf(o);
    const auto out = model_.after_attention(layer_, h, attention_rows(o_leaf));
    std::vector<at::Tensor> inputs = {h, o_leaf};
    inputs.insert(inputs.end(), weights_.params().begin(), weights_.params().end());
    const auto grads = torch::autograd::grad({out}, inputs, {g_.slice(1, r.s, r.e)}, /*retain_graph=*/false,
                                             /*create_graph=*/false, /*allow_unused=*/true);
    g_.slice(1, r.s, r.e).copy_(grads[0]);  // the residual's and MLP's part; the queries' is added by q_backward
    weights_.add(at::ArrayRef<at::Tensor>(grads).slice(2));
    return grads[1];
  }

  void q_backward(const ChunkRows& r, const at::Tensor& dq) override {
    auto h = leaf(h_in_.slice(1, r.s, r.e));
    const auto q = model_.q(layer_, h, r.position);
    std::vector<at::Tensor> inputs = {h};
    inputs.insert(inputs.end(), weights_.params().begin(), weights_.params().end());
    const auto grads = torch::autograd::grad({q}, inputs, {dq}, /*retain_graph=*/false, /*create_graph=*/false,
                                             /*allow_unused=*/true);
    g_.slice(1, r.s, r.e).add_(grads[0]);
    weights_.add(at::ArrayRef<at::Tensor>(grads).slice(1));
  }

 private:
  const StreamBP& method_;
  const Model& model_;
  int layer_;
  const at::Tensor& h_in_;
  at::Tensor& g_;
  ChunkGradients& weights_;
};

}  // namespace

void StreamBP::stream_layer_backward(const Model& model, int layer, const at::Tensor& h_in, at::Tensor& g,
                                     PhaseClock& clock) const {
  const auto c = options_.layer_chunk;
  // Step 1: K/V of the rows held here, once (not per chunk: that would cost O(T²/c) projections), without a graph.
  at::Tensor KV;  // [2, B, n_kv, t, hd]
  {
    Phase phase(clock, "kv_recompute");
    KV = kv_chunked(model, layer, h_in, c);
  }
  // The layer's weight (or adapter) gradients, summed over the chunks of steps 2 and 3 and written once.
  ChunkGradients weights(model.layer_trainable(layer),
                         [this](c10::ScalarType dtype) { return accumulation_dtype(dtype); });

  // Step 2: per chunk, Q path + attention over every key before it + o-proj/MLP with grad: the gradients of the
  // chunk's input, of the keys it saw and of the layer's weights; a chunk's graph dies with its piece. The source
  // serves the keys (the whole sequence's, or block by block) and sums dK/dV over the group and every chunk, fp32
  // for a bf16 model (see ChunkGradients).
  at::Tensor dKV;  // [2, B, n_kv, t, hd]: at the rows held here
  {
    Phase phase(clock, "layer");
    LayerChunksBackward pieces(*this, model, layer, h_in, g, weights);
    const auto sum_dtype = accumulation_dtype(KV.scalar_type());
    dKV = model.kv_source().stream_backward(std::exchange(KV, at::Tensor()), c, model.attention_rule(), sum_dtype,
                                            pieces);
  }

  // Step 3: dK/dV through the K/V path.
  kv_path_backward(model, layer, h_in, dKV[0], dKV[1], g, weights, clock);
  weights.commit();
}

void StreamBP::kv_path_backward(const Model& model, int layer, const at::Tensor& h_in, const at::Tensor& dK,
                                const at::Tensor& dV, at::Tensor& g, ChunkGradients& weights, PhaseClock& clock) const {
  // The K/V path is position-wise, so it streams too: recompute k, v of a chunk with grad and push dK/dV of that
  // chunk through it (W_k, W_v, k-norm, input norm, and the layer input). Each dK/dV entry is read once, so rounding
  // it to the model dtype here is its only rounding.
  Phase phase(clock, "kv_path");
  const auto& params = weights.params();
  for_each_rank_chunk(model, h_in.size(1), options_.layer_chunk, [&](std::int64_t s, std::int64_t e, std::int64_t position) {
    const auto grads = kv_chunk_backward(model, layer, h_in, s, e, position, dK, dV, params);
    g.slice(1, s, e).add_(grads[0]);
    weights.add(at::ArrayRef<at::Tensor>(grads).slice(1));
  });
}

std::vector<at::Tensor> StreamBP::layer_chunk_backward(const Model& model, int layer, const at::Tensor& h_in,
                                                       std::int64_t s, std::int64_t e, std::int64_t position,
                                                       const at::Tensor& K,
                                                       const at::Tensor& V, const KVGradSums& sums,
                                                       const at::Tensor& grad_out,
                                                       const std::vector<at::Tensor>& params) const {
  auto h = leaf(h_in.slice(1, s, e));  // [B, c, d]
  const auto out = model.after_attention(layer, h, attend(model, model.q(layer, h, position), K, V, position, sums));
  std::vector<at::Tensor> inputs = {h};
  inputs.insert(inputs.end(), params.begin(), params.end());
  // The prefix's dK/dV go into `sums` (attend's backward), not into these gradients.
  return torch::autograd::grad({out}, inputs, {grad_out}, /*retain_graph=*/false, /*create_graph=*/false,
                               /*allow_unused=*/true);
}

std::vector<at::Tensor> StreamBP::kv_chunk_backward(const Model& model, int layer, const at::Tensor& h_in,
                                                    std::int64_t s, std::int64_t e, std::int64_t position,
                                                    const at::Tensor& dK,
                                                    const at::Tensor& dV, const std::vector<at::Tensor>& params) const {
  auto h = leaf(h_in.slice(1, s, e));
  const auto [k, v] = model.kv(layer, h, position);
  std::vector<at::Tensor> inputs = {h};
  inputs.insert(inputs.end(), params.begin(), params.end());
  return torch::autograd::grad({k, v}, inputs,
                               {dK.slice(2, s, e).to(k.scalar_type()), dV.slice(2, s, e).to(v.scalar_type())},
                               /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);
}

std::string streambp_chunk_advice(const BackpropMethod& method, std::int64_t seq_len) {
  const auto* streambp = dynamic_cast<const StreamBP*>(&method);
  if (!streambp) return "";
  const auto& o = streambp->options();
  if (o.layer_chunk < seq_len && o.head_chunk < seq_len) return "";
  const auto suggest = std::max<std::int64_t>(1, seq_len / 8);
  return fmt::format("{} at T = {}: a chunk of T or more is the whole sequence, so that part does not stream; chunks "
                     "of about T/8 (e.g. streambp:layer_chunk={},head_chunk={}) keep the peak low",
                     method.spec(), seq_len, suggest, suggest);
}

MethodEntry streambp_entry() {
  const StreamBP::Options defaults;
  MethodEntry e;
  e.name = "streambp";
  e.summary = "StreamBP: each layer's backward streamed in chunks of the sequence, the LM head and loss in head chunks";
  e.options = {{"layer_chunk", defaults.layer_chunk, 1, "tokens per chunk inside a decoder layer"},
               {"head_chunk", defaults.head_chunk, 1, "tokens per chunk of the LM head and the loss"}};
  e.make = [](const MethodArgs& a) {
    return std::make_unique<StreamBP>(StreamBP::Options{a.get("layer_chunk"), a.get("head_chunk")});
  };
  const auto spec = [](std::int64_t layer, std::int64_t head) {
    return fmt::format("streambp:layer_chunk={},head_chunk={}", std::max<std::int64_t>(1, layer),
                       std::max<std::int64_t>(1, head));
  };
  // One chunk each; many layer chunks with few head chunks and the reverse; small chunks; one token per layer chunk.
  e.tests.edges = [spec](std::int64_t T) {
    return std::vector<std::string>{spec(T, T), spec(T / 8, T / 32), spec(T / 32, T / 8), spec(4, 4), spec(1, T / 16)};
  };
  // Four layer chunks and three head chunks, each last one short.
  e.tests.typical = [spec](std::int64_t T) { return spec(T / 4 + 1, T / 3 + 1); };
  // 8 to 32 chunks of 64 tokens, and the defaults (one to four chunks).
  e.tests.metered = {spec(64, 64), "streambp"};
  return e;
}

}  // namespace sbp

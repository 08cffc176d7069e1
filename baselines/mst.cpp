#include "baselines/mst.h"

#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include "core/methods/memory_model.h"
#include "core/methods/method_entry.h"
#include "core/model/model.h"
#include "core/methods/streaming.h"

namespace sbp {

double MsT::backprop(Model& model, const PreparedObjective& objective, const Batch& batch, PhaseClock& clock) {
  const int L = int(model.config().num_hidden_layers);
  const auto T = batch.seq_len();
  const auto chunk = mini_sequence_length(T, options_.mini_seq);

  // Checkpoints: H[l] the input of layer l, H[L] the last hidden state; in the offload tier once read, with one.
  // Each layer's MLP runs in mini-sequences of its attention block's output.
  auto H = checkpointed_forward(model, batch, clock, [&](int l, const at::Tensor& h) {
    const auto h_mid = model.attention_block(l, h);  // [B, T, d]
    auto h_out = at::empty_like(h_mid);
    for_each_chunk(T, chunk, [&](std::int64_t s, std::int64_t e) {
      h_out.slice(1, s, e).copy_(model.mlp_block(l, h_mid.slice(1, s, e)));
    });
    return h_out;
  });

  auto [loss, G] = head_and_loss(model, objective, H.take(L), chunk, clock);
  head_ready(model);

  for (int l = L - 1; l >= 0; --l) {
    {
      const LayerInUse use(*this, model, l);
      G = layer_backward(model, l, H.take(l), G, chunk, clock);
    }
    layer_ready(model, l);
  }
  {
    Phase phase(clock, "embedding");
    model.embed_backward(batch.input_ids, G);  // tied: adds into the lm_head gradient (one tensor)
  }
  embedding_ready(model);
  return loss;
}

HeadResult MsT::head_and_loss(const Model& model, const PreparedObjective& objective, const at::Tensor& h_last, std::int64_t chunk,
                              PhaseClock& clock) const {
  return streamed_head(model, objective, h_last, chunk, clock);
}

at::Tensor MsT::layer_backward(const Model& model, int layer, const at::Tensor& h_in, const at::Tensor& g_out,
                               std::int64_t chunk, PhaseClock& clock) const {
  Phase phase(clock, "layer");
  auto h = h_in.detach().requires_grad_(true);     // [B, T, d]
  const auto h_mid = model.attention_block(layer, h);  // with a graph: attention on the full sequence
  auto g_mid = at::empty_like(h_mid);                  // dLoss/dh_mid
  // MLP mini-sequences: each recomputed from its input alone and back-propagated at once, so only one
  // mini-sequence's intermediates ever exist. Their weight gradients are summed like StreamBP's chunks (fp32 for a
  // bf16 model, rounded once): accumulated in bf16 through autograd, MsT's error reached 1.76x the 1.5x-standard
  // allowance at 512 mini-sequences.
  ChunkGradients weights(model.layer_trainable(layer));
  for_each_chunk(h_in.size(1), chunk, [&](std::int64_t s, std::int64_t e) {
    auto x = h_mid.slice(1, s, e).detach().requires_grad_(true);  // [B, c, d]
    std::vector<at::Tensor> inputs = {x};
    inputs.insert(inputs.end(), weights.params().begin(), weights.params().end());
    const auto grads = torch::autograd::grad({model.mlp_block(layer, x)}, inputs, {g_out.slice(1, s, e)},
                                             /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);
    g_mid.slice(1, s, e).copy_(grads[0]);
    weights.add(at::ArrayRef<at::Tensor>(grads).slice(1));
  });
  weights.commit();
  h_mid.backward(g_mid);
  return h.grad();
}


MethodEntry mst_entry() {
  MethodEntry e;
  e.name = "mst";
  e.summary = "MsT: checkpointing with the MLP and the LM head and loss in mini-sequences";
  e.options = {{"mini_seq", MsT::Options{}.mini_seq, 1, "mini-sequences per sequence"}};
  e.make = [](const MethodArgs& a) { return std::make_unique<MsT>(MsT::Options{a.get("mini_seq")}); };
  const auto spec = [](std::int64_t m) { return "mst:mini_seq=" + std::to_string(std::max<std::int64_t>(1, m)); };
  // One mini-sequence; a few; many; one position each.
  e.tests.edges = [spec](std::int64_t T) { return std::vector<std::string>{spec(1), spec(8), spec(T / 8), spec(T)}; };
  // Three mini-sequences, the last one short where 3 does not divide T.
  e.tests.typical = [spec](std::int64_t) { return spec(3); };
  e.tests.metered = {spec(8)};
  return e;
}

}  // namespace sbp

#include "baselines/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "core/methods/memory_model.h"
#include "core/methods/method_entry.h"
#include "core/model/model.h"

namespace sbp {

double CheckpointBackprop::backprop(Model& model, const PreparedObjective& objective, const Batch& batch, PhaseClock& clock) {
  const int L = int(model.config().num_hidden_layers);
  // inputs: [B, T, d] the input of layer l, and the last hidden state; in the offload tier once read, with one.
  auto inputs = checkpointed_forward(model, batch, clock,
                                     [&](int l, const at::Tensor& h) { return model.layer_forward(l, h); });
  at::Tensor grad;  // dLoss/d(output of the current layer): [B, T, d]
  double loss = 0;
  {
    Phase phase(clock, "head");
    auto h = inputs.take(L).detach().requires_grad_(true);
    auto term = rank_loss(model, objective, model.logits(model.final_norm(h)));
    term.backward();
    loss = term.item<double>();
    grad = h.grad();
  }
  head_ready(model);
  for (int l = L - 1; l >= 0; --l) {
    {
      Phase phase(clock, "layer");
      const LayerInUse use(*this, model, l);
      auto h = inputs.take(l).detach().requires_grad_(true);  // the checkpoint is consumed by its own re-forward
      model.layer_forward(l, h).backward(grad);
      grad = h.grad();
    }
    layer_ready(model, l);
  }
  {
    Phase phase(clock, "embedding");
    model.embed_backward(rank_tokens(model, batch), grad);
  }
  embedding_ready(model);
  return loss;
}


MethodEntry checkpoint_entry() {
  MethodEntry e;
  e.name = "checkpoint";
  e.summary = "gradient checkpointing: each layer's input kept, the layer re-run on the full sequence in the backward";
  e.make = [](const MethodArgs&) { return std::make_unique<CheckpointBackprop>(); };
  e.tests.edges = [](std::int64_t) { return std::vector<std::string>{"checkpoint"}; };
  e.tests.typical = [](std::int64_t) { return std::string("checkpoint"); };
  return e;
}

}  // namespace sbp

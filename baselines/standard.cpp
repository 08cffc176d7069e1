#include "baselines/standard.h"

#include <ATen/ATen.h>

#include "core/methods/memory_model.h"
#include "core/methods/method_entry.h"
#include "core/model/model.h"

namespace sbp {

double StandardBackprop::backprop(Model& model, const PreparedObjective& objective, const Batch& batch, PhaseClock& clock) {
  const int L = int(model.config().num_hidden_layers);
  at::Tensor loss;
  // Parameter use (ZeRO-3), as DeepSpeed does it for one graph: a layer is in use for its forward, and again from
  // the moment its output's gradient arrives (a hook: its backward starts) to the end of backward(). The graph saved
  // the parameters themselves, so the gathered data is back before any of the layer's backward nodes runs.
  std::vector<bool> in_backward(L, false);
  {
    Phase phase(clock, "forward");
    auto h = model.embed(rank_tokens(model, batch));  // [B, T, d] (a sequence-parallel rank's: [B, t, d])
    for (int l = 0; l < L; ++l) {
      {
        const LayerInUse use(*this, model, l);
        h = model.layer_forward(l, h);
      }
      if (tracks_parameter_use())
        h.register_hook([this, &model, &in_backward, l](const at::Tensor&) {
          layer_use(model, l, true);
          in_backward[l] = true;
        });
    }
    loss = rank_loss(model, objective, model.logits(model.final_norm(h)));
  }
  const auto end_uses = [&] {
    for (int l = 0; l < L; ++l)
      if (in_backward[l]) layer_use(model, l, false), in_backward[l] = false;
  };
  try {
    Phase phase(clock, "backward");
    loss.backward();
  } catch (...) {
    end_uses();
    throw;
  }
  end_uses();
  // One graph: every gradient is final only when backward() returns (autograd's post-accumulate hooks would fire
  // earlier per tensor; the groups fire here, in the streamed methods' order).
  head_ready(model);
  for (int l = L - 1; l >= 0; --l) layer_ready(model, l);
  embedding_ready(model);
  return loss.item<double>();
}


MethodEntry standard_entry() {
  MethodEntry e;
  e.name = "standard";
  e.summary = "standard BP: one graph over the whole model and full-sequence logits (the reference)";
  e.make = [](const MethodArgs&) { return std::make_unique<StandardBackprop>(); };
  e.tests.edges = [](std::int64_t) { return std::vector<std::string>{}; };  // the reference itself
  e.tests.typical = [](std::int64_t) { return std::string("standard"); };
  return e;
}

}  // namespace sbp

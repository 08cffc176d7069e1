#include "baselines/checkpoint.h"

#include <algorithm>
#include <string>

#include "core/methods/memory_terms.h"

namespace sbp {

using namespace memory;

MemoryEstimate CheckpointBackprop::memory_model(const Workload& w) const {
  const Sizes z(w);
  // Sequence parallelism: the exchange's K/V and what changes with them. (The re-forward's all-gather is no peak: the
  // layer's backward holds the gathered K/V with more beside them.)
  const auto shard = shard_attention_bytes(w);
  const auto btd = z.B * z.T * z.d * z.s;
  const auto& c = w.config;
  // The final norm's saved statistic ([B, T, 1], compute dtype) is alive with its other saved tensors.
  // Under sequence parallelism the loss's forward can be the head's peak: the normed hidden states are alive there as a
  // temporary, which under LoRA nothing else keeps (the lm_head is frozen).
  const auto final_norm =
      z.B * z.T * (final_norm_bytes(z.d, z, true) + z.f + (z.sp > 1 && z.lora ? z.d * z.s : 0));
  MemoryEstimate head{"head backward",
                      {{"weights", z.weights},
                       {"lm_head copy (compute dtype)", z.lm_head_copy()},
                       {"checkpoints", z.checkpoints(z.L + 1)},
                       {"final norm", final_norm},
                       {"logits + loss", shard_loss_peak_bytes(w)},
                       {"objective buffers", objective_bytes(w)}}};
  // Re-forward of a layer on the full sequence, then its backward. Measured with run --timeline (tiny and tiny-mha
  // fp32, B = 1, T = 64 and 1024; `run --preset tiny-mha --method checkpoint --seq 1024 --threads 2 --timeline P`,
  // blocks named by size and order): the two local peaks are
  //  - MLP: silu(gate)·up's backward, which makes d(silu) and d(up) while d(product) is alive: gate, up, silu and
  //    those three [B, T, I] gradients; the product itself was freed by down_proj's backward. Under LoRA the same
  //    count one step earlier: down's two partial input gradients (base and adapter path) and their sum, the product
  //    and down's A·x freed (tiny-mha LoRA fp32 T = 2048: layer peak 14.76 MB measured, 14.71 MB this moment).
  //    Of this layer's gradients only down_proj's exists.
  //  - attention: SDPA's backward (attention_backward_terms, the input/q/k norms' statistics, the RoPE tables, and
  //    h_mid's gradient); the MLP's and o_proj's gradients exist, q/k/v's and the input norm's not yet.
  // Both hold the RoPE tables of the re-forward (rope_table_bytes: four [T, hd] blocks) and the layer's output (the
  // value of layer_forward, alive until its backward returns) next to dL/dH in: "dL/dH in + out".
  // Gradients of this layer written by each moment: full fine-tuning down_proj's [d, I] (MLP), then also gate/up's and
  // the post norm's, and o_proj's (attention). Under LoRA the adapters': every MLP adapter has r·(d+I) elements (down's
  // is the first written) and o's r·(n_h·hd + d) when o is adapted.
  const auto r = w.lora_rank;
  const auto down_gradient = (z.lora ? (w.adapts("down") ? r * (z.d + c.intermediate_size) : 0)
                                     : z.d * c.intermediate_size) * z.g;
  const auto mlp_o_gradients =
      (z.lora ? w.lora_mlp_targets * r * (z.d + c.intermediate_size) +
                    (w.adapts("o") ? r * (c.q_width() + z.d) : 0)
              : 3 * z.d * c.intermediate_size + z.d + z.d * c.q_width() + (c.o_proj_bias ? z.d : 0)) * z.g;
  const auto mlp_activations = z.B * z.T * (full_sequence_layer_bytes_per_token(w, true) - c.intermediate_size * z.s -
                                            (w.adapts("down") ? r * z.s : 0)) + shard.activations;
  const auto attention_statistics =
      z.B * z.T * (norm_statistics_bytes_per_token(w) - z.f);  // all but the post norm's (freed with the MLP's graph)
  std::vector<MemoryEstimate> moments = {head};
  for (const auto& state : layer_states(z)) {
    const auto layer = "layer " + std::to_string(state.layer) + " backward";
    const auto earlier = state.gradients - z.layer_grad;  // the head's and the layers' after this one
    const std::vector<MemoryTerm> common = {{"weights", z.weights},
                                            {"the layer's gathered parameters (ZeRO-3)", z.gathered_layer()},
                                            {"weight copies (compute dtype)", z.layer_copies()},
                                            {"checkpoints", state.checkpoints},
                                            {"dL/dH in + out", 2 * btd},
                                            {"RoPE tables", rope_table_bytes(w, z.T)},
                                            {"objective buffers", objective_bytes(w)},
                                            {"the whole sequence's K, V (gathered)", shard.whole_kv, true}};
    MemoryEstimate mlp{layer + " (MLP)", common};
    mlp.terms.insert(mlp.terms.end(),
                     {{"gradients (this layer's: down_proj's)", earlier + down_gradient},
                      {"layer activations but the MLP product", mlp_activations},
                      {"MLP gradients: d(product), d(silu), d(up)", 3 * z.B * z.T * c.intermediate_size * z.s}});
    MemoryEstimate attention{layer + " (attention)", common};
    attention.terms.push_back({"gradients (this layer's: the MLP's, o_proj's)", earlier + mlp_o_gradients});
    attention.terms.push_back(
        {"attention activations", z.B * z.T * attention_activation_bytes_per_token(w, true) + shard.activations});
    for (const auto& t : shard_attention_backward_terms(w)) attention.terms.push_back(t);
    attention.terms.push_back({"input and q/k norm statistics", attention_statistics});
    attention.terms.push_back({"h_mid's gradient", btd});
    moments.push_back(mlp);
    moments.push_back(attention);
    // Sequence parallelism: the K/V exchange's moments after the attention backward (the all-gather's whole-sequence
    // dK/dV and their reduce-scatter), the layer's attention graph released.
    auto held = common;
    held.insert(held.end(), {{"gradients (this layer's: the MLP's, o_proj's)", earlier + mlp_o_gradients},
                             {"input and q/k norm statistics", attention_statistics},
                             {"h_mid's gradient", btd}});
    for (auto& m : kv_exchange_backward_moments(w, layer, held)) moments.push_back(std::move(m));
    // Full fine-tuning, short sequences: down_proj's weight gradient GEMM (grad^T · product over B·T rows), while
    // the product (its input) and d(product) are alive, with the GEMM's workspace; in mixed precision its output is
    // then widened into the fp32 gradient (after the workspace is gone). Measured on an AVX512_CORE CPU, bf16:
    // tiny-mha B = 1, T = 64 (`run --preset tiny-mha --method checkpoint --seq 64 --dtype bf16 --timeline P`): the
    // layer's peak, a 32.1 KiB workspace (an fp32 copy of the output) next to the 16 KiB bf16 gradient; the MLP moment
    // above was 2.6% under the meter without this one.
    if (!z.lora) {
      const auto down_elements = z.d * c.intermediate_size;
      const auto workspace = gemm_workspace_bytes(w, z.d, c.intermediate_size, z.B * z.T, /*a_transposed=*/true);
      MemoryEstimate down{layer + " (down_proj weight gradient)", common};
      down.terms.insert(down.terms.end(),
                        {{"gradients (this layer's: none yet)", earlier},
                         {"down_proj's gradient (model dtype) + the GEMM's workspace or the fp32 cast",
                          down_elements * z.s + std::max(workspace, z.cast ? down_elements * z.g : 0)},
                         {"layer activations",
                          z.B * z.T * full_sequence_layer_bytes_per_token(w, true) + shard.activations},
                         {"d(product)", z.B * z.T * c.intermediate_size * z.s}});
      moments.push_back(down);
    }
  }
  // Short sequences: the lm_head's backward GEMMs (head_gemm_terms), with their workspaces (on an AVX512_CORE CPU
  // in bf16 an fp32 copy of the output: qwen3-small bf16, T = 64: 661 MiB measured, 395 MiB modelled without it);
  // then the end of the step, when every gradient exists.
  {
    MemoryEstimate gemms{"lm_head backward GEMMs",
                         {{"weights", z.weights},
                          {"lm_head copy (compute dtype)", z.lm_head_copy()},
                          {"checkpoints", z.checkpoints(z.L + 1)},
                          {"final norm", final_norm},
                          {"objective buffers", objective_bytes(w)}}};
    for (const auto& t : head_gemm_terms(w)) gemms.terms.push_back(t);
    moments.push_back(gemms);
  }
  return checkpointing_peak(std::move(moments), w);
}

}  // namespace sbp

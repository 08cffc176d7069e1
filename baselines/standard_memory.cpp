#include "baselines/standard.h"

#include <algorithm>
#include <string>

#include "core/methods/memory_terms.h"

namespace sbp {

using namespace memory;

MemoryEstimate StandardBackprop::memory_model(const Workload& w) const {
  const Sizes z(w);
  const auto btd = z.B * z.T * z.d * z.s;
  const auto shard = shard_attention_bytes(w);  // sequence parallelism: the exchange's K/V and what changes with them
  // Peak: log-softmax backward, with every layer's activations still alive and no gradient written yet.
  // Under LoRA the frozen embedding's output needs no gradient: layer 0 keeps less (full_sequence_layer_bytes_per_token).
  // RoPE's cos/sin tables: each layer's rotation makes its own pair for q and one for k ([T, hd] each, per position,
  // not per row of the batch), which the multiplications keep (measured: tiny fp32 B = 1, T = 1024: eight 64 KiB
  // blocks; B = 4, T = 256 LoRA: eight 16 KiB ones). The final norm's statistic, [B, T, 1] in the compute dtype.
  // (run --preset tiny --method standard --seq 1024 --timeline P; --batch 4 --seq 256 --lora rank=8.)
  const auto layers = z.L * full_sequence_layer_bytes_per_token(w, false) -
                      (z.lora && z.sp == 1 ? full_sequence_layer_bytes_per_token(w, false) -
                                    full_sequence_layer_bytes_per_token(w, false, /*input_saved=*/false)
                              : 0);
  // ZeRO-3 or parameter offload: each layer's parameters are on the device only while in use, but at::linear's graph
  // saves them (views of the gathered or fetched storage) in the forward, so every layer's stays until its backward
  // (not the widened narrow-dtype linear's: Workload::graph_keeps_weight_views).
  const auto kept_layers = w.graph_keeps_weight_views ? z.L * z.gathered_layer() : 0;
  MemoryEstimate head{"head backward",
                      {{"weights", z.weights},
                       {"the layers' parameters the graph keeps (ZeRO-3 gathered, or fetched)", kept_layers},
                       {"weight copies (compute dtype)", z.all_copies()},
                       {"layer activations", z.B * z.T * layers + z.L * shard.activations},
                       {"every layer's whole-sequence K, V (gathered; the ring: none)", z.L * shard.whole_kv, true},
                       {"RoPE tables", z.L * rope_table_bytes(w, z.T)},
                       {"final norm", z.B * z.T * (final_norm_bytes(z.d, z, false) + z.f)},
                       // Sequence parallelism: the peak is the loss's forward, the method still holding the last
                       // layer's output (in fp32 it is the final norm's saved input, counted there).
                       {"the last layer's output", z.sp > 1 && z.f != z.s ? btd : 0},
                       {"logits + loss", shard_loss_peak_bytes(w)},
                       {"objective buffers", objective_bytes(w)}}};
  std::vector<MemoryEstimate> moments = feature_moments(w, /*streamed=*/false);
  moments.push_back(head);
  // Sequence parallelism: a layer's backward (the exchange's: the all-gather's K/V gradients of the whole sequence,
  // select's zero-padded copies, the reduce-scatter; the ring's blocks and sums, as checkpointing's model has them) is
  // not a moment here: it holds less than the head's moment (every layer's graph is alive at both; the head adds 2.5
  // [B, t, V] of logits where a layer adds 1.5x its gathered K/V, 3 N t kv_width bytes: V = 151936 against
  // N kv_width = 32 x 1024 at Qwen3-8B's size; the ring's a few [t, kv_width] and [t, q_width] blocks).
  // Then the lm_head's GEMMs, the loss's tensors gone (the peak at short T and a large vocabulary).
  {
    auto gemms = head;
    gemms.moment = "lm_head backward GEMMs";
    gemms.terms.erase(std::remove_if(gemms.terms.begin(), gemms.terms.end(),
                                     [](const MemoryTerm& t) { return t.name == "logits + loss"; }),
                      gemms.terms.end());
    for (const auto& t : head_gemm_terms(w)) gemms.terms.push_back(t);
    moments.push_back(gemms);
  }
  if (z.lora) {  // the frozen embedding has no backward
    auto peak = largest(moments);
    peak.host = offload_host_terms(w);
    return peak;
  }
  // Or the end of the backward (short sequences): every gradient exists, and autograd's embedding backward makes a
  // dense [V, d] gradient. Tied, it is added into the lm_head's; measured, that moment holds two [V, d] blocks beyond
  // the gradients (tiny at T = 2: model 963.5 KiB against 1.1 MiB with one), as much as an untied model's peak. In
  // mixed precision the lm_head's part arrives as a fresh fp32 cast of its bf16 GEMM, and the sum is one block
  // (measured: 963.5 KiB, the model with two was 11.7% over).
  MemoryEstimate end{"embedding backward",
                     {{"weights", z.weights},
                      {"gradients", z.all_gradients},
                      {"the layers' gathered parameters (ZeRO-3: in use to the end of the backward)",
                       z.L * z.gathered_layer()},
                      {"dense embedding gradient", w.config.tie_word_embeddings ? (z.cast ? 1 : 2) * z.V * z.d * z.g : 0},
                      {"dL/dH", z.B * z.T * z.d * z.s},
                      {"objective buffers", objective_bytes(w)}}};
  moments.push_back(end);
  auto peak = largest(moments);
  peak.host = offload_host_terms(w);  // its gradients, stored at their events after the backward
  return peak;
}

}  // namespace sbp

#include "baselines/mst.h"

#include <algorithm>
#include <string>

#include "core/methods/memory_terms.h"

namespace sbp {

using namespace memory;

MemoryEstimate MsT::memory_model(const Workload& w) const {
  require_whole_sequences(w, spec());
  const auto mini_seq_len = mini_sequence_length(w.seq_len, options_.mini_seq);
  const Sizes z(w);
  const auto c = std::min(mini_seq_len, z.T);
  const auto btd = z.B * z.T * z.d * z.s;
  const auto& cfg = w.config;
  // Re-forward of a layer (the last one, with all gradients but an untied embedding's): attention on the full
  // sequence with its graph, h_mid and its gradient; then either one MLP mini-sequence's activations, or the
  // attention block's backward (below). The layer input's gradient (dL/dH in) is only made by that backward, at its
  // end, when the activations are gone (measured: not alive during the MLP mini-sequences nor at either
  // attention-backward peak, tiny bf16 B = 8 T = 4096).
  auto moments = streamed_head_moments(w, c);
  for (const auto& state : layer_states(z)) {
    const auto layer = "layer " + std::to_string(state.layer) + " backward";
    // bf16: the MLP's weight (or adapter) gradients summed over the mini-sequences in fp32 (ChunkGradients).
    const auto mlp_gradient_elements = z.lora ? w.lora_mlp_targets * w.lora_rank * (z.d + cfg.intermediate_size)
                                              : 3 * z.d * cfg.intermediate_size + z.d;
    // The attention block's saved activations (see the attention backward's notes below) and its norms' statistics
    // (the input norm's, q's and k's rsqrt rows; the post norm's is the MLP's).
    const auto rsqrt_rows = z.B * z.T * (norm_statistics_bytes_per_token(w) - z.f);
    const auto attention_saved = z.B * z.T * attention_activation_bytes_per_token(w, true);
    // Alive at every moment of the layer: the layer input's gradient (dL/dH in) is made only at its end.
    const std::vector<MemoryTerm> common = {{"weights", z.weights},
                                            {"the layer's gathered parameters (ZeRO-3)", z.gathered_layer()},
                                            {"checkpoints", state.checkpoints},
                                            {"dL/dH out", btd},
                                            {"h_mid + its gradient", 2 * btd},
                                            {"objective buffers", objective_bytes(w)}};
    MemoryEstimate mlp{layer + " (MLP mini-sequence)", common};
    mlp.terms.insert(mlp.terms.end(),
                     {{"weight copies (compute dtype)", z.layer_copies()},
                      {"gradients", state.gradients},
                      {"attention activations (o_proj's input is SDPA's output; packed: a copy of it)",
                       attention_saved + z.B * z.T * packed_output_copy_bytes_per_token(w)},
                      {"RMSNorm rsqrt rows (fp32)", rsqrt_rows},
                      {"RoPE tables", rope_table_bytes(w, z.T)},
                      {"MLP mini-sequence", z.B * c * mlp_activation_bytes_per_token(w)},
                      {"MLP gradient sums (fp32)", z.f > z.g ? mlp_gradient_elements * z.f : 0}});
    // The attention block's backward (h_mid.backward(g_mid)), measured with run --timeline (the blocks alive at its
    // peak) on tiny fp32 and bf16 B = 8 T = 4096, bf16-mixed LoRA B = 4 T = 4096, tiny-mha fp32 B = 1 T = 64:
    //   streambp run --preset tiny --method mst:mini_seq=64 --batch 8 --seq 4096 --dtype bf16 --threads 2 --timeline P
    // - g_mid (dL/dh_mid) stays alive to the end of the layer (layer_backward holds it) next to h_mid and dL/dH out.
    // - Layer l's q/k/v projection and norm weight gradients do not exist yet (their backward comes later; o_proj's
    //   does): at tiny-mha fp32 B = 1 T = 64 the model held 48 KiB of them too many (3 x [64, 64] fp32), 3.8% over.
    //   Of the layer's compute-dtype weight copies (mixed precision) only q/k/v's (and the norms') are still saved.
    //   Under LoRA the same holds for the adapters: the MLP's and o's gradients exist, q/k/v's not; o's A x and copy
    //   are freed by o_proj's backward (bf16-mixed LoRA B = 4 T = 64: 18 KiB of MLP and 4 KiB of o adapter gradients,
    //   q/k/v's 1.5 KiB copies and 4 KiB A x each; the model held 30 KiB more, 2.8% over).
    const bool o_adapted = z.lora && w.adapts("o");
    const auto lora_attention_elements =
        z.lora ? w.lora_parameters / std::max<std::int64_t>(1, z.L) -
                     w.lora_mlp_targets * w.lora_rank * (z.d + cfg.intermediate_size)
               : 0;
    const auto qkv_elements =
        z.lora ? lora_attention_elements - (o_adapted ? w.lora_rank * (cfg.q_width() + z.d) : 0)
               : (z.d + (cfg.attention_bias ? 1 : 0)) * (cfg.q_width() + 2 * cfg.kv_width()) + z.d +
                     (cfg.qk_norm ? 2 * cfg.head_dim : 0);
    const auto gradients_before_qkv = state.gradients - qkv_elements * z.g;
    const auto qkv_copies = qkv_elements * z.cast;
    const auto o_lora_inputs = o_adapted ? z.B * z.T * w.lora_rank * z.s : 0;  // o's A x, freed
    // - SDPA's output is [B, T, n_h, hd] storage viewed as [B, n_h, T, hd]: Model::attend's transpose + reshape is a
    //   view, so o_proj saves the output itself, no [T, n_h*hd] copy: the fp32 B = 8 T = 4096 peak holds one 8 MiB
    //   [B, T, n_h*hd] block, not two.
    // - Each RMSNorm also saves its fp32 rsqrt row per token and head (input norm 1, q_norm n_h, k_norm n_kv): 896 KiB
    //   at bf16 B = 8 T = 4096, not in the shared per-token terms.
    // (a) SDPA's backward: every activation of the block saved, the gradients of the attention output, q, k, v
    //     (attention_backward_terms) and the flash kernel's scratch (bf16 B = 8 T = 4096: 83.8 MiB live, of it
    //     grad_out 4 + grad_q 4 + grad_k 2 + grad_v 2 MiB and scratch 2 + 1 MiB).
    // Both moments of the attention block's backward: its q/k/v gradients (and copies) do not exist yet.
    auto before_qkv = common;
    before_qkv.insert(before_qkv.end(), {{"q/k/v weight copies (compute dtype)", qkv_copies},
                                         {"gradients (but layer's q/k/v/norms)", gradients_before_qkv}});
    MemoryEstimate attention{layer + " (attention)", before_qkv};
    attention.terms.insert(attention.terms.end(),
                           {{"attention activations (o_proj's input is SDPA's output) but o's A x",
                             attention_saved - o_lora_inputs},
                            {"RMSNorm rsqrt rows (fp32)", rsqrt_rows},
                            {"RoPE tables", rope_table_bytes(w, z.T)}});
    for (const auto& t : attention_backward_terms(w)) attention.terms.push_back(t);
    moments.push_back(mlp);
    moments.push_back(attention);
    // (b) qk_norm: q's RMSNorm backward, right after SDPA's and RoPE's backward (q was computed last, so its path is
    //     back-propagated first). SDPA's saved q, k, v, output and log-sum-exp, q's rotated copy, normed output and
    //     rsqrt rows and q's RoPE tables are freed; its saved fp32 input ([B, T, n_h*hd], the projection output cast)
    //     is alive, and so are the input norm's and k's saved tensors, k's RoPE tables and the k/v gradients (the
    //     CPU kernel makes them with n_kv heads). The norm's autograd backward holds five [B, T, n_h*hd] temporaries
    //     in the statistics dtype at its peak (grad·rsqrt, mean's expanded gradient, xc.pow(1), 2·xc.pow(1) and
    //     grad·2·xc: pow's backward); in bf16 they are fp32, twice the size of everything else, and this is the
    //     layer's peak: bf16 B = 8 T = 4096 measured 94.9 MiB, of it 5 x 8 MiB temporaries, q's 8 MiB input, the
    //     input norm's 16.1 MiB, k's 6.3 MiB, grad_k + grad_v 4 MiB (the model before this moment: 82.8 MiB,
    //     14.6% under); bf16-mixed LoRA B = 4 T = 4096: 45.5 MiB, of it 5 x 4 MiB.
    if (cfg.qk_norm) {
      const auto qw = cfg.q_width(), kw = cfg.kv_width();
      // Input norm: its per-token share of the shared term (saved fp32 input, normed output, scaled output);
      // k: the norm's saved input and (full fine-tuning) normed output, not the rotated copy SDPA kept; under LoRA
      // the A x of each adapted projection but o.
      const auto input_norm = norm_bytes(z.d, z) - (z.f == z.s ? z.d * z.f : 0);
      const auto k_saved = kw * (z.f + (z.lora ? 0 : 1) * z.s);
      const auto per_token = input_norm + k_saved + qw * z.f +
                             (w.lora_attention_targets - (o_adapted ? 1 : 0)) * w.lora_rank * z.s +
                             (1 + cfg.num_key_value_heads) * z.f;  // rsqrt rows of the input norm and k_norm
      MemoryEstimate q_norm{layer + " (q norm backward)", before_qkv};
      q_norm.terms.insert(q_norm.terms.end(),
                          {{"input norm's, k's and q norm's saved tensors", z.B * z.T * per_token},
                           {"k's RoPE tables", rope_table_bytes(w, z.T) / 2},
                           {"k, v gradients", 2 * z.B * z.T * kw * z.s},
                           {"q norm backward temporaries (5, statistics dtype)", 5 * z.B * z.T * qw * z.f}});
      moments.push_back(q_norm);
    }
  }
  return checkpointing_peak(std::move(moments), w);
}

}  // namespace sbp

#include "verify/conformance.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/io/dtype.h"
#include "core/io/spec.h"
#include "core/objectives/objective.h"
#include "verify/conform_packed.h"
#include "verify/grad_compare.h"
#include "verify/rl_step_oracle.h"
#include "core/io/input_error.h"

namespace sbp {
namespace {

// The architecture knobs implementations get wrong, on tiny's sizes (2 layers, d = 64, V = 512).
ModelConfig variant(bool mha, bool qk_norm, bool bias, bool tied) {
  auto c = preset_config(mha ? "tiny-mha" : "tiny");
  c.qk_norm = qk_norm;
  c.attention_bias = bias;
  c.o_proj_bias = bias && qk_norm;  // Qwen3 with attention_bias biases o_proj too; Qwen2 (no qk-norm) never does
  c.tie_word_embeddings = tied;
  c.name = fmt::format("tiny-{}-{}{}-{}", mha ? "mha" : "gqa", qk_norm ? "qknorm" : "noqknorm", bias ? "-bias" : "",
                       tied ? "tied" : "untied");
  return c;
}

// B rows of T tokens with ragged right padding and a masked prompt: every row has its own number of targets.
RandomBatchOptions ragged(std::int64_t B, std::int64_t T, std::uint64_t seed, std::int64_t group = 0) {
  return {B, T, 0.3, 0.2, seed, group};
}

ConformCase make_case(std::string name, std::string description, ModelConfig config, c10::ScalarType dtype,
                      std::string objective, RandomBatchOptions batch, std::string lora = "") {
  ConformCase c;
  c.name = std::move(name);
  c.description = std::move(description);
  c.config = std::move(config);
  c.dtype = dtype;
  c.objective = std::move(objective);
  c.batch = batch;
  c.lora = std::move(lora);
  return c;
}

// A case whose optimizer step is these micro-batches of its rows (issue #45).
ConformCase micro(ConformCase c, std::vector<std::vector<std::int64_t>> rows) {
  c.micro_batches = std::move(rows);
  return c;
}

const std::string kLora = "rank=4,alpha=8,init=random";  // B != 0: both factors have real gradients

// The case on `ranks` ranks that split the sequence (issue #45): the library's own split and loss aggregation.
ConformCase sequence_parallel(ConformCase c, int ranks) {
  c.ranks = ranks;
  c.parallel = ConformParallel::sequence;
  return c;
}

std::vector<ConformCase> quick_cases() {
  const auto tiny = variant(false, true, false, true);
  return {
      make_case("sft-gqa-qknorm-tied", "GQA, qk-norm, tied head; T = 37 (no chunk size divides it), ragged padding, "
                "masked prompts", tiny, c10::kDouble, "sft", ragged(3, 37, 1)),
      make_case("sft-mha-bias-untied", "MHA, q/k/v bias, no qk-norm (Qwen2-style), untied lm_head",
                variant(true, false, true, false), c10::kDouble, "sft", ragged(3, 37, 2)),
      make_case("sft-T2", "the shortest sequence: one target token", tiny, c10::kDouble, "sft", {1, 2, 0.0, 0.0, 3, 0}),
      make_case("grpo-beta0.04-grpo-token", "GRPO with a KL term, per-sequence means, token importance", tiny,
                c10::kDouble, "grpo:beta=0.04,loss_type=grpo", ragged(3, 29, 4, 3)),
      make_case("grpo-beta0-dapo-sequence", "GRPO without KL, token-level normalisation, sequence importance", tiny,
                c10::kDouble, "grpo:loss_type=dapo,importance=sequence", ragged(3, 29, 5, 3)),
      make_case("dpo-3pairs-ls0.1", "DPO, three pairs, label smoothing", variant(false, true, false, false),
                c10::kDouble, "dpo:beta=0.1,label_smoothing=0.1", ragged(6, 31, 6)),
      make_case("sft-lora", "LoRA on every linear layer (PEFT names)", tiny, c10::kDouble, "sft", ragged(3, 37, 7), kLora),
      make_case("sft-fp32", "fp32, judged against the baseline in fp32", tiny, c10::kFloat, "sft", ragged(3, 37, 8)),
      make_case("sft-bf16", "bf16, judged against the baseline in bf16", tiny, c10::kBFloat16, "sft", ragged(3, 37, 9)),
      // Contiguous shards of a ragged batch hold different target counts (the prompts mask the first, the padding
      // the last), so a per-shard normaliser fails; T divides by neither W.
      sequence_parallel(make_case("sft-sp2-T37", "the sequence split over 2 ranks (the library's split and loss "
                                  "aggregation), T = 37: shards with different target counts", tiny, c10::kDouble,
                                  "sft", ragged(3, 37, 10)), 2),
      // T mod 3 = 2 and row 0 unpadded: a split that drops the T mod W last positions loses a target (T mod W = 1
      // would drop only the last position, which predicts nothing).
      sequence_parallel(make_case("sft-sp3-T38", "the sequence split over 3 ranks, T = 38 (T mod 3 = 2, row 0 "
                                  "unpadded): shards with different target counts", variant(true, false, true, false),
                                  c10::kDouble, "sft", {3, 38, 0.03, 0.2, 11, 0}), 3),
      // Micro-batches of different sizes over ragged rows: their target counts (tokens, rows, pairs) all differ.
      micro(make_case("sft-micro3", "a step of 3 micro-batches (1, 2 and 1 rows, each its own target count)", tiny,
                      c10::kDouble, "sft", ragged(4, 37, 10)), {{0}, {1, 2}, {3}}),
      micro(make_case("grpo-micro2", "GRPO (per-sequence means) over 2 micro-batches of 2 and 1 rows", tiny,
                      c10::kDouble, "grpo:beta=0.04,loss_type=grpo", ragged(3, 29, 11, 3)), {{0, 1}, {2}}),
      micro(make_case("dpo-micro2", "DPO over 2 micro-batches of 2 pairs and 1 pair, untied lm_head",
                      variant(false, true, false, false), c10::kDouble, "dpo:beta=0.1", ragged(6, 31, 12)),
            {{0, 1, 3, 4}, {2, 5}}),
      // Packed rows (issue #59): the 20-token sequence at [5, 25) crosses the layer tile at 16 and the head tiles at 8,
      // 16 and 24; sequences of one token; the last row 26 tokens, then 11 pads (a ragged last pack).
      packed_case(make_case("sft-packed", "packed rows (several sequences a row, each attending within itself, "
                            "position_ids restarting): a sequence across tile boundaries, sequences of one token, a "
                            "ragged last pack", tiny, c10::kDouble, "sft", ragged(3, 37, 13)),
                  {{5, 20, 12}, {1, 17, 19}, {10, 1, 15}}),
      // Two packs whose boundaries differ in one micro-batch (a RoPE that reads one row's positions for all fails),
      // then one pack; Qwen2-style so that the packed path is not Qwen3's alone.
      micro(packed_case(make_case("sft-packed-micro2", "a step of 2 micro-batches of packed rows (2 packs with "
                                  "different boundaries, then 1), MHA, bias, untied lm_head",
                                  variant(true, false, true, false), c10::kDouble, "sft", ragged(3, 37, 14)),
                        {{9, 28}, {1, 1, 35}, {20, 6}}),
            {{0, 2}, {1}}),
  };
}

// A pull request's matrix (issue #47): quick's cases a CI cannot skip, ~1 minute for HF on 2 cores. T = 37 runs
// several tiles of the suggested chunks (3 layer, 5 head, the last short) over a ragged batch; fp64 at 1e-10 for each
// objective, both model families and tied/untied heads; LoRA; one low-precision case (bf16: the rule runs the
// baseline too); one micro-batch step; one packed case. Left to quick/full: T = 2, fp32, the sequence-parallel
// cases, the other GRPO loss types and importance levels, temperature, the architecture grid, LoRA per objective.
std::vector<ConformCase> ci_cases() {
  std::vector<ConformCase> out;
  for (auto& c : quick_cases())
    for (const auto* name : {"sft-gqa-qknorm-tied", "sft-mha-bias-untied", "grpo-beta0.04-grpo-token",
                             "dpo-3pairs-ls0.1", "sft-lora", "sft-bf16", "sft-micro3", "sft-packed"})
      if (c.name == name) out.push_back(c);
  return out;
}

std::vector<ConformCase> full_cases() {
  auto cases = quick_cases();
  std::uint64_t seed = 100;
  // Every architecture variant, SFT: "sft-arch-" apart from quick's cases, one of which is a variant's architecture.
  for (const bool mha : {false, true})
    for (const bool qk_norm : {false, true})
      for (const bool bias : {false, true})
        for (const bool tied : {false, true}) {
          const auto c = variant(mha, qk_norm, bias, tied);
          cases.push_back(make_case("sft-arch-" + c.name.substr(5), "architecture variant", c, c10::kDouble, "sft",
                                    ragged(2, 41, seed++)));
        }
  const auto tiny = variant(false, true, false, true);
  // GRPO: every loss type x both importance levels x beta = 0 and > 0.
  for (const std::string loss : {"grpo", "bnpo", "dr_grpo", "dapo"})
    for (const std::string importance : {"token", "sequence"})
      for (const std::string beta : {"0", "0.04"})
        cases.push_back(make_case(fmt::format("grpo-{}-{}-beta{}", loss, importance, beta), "GRPO loss variant", tiny,
                                  c10::kDouble, fmt::format("grpo:beta={},loss_type={},importance={}", beta, loss, importance),
                                  ragged(4, 23, seed++, 2)));
  cases.push_back(make_case("grpo-temperature0.7", "GRPO, sampling temperature != 1", tiny, c10::kDouble,
                            "grpo:beta=0.04,temperature=0.7", ragged(3, 23, seed++, 3)));
  for (const std::string ls : {"0", "0.1"})
    for (const bool tied : {true, false})
      cases.push_back(make_case(fmt::format("dpo-ls{}-{}", ls, tied ? "tied" : "untied"), "DPO, several pairs",
                                variant(false, true, false, tied), c10::kDouble,
                                "dpo:beta=0.1,label_smoothing=" + ls, ragged(4, 27, seed++)));
  cases.push_back(make_case("grpo-lora", "GRPO on LoRA adapters", tiny, c10::kDouble, "grpo:beta=0.04",
                            ragged(3, 23, seed++, 3), kLora));
  cases.push_back(make_case("dpo-lora", "DPO on LoRA adapters", tiny, c10::kDouble, "dpo", ragged(4, 23, seed++), kLora));
  cases.push_back(make_case("sft-lora-untied-bias", "LoRA on an untied, biased model", variant(true, false, true, false),
                            c10::kDouble, "sft", ragged(3, 23, seed++), kLora));
  for (const auto dtype : {c10::kFloat, c10::kBFloat16}) {
    const std::string d = dtype == c10::kFloat ? "fp32" : "bf16";
    cases.push_back(make_case("grpo-" + d, "GRPO in " + d, tiny, dtype, "grpo:beta=0.04", ragged(3, 37, seed++, 3)));
    cases.push_back(make_case("dpo-" + d, "DPO in " + d, tiny, dtype, "dpo", ragged(4, 37, seed++)));
    cases.push_back(make_case("sft-lora-" + d, "LoRA in " + d, tiny, dtype, "sft", ragged(3, 37, seed++), kLora));
    cases.push_back(micro(make_case("sft-micro-" + d, "2 micro-batches of 2 ragged rows in " + d, tiny, dtype, "sft",
                                    ragged(4, 37, seed++)), {{0, 1}, {2, 3}}));
  }
  cases.push_back(micro(make_case("grpo-dapo-micro2", "GRPO dapo (the step's token count) over 2 micro-batches",
                                  tiny, c10::kDouble, "grpo:loss_type=dapo", ragged(4, 23, seed++, 2)),
                        {{0, 1}, {2, 3}}));
  cases.push_back(micro(make_case("sft-lora-micro2", "LoRA over 2 micro-batches", tiny, c10::kDouble, "sft",
                                  ragged(3, 23, seed++), kLora), {{0}, {1, 2}}));
  // Packed rows under LoRA and in bf16 (quick has them in fp64, one pass and micro-batches).
  const std::vector<std::vector<std::int64_t>> packs = {{4, 21, 12}, {1, 30, 6}, {16, 1, 1, 9}};
  cases.push_back(packed_case(make_case("sft-packed-lora", "LoRA on packed rows (the last one ragged)", tiny,
                                        c10::kDouble, "sft", ragged(3, 37, seed++), kLora), packs));
  cases.push_back(packed_case(make_case("sft-packed-bf16", "packed rows in bf16 (the last one ragged)", tiny,
                                        c10::kBFloat16, "sft", ragged(3, 37, seed++)), packs));
  return cases;
}

// Long enough for tiles: T = 300 against tiles of 64 (layer_chunk / head_chunk: a tiled MLP, a tiled loss, a chunked
// head each run five, the last one short), a ragged batch; Qwen3's shape (qk-norm, tied) and Llama's (no qk-norm, no
// bias, untied: written as a LlamaForCausalLM config); and a case for 2 ranks.
std::vector<ConformCase> survey_cases() {
  const auto qwen3 = variant(false, true, false, true), llama = variant(false, false, false, false);
  const auto tiled = [](ConformCase c) {
    c.layer_chunk = 64, c.head_chunk = 64;
    return c;
  };
  std::vector<ConformCase> cases = {
      tiled(make_case("sft-qwen3-T300", "Qwen3-shaped, T = 300 (five tiles of 64, the last short), ragged padding "
                      "and masked prompts", qwen3, c10::kDouble, "sft", ragged(3, 300, 21))),
      tiled(make_case("sft-llama-T300", "Llama-shaped (no qk-norm, untied lm_head), T = 300", llama, c10::kDouble,
                      "sft", ragged(3, 300, 22))),
      tiled(make_case("sft-qwen3-untied-T300", "Qwen3-shaped with an untied lm_head: beside sft-qwen3-T300, the tied "
                      "head alone differs", variant(false, true, false, false), c10::kDouble, "sft",
                      ragged(3, 300, 21))),
      tiled(micro(make_case("sft-qwen3-T300-micro3", "a step of 3 micro-batches (1, 2 and 1 ragged rows), T = 300",
                            qwen3, c10::kDouble, "sft", ragged(4, 300, 30)), {{0}, {1, 2}, {3}})),
      // Llama's shape in fp32: a step of micro-batches that transformers releases before Qwen3 (4.51) can load,
      // where HF's loss (logits.float()) is not below the bar
      tiled(micro(make_case("sft-llama-T300-micro3-fp32", "Llama-shaped, fp32, a step of 3 micro-batches (1, 2 and 1 "
                            "ragged rows), T = 300", llama, c10::kFloat, "sft", ragged(4, 300, 32)), {{0}, {1, 2}, {3}})),
      tiled(make_case("sft-qwen3-T37", "one tile shorter than the rest: T = 37", qwen3, c10::kDouble, "sft",
                      ragged(3, 37, 23))),
      tiled(make_case("grpo-qwen3-T300", "GRPO with a KL term, T = 300", qwen3, c10::kDouble,
                      "grpo:beta=0.04,loss_type=grpo", ragged(3, 300, 24, 3))),
      tiled(make_case("dpo-qwen3-T300", "DPO, two pairs, T = 300", qwen3, c10::kDouble, "dpo:beta=0.1",
                      ragged(4, 300, 25))),
      tiled(make_case("sft-lora-qwen3-T300", "LoRA on every linear layer, T = 300", qwen3, c10::kDouble, "sft",
                      ragged(3, 300, 26), kLora)),
      tiled(make_case("sft-qwen3-T300-fp32", "fp32, T = 300", qwen3, c10::kFloat, "sft", ragged(3, 300, 27))),
      tiled(make_case("sft-qwen3-T300-bf16", "bf16, T = 300", qwen3, c10::kBFloat16, "sft", ragged(3, 300, 28))),
  };
  // Packed rows as DataCollatorWithFlattening writes them (prompt_fraction 0: every token but each sequence's first
  // is a target, where TRL PR #4170's kept separator labels show), Llama-shaped in fp32 (transformers releases before
  // Qwen3 load it, and HF's loss is not below the bar in fp64), and a micro-batch of two packs whose boundaries differ
  // (Liger PR #477's RoPE reading row 0's positions for every row shows only with B >= 2). The 135-token sequence at
  // [165, 300) crosses the tiles at 192 and 256, the 200-token one at [0, 200) three of them; sequences of one token.
  auto packed = tiled(micro(packed_case(make_case("sft-llama-T300-packed-micro2-fp32", "Llama-shaped, fp32, packed "
                                                  "rows as DataCollatorWithFlattening writes them (every token but "
                                                  "each sequence's first a target), a step of 2 micro-batches: 2 "
                                                  "packs with different boundaries, then 1; T = 300", llama,
                                                  c10::kFloat, "sft", {3, 300, 0.0, 0.0, 33, 0}),
                                        {{1, 64, 100, 135}, {200, 1, 99}, {30, 30, 240}}),
                            {{0, 2}, {1}}));
  cases.push_back(packed);
  auto ranks = tiled(make_case("sft-qwen3-T300-2ranks", "2 ranks (the implementation's own processes), their "
                               "gradients together the whole batch's", qwen3, c10::kDouble, "sft", ragged(4, 300, 29)));
  ranks.ranks = 2;
  cases.push_back(ranks);
  // T = 299: odd and not a multiple of 3, shards of ~150 and ~100 positions each spanning several tiles.
  cases.push_back(sequence_parallel(tiled(make_case("sft-qwen3-T299-sp2", "the sequence split over 2 ranks (the "
                                                    "library's split and loss aggregation), T = 299", qwen3,
                                                    c10::kDouble, "sft", ragged(3, 299, 30))), 2));
  cases.push_back(sequence_parallel(tiled(make_case("sft-llama-T299-sp3", "the sequence split over 3 ranks, T = 299",
                                                    llama, c10::kDouble, "sft", ragged(3, 299, 31))), 3));
  return cases;
}

// One generation batch for the whole-RL-step cases (issue #60): 3 prompts of lengths 3, 5 and 2, G = 2 completions
// each in TRL's order. Row 0 stops at an EOS and generates on (the tail must be masked), rows 1 and 5 are truncated at
// max_completion_length (no EOS), row 2 is a lone EOS, rows 3 and 4 end at theirs: kept lengths 3, 5, 1, 2, 4, 5.
// Two reward functions, every value exact in fp32 (TRL builds its reward table in torch's default dtype).
constexpr const char* kRlGenerations = R"("prompts": [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]],
  "completions": [[7, 9, 1, 4, 4], [11, 12, 13, 14, 15], [1, 30, 31], [21, 1], [40, 41, 42, 1], [50, 51, 52, 53, 54]],
  "rewards": [[1.0, 0.5], [0.0, 1.0], [0.25, 0.0], [2.0, 0.5], [0.5, 0.5], [1.5, 0.0]])";

// A whole RL step on tiny's Qwen3 shape in fp64: the generations above, `settings` (TRL's GRPOConfig names beside
// the shared ones) and a micro-batch layout. Two micro-batches of 3 rows hold 14 and 6 completion tokens and mix the
// prompts' groups, so a normaliser per micro-batch and a group taken as a micro-batch both show.
ConformCase rl_case(std::string name, std::string description, const std::string& settings,
                    const std::string& micro_batches, std::uint64_t seed) {
  const auto text = fmt::format(R"({{{}, "micro_batches": {},
  "settings": {{"num_generations": 2, "max_completion_length": 5, "eos_token_id": 1, "pad_token_id": 0, {}}}}})",
                                kRlGenerations, micro_batches, settings);
  ConformCase c;
  c.name = std::move(name);
  c.description = std::move(description);
  c.config = variant(false, true, false, true);
  c.rl_step = parse_rl_step_case(text, "rl case " + c.name);
  c.objective = rl_objective_spec(c.rl_step->settings);
  c.batch = {c.rl_step->rows(), 0, 0, 0, seed, c.rl_step->settings.num_generations};
  check_rl_step_case(*c.rl_step, c.config, "rl case " + c.name);
  return c;
}

// Several loss_types and scale_rewards, an optimizer step of two micro-batches, steps_per_generation > 1 (two
// optimizer steps of one generation batch, old log-probs from generation time), num_iterations > 1, the KL term with
// and without TRL's bias correction, sequence importance, masked truncated completions (dr_grpo's and dapo's
// normalisers), one micro-batch at temperatures 0.9 and 1.
std::vector<ConformCase> rl_cases() {
  const std::string two = "[[4, 1, 5], [0, 2, 3]]", one = "[[0, 1, 2, 3, 4, 5]]";
  return {
      rl_case("rl-dapo-group-ga2", "dapo, scale_rewards group, beta 0.04, temperature 0.9: one optimizer step of 2 "
              "micro-batches (gradient_accumulation_steps 2)", R"("loss_type": "dapo", "scale_rewards": "group",
              "beta": 0.04, "temperature": 0.9, "per_device_train_batch_size": 3, "gradient_accumulation_steps": 2,
              "reward_weights": [1.0, 0.5])", two, 41),
      rl_case("rl-grpo-batch-spg2", "grpo, scale_rewards batch: steps_per_generation 2, two optimizer steps of one "
              "generation batch (SGD 0.02 between them; old_logps from generation time)", R"("loss_type": "grpo",
              "scale_rewards": "batch", "beta": 0.0, "per_device_train_batch_size": 3, "gradient_accumulation_steps": 1,
              "steps_per_generation": 2, "learning_rate": 0.02, "reward_weights": [1.0, 0.5])", two, 42),
      rl_case("rl-bnpo-none-iter2-sequence", "bnpo, scale_rewards none, sequence importance, epsilon_high 0.28, beta "
              "0.04: num_iterations 2, each optimizer step 2 micro-batches (SGD 0.02)", R"("loss_type": "bnpo",
              "scale_rewards": "none", "beta": 0.04, "importance_sampling_level": "sequence", "epsilon_high": 0.28,
              "use_bias_correction_kl": false, "per_device_train_batch_size": 3, "gradient_accumulation_steps": 2,
              "num_iterations": 2, "learning_rate": 0.02, "reward_weights": [0.5, 2.0])", two, 43),
      rl_case("rl-dr_grpo-masktrunc-ga2", "dr_grpo, scale_rewards true (group), mask_truncated_completions: one "
              "optimizer step of 2 micro-batches", R"("loss_type": "dr_grpo", "scale_rewards": true, "beta": 0.0,
              "mask_truncated_completions": true, "per_device_train_batch_size": 3, "gradient_accumulation_steps": 2,
              "reward_weights": [1.0, 1.0])", two, 44),
      rl_case("rl-dapo-kl-spg2", "dapo, beta 0.04 with TRL's default use_bias_correction_kl: steps_per_generation 2, "
              "two optimizer steps (SGD 0.02), the KL term's gradient non-zero at the second", R"("loss_type": "dapo",
              "scale_rewards": "group", "beta": 0.04, "use_bias_correction_kl": true, "per_device_train_batch_size": 3,
              "gradient_accumulation_steps": 1, "steps_per_generation": 2, "learning_rate": 0.02,
              "reward_weights": [1.0, 0.5])", two, 45),
      rl_case("rl-dapo-masktrunc-ga2", "dapo, mask_truncated_completions, beta 0: one optimizer step of 2 "
              "micro-batches, dapo's normaliser the step's kept tokens (the truncated completions' masked)",
              R"("loss_type": "dapo", "scale_rewards": "group", "beta": 0.0, "mask_truncated_completions": true,
              "per_device_train_batch_size": 3, "gradient_accumulation_steps": 2, "reward_weights": [1.0, 0.5])",
              two, 46),
      // One micro-batch of the whole generation batch, as the first GRPOTrainers (0.14-0.16) run it: they generate
      // per micro-batch and have one loss each (grpo before 0.16, bnpo in 0.16).
      rl_case("rl-grpo-one-t09", "grpo, scale_rewards group, beta 0.04, temperature 0.9: one micro-batch of all 6 "
              "completions", R"("loss_type": "grpo", "scale_rewards": "group", "beta": 0.04, "temperature": 0.9,
              "per_device_train_batch_size": 6, "gradient_accumulation_steps": 1, "reward_weights": [1.0, 1.0])",
              one, 47),
      rl_case("rl-bnpo-one-t09", "bnpo, scale_rewards group, beta 0.04, temperature 0.9: one micro-batch of all 6 "
              "completions", R"("loss_type": "bnpo", "scale_rewards": "group", "beta": 0.04, "temperature": 0.9,
              "per_device_train_batch_size": 6, "gradient_accumulation_steps": 1, "reward_weights": [1.0, 1.0])",
              one, 48),
      rl_case("rl-grpo-one-t1", "grpo, scale_rewards group, beta 0.04, temperature 1: one micro-batch of all 6 "
              "completions", R"("loss_type": "grpo", "scale_rewards": "group", "beta": 0.04, "temperature": 1.0,
              "per_device_train_batch_size": 6, "gradient_accumulation_steps": 1, "reward_weights": [1.0, 1.0])",
              one, 49),
  };
}

std::vector<ConformCase> file_cases(const std::string& file) {
  std::ifstream in(file);
  if (!in) throw InputError("--cases " + file + ": cannot read it");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw InputError("--cases " + file + ": " + e.what());
  }
  if (!j.is_array() || j.empty()) throw InputError("--cases " + file + ": expected a non-empty JSON array of cases");
  const std::set<std::string> known = {"name", "preset", "dtype", "objective", "lora", "batch", "seq", "pad_fraction",
                                       "prompt_fraction", "group", "seed", "layer_chunk", "head_chunk", "qk_norm",
                                       "attention_bias", "tie_word_embeddings", "num_key_value_heads", "description",
                                       "ranks", "parallel", "micro_batches", "pack_lengths"};
  std::vector<ConformCase> out;
  for (std::size_t i = 0; i < j.size(); ++i) {
    const auto& e = j[i];
    const auto where = fmt::format("--cases {}: case {}", file, i);
    if (!e.is_object()) throw InputError(where + ": not an object");
    for (const auto& [key, value] : e.items())
      if (!known.count(key)) throw InputError(where + ": unknown key '" + key + "'");
    try {
      ConformCase c;
      c.name = e.at("name").get<std::string>();
      c.description = e.value("description", std::string("from ") + file);
      c.config = preset_config(e.value("preset", std::string("tiny")));
      c.config.qk_norm = e.value("qk_norm", c.config.qk_norm);
      c.config.attention_bias = e.value("attention_bias", c.config.attention_bias);
      c.config.o_proj_bias = c.config.attention_bias && c.config.qk_norm;
      c.config.tie_word_embeddings = e.value("tie_word_embeddings", c.config.tie_word_embeddings);
      c.config.num_key_value_heads = e.value("num_key_value_heads", c.config.num_key_value_heads);
      c.config.validate();
      c.dtype = parse_dtype(e.value("dtype", std::string("fp64")));
      c.objective = e.value("objective", std::string("sft"));
      c.lora = e.value("lora", std::string());
      c.batch = {e.value("batch", std::int64_t(3)), e.value("seq", std::int64_t(37)), e.value("pad_fraction", 0.3),
                 e.value("prompt_fraction", 0.2), e.value("seed", std::uint64_t(1)), e.value("group", std::int64_t(0))};
      c.layer_chunk = e.value("layer_chunk", c.layer_chunk);
      c.head_chunk = e.value("head_chunk", c.head_chunk);
      c.ranks = e.value("ranks", 1);
      c.micro_batches = e.value("micro_batches", c.micro_batches);
      if (e.contains("pack_lengths")) {
        const auto lengths = e.at("pack_lengths").get<std::vector<std::vector<std::int64_t>>>();
        if (lengths.empty()) throw InputError("pack_lengths: at least one row");
        if (e.contains("pad_fraction"))
          throw InputError("pad_fraction with pack_lengths: a packed row's padding is what its lengths leave of seq");
        if (e.contains("batch") && c.batch.batch_size != std::int64_t(lengths.size()))
          throw InputError(fmt::format("pack_lengths has {} rows, batch says {}", lengths.size(), c.batch.batch_size));
        if (!e.contains("seq")) {  // the longest row
          c.batch.seq_len = 0;
          for (const auto& row : lengths) {
            std::int64_t sum = 0;
            for (const auto L : row) sum += L;
            c.batch.seq_len = std::max(c.batch.seq_len, sum);
          }
        }
        c = packed_case(std::move(c), lengths);
        if (const auto problem = pack_lengths_problem(c); !problem.empty()) throw InputError(problem);
      }
      if (c.batch.batch_size < 1 || c.batch.seq_len < 2 || c.layer_chunk < 1 || c.head_chunk < 1 || c.ranks < 1)
        throw InputError("batch >= 1, seq >= 2, chunks >= 1 and ranks >= 1 are required");
      const auto parallel = e.value("parallel", std::string("data"));
      if (parallel != "data" && parallel != "sequence")
        throw InputError("parallel '" + parallel + "': data or sequence");
      if (parallel == "sequence") {
        if (c.ranks < 2) throw InputError("parallel 'sequence' needs ranks >= 2");
        if (c.batch.seq_len < c.ranks) throw InputError("parallel 'sequence' needs seq >= ranks");
        c.parallel = ConformParallel::sequence;
      }
      if (const auto problem = micro_batches_problem(c, c.batch.batch_size); !problem.empty())
        throw InputError(problem);
      for (std::size_t k = 0; k < out.size(); ++k)
        if (out[k].name == c.name)  // a case's name is its id: --only, pytest's items and JUnit's rows select by it
          throw InputError(fmt::format("name '{}' is case {}'s too: every case needs its own name", c.name, k));
      out.push_back(std::move(c));
    } catch (const nlohmann::json::exception& ex) {
      throw InputError(where + ": " + ex.what());
    } catch (const std::invalid_argument& ex) {
      throw InputError(where + ": " + ex.what());
    }
  }
  return out;
}

// An rl_step case's settings as case.json states them: every key resolved (no default left to the reader), in TRL's
// GRPOConfig names and values, beside the oracle's own (eos_token_id, pad_token_id, learning_rate: plain SGD's).
nlohmann::json rl_step_settings_json(const RlStepCase& r) {
  const auto& o = r.settings;
  auto weights = o.reward_weights;
  if (weights.empty()) weights.assign(std::size_t(r.rewards.size(1)), 1.0);
  return {{"num_generations", o.num_generations}, {"per_device_train_batch_size", o.per_device_train_batch_size},
          {"gradient_accumulation_steps", o.gradient_accumulation_steps},
          {"steps_per_generation", o.generation_steps()}, {"num_iterations", o.num_iterations},
          {"max_completion_length", o.max_completion_length}, {"scale_rewards", o.scale_rewards},
          {"loss_type", o.loss_type}, {"importance_sampling_level", o.importance_sampling_level}, {"beta", o.beta},
          {"epsilon", o.epsilon}, {"epsilon_high", o.epsilon_upper()}, {"temperature", o.temperature},
          {"mask_truncated_completions", o.mask_truncated_completions},
          {"use_bias_correction_kl", o.use_bias_correction_kl}, {"reward_weights", weights},
          {"eos_token_id", o.eos_token_id}, {"pad_token_id", o.pad_token_id}, {"learning_rate", o.learning_rate}};
}

double number(const Spec& spec, const std::string& key) { return std::stod(spec.options.at(key)); }

}  // namespace

const char* parallel_name(ConformParallel p) { return p == ConformParallel::sequence ? "sequence" : "data"; }

const char* conform_kind(const ConformCase& c) { return c.rl_step ? "rl_step" : "batch"; }

const std::vector<std::string>& conform_case_sets() {
  static const std::vector<std::string> sets = {"ci", "quick", "full", "survey", "rl"};
  return sets;
}

std::string conform_case_id(const ConformCase& c) { return c.name + "-" + dtype_name(c.dtype); }

std::vector<ConformCase> conform_cases(const std::string& which) {
  if (which == "quick") return quick_cases();
  if (which == "ci") return ci_cases();
  if (which == "full") return full_cases();
  if (which == "survey") return survey_cases();
  if (which == "rl") return rl_cases();
  if (!std::filesystem::exists(which)) {
    const auto nearest = nearest_name(which, conform_case_sets());
    throw InputError("--cases " + which + ": neither a case set (ci, quick, full, survey, rl) nor a file" +
                                (nearest.empty() ? "" : " (did you mean " + nearest + "?)"));
  }
  return file_cases(which);
}

namespace {

// result.json as JSON. Python's json.dumps writes a non-finite float as a bare NaN, Infinity or -Infinity, which JSON
// does not have: quote those tokens (outside strings); result_loss reads a quoted one back as its number.
nlohmann::json python_json(const std::string& text) {
  std::string quoted;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      quoted += c;
      if (c == '\\' && i + 1 < text.size()) quoted += text[++i];
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    bool replaced = false;
    for (const std::string token : {"NaN", "Infinity", "-Infinity"})
      if (text.compare(i, token.size(), token) == 0) {
        quoted += '"' + token + '"';
        i += token.size() - 1;
        replaced = true;
        break;
      }
    if (!replaced) quoted += c;
  }
  return nlohmann::json::parse(quoted);
}

}  // namespace

double result_loss(const std::string& text) {
  const auto loss = python_json(text).at("loss");
  if (loss.is_string()) {
    const auto word = loss.get<std::string>();
    if (word == "NaN") return std::numeric_limits<double>::quiet_NaN();
    if (word == "Infinity") return std::numeric_limits<double>::infinity();
    if (word == "-Infinity") return -std::numeric_limits<double>::infinity();
  }
  return loss.get<double>();
}

double result_worker_cpu_seconds(const std::string& text) {
  try {
    const auto j = python_json(text);
    if (!j.contains("cpu_seconds") || !j["cpu_seconds"].is_number()) return 0;
    const double seconds = j["cpu_seconds"].get<double>();
    return std::isfinite(seconds) && seconds > 0 ? seconds : 0;
  } catch (const nlohmann::json::exception&) {
    return 0;
  }
}

ImplementationProvenance result_provenance(const std::string& text) {
  ImplementationProvenance p;
  try {
    const auto j = python_json(text);
    if (j.contains("python") && j["python"].is_string()) p.python = j["python"].get<std::string>();
    if (j.contains("torch_version") && j["torch_version"].is_string())
      p.torch_version = j["torch_version"].get<std::string>();
  } catch (const nlohmann::json::exception&) {
  }
  return p;
}

Accumulation parse_accumulation(const std::string& name) {
  if (name == "union") return Accumulation::union_batch;
  if (name == "micro-means") return Accumulation::micro_means;
  throw InputError("--accumulation " + name + ": union or micro-means");
}

std::string accumulation_name(Accumulation a) { return a == Accumulation::union_batch ? "union" : "micro-means"; }

std::string accumulation_description(Accumulation a) {
  return a == Accumulation::union_batch
             ? "union: the loss over the union of the micro-batches, normalised by the step's target count"
             : "micro-means: the mean over micro-batches of each one's own loss (the library's documented "
               "normalisation)";
}

std::string micro_batches_problem(const ConformCase& c, std::int64_t rows) {
  if (c.micro_batches.empty()) return "";  // one pass over the whole batch
  return micro_batch_rows_problem(c.micro_batches, rows, c.objective.rfind("dpo", 0) == 0);
}

std::vector<Batch> micro_batch_split(const ConformCase& c, const Batch& batch) {
  if (c.micro_batches.empty()) return {batch};
  std::vector<Batch> out;
  for (const auto& rows : c.micro_batches)
    out.push_back(batch.select_rows(at::tensor(rows, at::TensorOptions().dtype(at::kLong))));
  return out;
}

std::string result_micro_batches_problem(const std::string& text, std::size_t expected) {
  const auto j = python_json(text);
  const auto how = fmt::format("the case's step is {} micro-batches (case.json micro_batches): an implementation "
                               "runs them and says how many ran (README: Conformance)", expected);
  if (!j.contains("micro_batches")) return "result.json has no \"micro_batches\"; " + how;
  const auto& v = j["micro_batches"];
  if (!v.is_number_integer()) return "result.json: \"micro_batches\" is " + v.dump() + ", not an integer; " + how;
  if (v.get<std::int64_t>() != std::int64_t(expected))
    return fmt::format("result.json: {} micro-batches ran; {}", v.get<std::int64_t>(), how);
  return "";
}

nlohmann::json case_json(const ConformCase& c, const Objective& objective) {
  const auto spec = parse_spec(objective.spec(), "objective");
  nlohmann::json o = {{"name", spec.name}};
  if (spec.name == "grpo") {
    // TRL's GRPOConfig names (epsilon is the lower clip).
    o["beta"] = number(spec, "beta");
    o["epsilon"] = number(spec, "epsilon_low");
    o["epsilon_high"] = number(spec, "epsilon_high");
    o["loss_type"] = spec.options.at("loss_type");
    o["importance_sampling_level"] = spec.options.at("importance");
    o["temperature"] = number(spec, "temperature");
    o["max_completion_length"] = std::stoll(spec.options.at("max_completion_length"));
  } else if (spec.name == "dpo") {
    o["beta"] = number(spec, "beta");
    o["label_smoothing"] = number(spec, "label_smoothing");
    o["loss_type"] = "sigmoid";
  }
  const std::map<c10::ScalarType, std::string> torch_names = {
      {c10::kDouble, "float64"}, {c10::kFloat, "float32"}, {c10::kBFloat16, "bfloat16"}, {c10::kHalf, "float16"}};
  nlohmann::json out = {{"protocol", kConformProtocol},
          {"case", c.name},
          {"description", c.description},
          {"dtype", torch_names.at(c.dtype)},
          {"objective", o},
          {"lora", !c.lora.empty()},
          {"chunks", {{"layer", c.layer_chunk}, {"head", c.head_chunk}}},
          {"ranks", c.ranks},
          {"parallel", parallel_name(c.parallel)},
          {"returns", c.lora.empty()
                          ? "grads.safetensors: the gradient of every model parameter under its HF name (a tied "
                            "lm_head only as model.embed_tokens.weight), in the model dtype; result.json: {\"loss\": ...}"
                          : "grads.safetensors: the gradient of every adapter tensor under its PEFT name (as in "
                            "adapter/adapter_model.safetensors), in the model dtype; result.json: {\"loss\": ...}"}};
  out["kind"] = conform_kind(c);
  if (c.rl_step) {
    const auto& r = *c.rl_step;
    std::vector<std::vector<double>> rewards;
    const auto table = r.rewards.contiguous();
    for (std::int64_t i = 0; i < table.size(0); ++i) {
      const auto row = table[i];
      rewards.emplace_back(row.data_ptr<double>(), row.data_ptr<double>() + row.numel());
    }
    out["rl_step"] = {{"prompts", r.prompts}, {"completions", r.completions}, {"rewards", rewards},
                      {"micro_batches", r.micro_batches}, {"settings", rl_step_settings_json(r)}};
    out["returns"] = "grads.safetensors: for every optimizer step k (1, 2, ...) of the generation batch, the gradient "
                     "the optimizer receives (no clipping) as step{k}/<HF name>, in float64; optionally the trainer's "
                     "own advantages [N], completion_mask [N, max_completion_length] and token_logps [N, "
                     "max_completion_length] (generation time), in the case's row order, each judged when there; "
                     "result.json: {} or {\"loss\": ...} (recorded, not judged). The trainer runs the case's "
                     "micro_batches in order, its completions and rewards (streambp_conform.rl)";
    return out;
  }
  add_packed_case_json(c, out);  // only in a packed case
  if (!c.micro_batches.empty()) {
    // Only in a micro-batch case: an adapter written before them sees the case.json it knows.
    out["micro_batches"] = c.micro_batches;
    out["returns"] = out["returns"].get<std::string>() + " and \"micro_batches\": how many ran; the gradient and "
                     "loss after the whole step, as the trainer hands them to the optimizer";
  }
  return out;
}

std::vector<std::string> protocol_problems(const TensorList& expected, const TensorList& got) {
  std::vector<std::string> problems;
  std::map<std::string, const at::Tensor*> by_name;
  for (const auto& t : got) {
    if (by_name.count(t.name)) problems.push_back("tensor '" + t.name + "' appears twice");
    by_name[t.name] = &t.tensor;
  }
  std::set<std::string> wanted;
  for (const auto& e : expected) {
    wanted.insert(e.name);
    const auto it = by_name.find(e.name);
    if (it == by_name.end()) {
      problems.push_back("tensor '" + e.name + "' missing");
      continue;
    }
    const auto& g = *it->second;
    if (g.sizes() != e.tensor.sizes()) {
      problems.push_back("tensor '" + e.name + "' has shape " + c10::str(g.sizes()) + ", expected " + c10::str(e.tensor.sizes()));
      continue;
    }
    if (!at::isFloatingType(g.scalar_type())) {
      problems.push_back("tensor '" + e.name + "' is " + std::string(c10::toString(g.scalar_type())) + ", not floating point");
      continue;
    }
    const auto bad = (~at::isfinite(g)).sum().item<std::int64_t>();
    if (bad > 0) problems.push_back(fmt::format("tensor '{}' has {} non-finite entries (NaN or Inf)", e.name, bad));
  }
  for (const auto& t : got)
    if (!wanted.count(t.name)) problems.push_back("unexpected tensor '" + t.name + "' (misnamed, or not trainable)");
  return problems;
}

std::string dtype_problem(const TensorList& got, c10::ScalarType dtype) {
  std::vector<std::string> wrong;
  for (const auto& t : got)
    if (t.tensor.scalar_type() != dtype) wrong.push_back("'" + t.name + "' is " + hf_dtype_name(t.tensor.scalar_type()));
  if (wrong.empty()) return {};
  constexpr std::size_t kNamed = 3;  // a whole model in the wrong dtype is one message, not one per tensor
  std::string named;
  for (std::size_t i = 0; i < std::min(kNamed, wrong.size()); ++i) named += (i ? ", " : "") + wrong[i];
  if (wrong.size() > kNamed) named += fmt::format(" and {} more", wrong.size() - kNamed);
  return fmt::format("{} of {} tensor(s) not in the case's dtype {}: {}", wrong.size(), got.size(), hf_dtype_name(dtype),
                     named);
}

namespace {

// What a judge's problems call its inputs.
constexpr const char* kConformOracle = "the harness's fp64 oracle";
constexpr const char* kConformCandidate = "the implementation's gradients";

std::string joined(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& p : items) out += (out.empty() ? "" : "; ") + p;
  return out;
}

}  // namespace

ConformVerdict judge_exact(const TensorList& oracle, const TensorList& got, double rtol) {
  ConformVerdict v;
  v.rule = fmt::format("fp64: normwise <= {:.0e} vs the oracle", rtol);
  v.problem = joined(protocol_problems(oracle, got));
  if (!v.problem.empty()) return v;
  const auto cmp = compare_gradients(oracle, got, {kConformOracle, kConformCandidate});
  v.problem = joined(cmp.problems);  // the oracle's non-finite entries (the candidate's are protocol problems above)
  if (!v.problem.empty()) return v;
  if (const auto* w = cmp.worst()) v.worst_tensor = w->name, v.worst = w->normwise_rel;
  v.passed = cmp.passed(rtol);
  return v;
}

ConformVerdict judge_low_precision(const TensorList& oracle, const TensorList& baseline, const TensorList& got,
                                   c10::ScalarType dtype) {
  ConformVerdict v;
  v.rule = fmt::format("{}: l2 beside the run's common scale <= allowance(n) x the baseline's + floor, and the common "
                       "scale <= {:.1f} x the baseline's run error, vs the fp64 oracle (allowance {}x at large n)",
                       dtype_name(dtype), low_precision_noise_scale(dtype) * gaussian_quantile(kLowPrecisionFalseFailure),
                       low_precision_noise_scale(dtype));
  v.problem = joined(protocol_problems(oracle, got));
  if (!v.problem.empty()) return v;
  if (const auto base = protocol_problems(oracle, baseline); !base.empty()) {
    v.problem = "the baseline's gradients: " + joined(base);
    return v;
  }
  const auto verdict = low_precision_rule(compare_gradients(oracle, baseline, {kConformOracle, "the baseline's gradients"}),
                                          compare_gradients(oracle, got, {kConformOracle, kConformCandidate}), dtype);
  v.problem = joined(verdict.problems);  // the oracle's non-finite entries
  if (!v.problem.empty()) return v;
  v.worst = verdict.worst_ratio;
  v.worst_tensor = verdict.worst_tensor;
  v.passed = verdict.passed();
  return v;
}

}  // namespace sbp

namespace sbp {

ConformVerdict judge_rl_step(const RlStepCase& c, const RlStepResult& oracle, const TensorList& got, double rtol) {
  ConformVerdict v;
  v.rule = fmt::format("fp64 RL step: every optimizer step's gradient normwise <= {:.0e} vs the oracle; advantages and "
                       "token_logps <= {:.0e}, completion_mask exact, when returned", rtol, rtol);
  TensorList gradients;
  for (std::size_t k = 0; k < oracle.gradients.size(); ++k)
    for (const auto& g : oracle.gradients[k]) gradients.push_back({fmt::format("step{}/{}", k + 1, g.name), g.tensor});
  // The trainer's own view of the generation batch, each judged when returned, in the order the trainer makes them.
  const std::vector<std::pair<std::string, at::Tensor>> stages = {{"advantages", oracle.advantages},
                                                                  {"completion_mask", oracle.completion_mask},
                                                                  {"token_logps", oracle.token_logps}};
  auto expected = gradients;
  std::map<std::string, at::Tensor> returned;
  for (const auto& t : got) returned[t.name] = t.tensor;
  bool stages_returned = false;
  for (const auto& [name, tensor] : stages)
    if (returned.count(name)) expected.push_back({name, tensor}), stages_returned = true;
  v.problem = joined(protocol_problems(expected, got));
  if (!v.problem.empty()) {
    if (std::none_of(got.begin(), got.end(), [](const NamedTensor& t) { return t.name.rfind("step", 0) == 0; }))
      v.problem += fmt::format("; an rl_step case returns every optimizer step's gradient as step{{k}}/<HF name> ({} "
                               "optimizer step(s) here)", oracle.gradients.size());
    return v;
  }
  // Where the loss scores a token: where the generation-time log-probs matter (a trainer may compute the others under
  // another attention mask: TRL masks a truncated completion's attention under mask_truncated_completions).
  const auto scored = oracle.completion_mask.to(at::kBool);
  std::string first_stage, stage_words;
  double first_error = 0;
  for (const auto& [name, tensor] : stages) {
    if (!returned.count(name) || !first_stage.empty()) continue;
    const auto mine = tensor.to(at::kDouble), theirs = returned.at(name).to(at::kDouble);
    double error = 0;
    std::string words;
    if (name == "completion_mask") {
      const auto wrong = (mine != theirs).sum().item<std::int64_t>();
      error = double(wrong) / double(mine.numel());
      if (wrong > 0) {
        const auto at = (mine != theirs).nonzero()[0];
        words = fmt::format("completion_mask differs at {} of {} entries (first: row {} token {}: the oracle {}, the "
                            "trainer {}): the EOS mask (the first EOS scored, nothing after it) or truncation "
                            "(mask_truncated_completions)", wrong, mine.numel(), at[0].item<std::int64_t>(),
                            at[1].item<std::int64_t>(), mine.index({at[0], at[1]}).item<double>(),
                            theirs.index({at[0], at[1]}).item<double>());
      }
    } else {
      const auto where = name == "token_logps" ? scored : at::ones_like(mine, at::kBool);
      const auto a = mine.masked_select(where), b = theirs.masked_select(where);
      error = ((a - b).abs().max() / at::clamp_min(a.abs().max(), 1e-300)).item<double>();
      if (std::isnan(error)) error = std::numeric_limits<double>::infinity();
      if (!(error <= rtol))
        words = name == "advantages"
                    ? fmt::format("advantages {:.1e} off (normwise): the rewards' weights, or scale_rewards' "
                                  "normalisation ({}: over the {}; std Bessel-corrected, + 1e-4)", error,
                                  c.settings.scale_rewards, c.settings.scale_rewards == "batch" ? "whole generation "
                                  "batch's std, each group's mean" : c.settings.scale_rewards == "none" ? "group's "
                                  "mean only" : "prompt's group of num_generations")
                    : fmt::format("token_logps {:.1e} off (normwise, on the scored tokens): the log-probs at "
                                  "generation time: pads attended (the attention mask of left-padded prompts), "
                                  "positions shifted by the padding, or the temperature", error);
    }
    if (!words.empty()) first_stage = name, first_error = error, stage_words = words;
  }
  TensorList got_gradients;
  for (const auto& t : got)
    if (t.name.rfind("step", 0) == 0) got_gradients.push_back(t);
  const auto cmp = compare_gradients(gradients, got_gradients, {kConformOracle, kConformCandidate});
  v.problem = joined(cmp.problems);
  if (!v.problem.empty()) return v;
  const auto* w = cmp.worst();
  const bool gradients_pass = cmp.passed(rtol);
  if (!first_stage.empty()) {
    v.worst_tensor = first_stage, v.worst = first_error;
    v.hint = fmt::format("the trainer departs first at {}; ", stage_words) +
             (w ? fmt::format("its gradients then at {} ({:.1e} normwise)", w->name, w->normwise_rel) : "");
    return v;
  }
  if (w) v.worst_tensor = w->name, v.worst = w->normwise_rel;
  v.passed = gradients_pass;
  if (!gradients_pass && w) {
    // The first optimizer step whose gradient is off: a later one alone is what happens between optimizer steps.
    std::size_t first_step = 0;
    for (const auto& t : cmp.tensors)
      if (!(t.normwise_rel <= rtol)) {
        first_step = std::size_t(std::stoul(t.name.substr(4, t.name.find('/') - 4)));
        break;
      }
    v.hint = first_step > 1
                 ? fmt::format("step 1 agrees, step {} departs: what the trainer carries between optimizer steps "
                               "(old_logps from the wrong pass: the current weights' instead of generation time's; "
                               "the update itself, e.g. clipping or the learning rate)", first_step)
                 : fmt::format("the first optimizer step departs with the stages{} agreeing: the loss's aggregation "
                               "(loss_type {}'s normaliser: per micro-batch or over the generation batch; "
                               "gradient_accumulation_steps), the micro-batch layout (the case's micro_batches, in "
                               "order), the clipped objective or the KL term", stages_returned ? "" : " not returned, or",
                               c.settings.loss_type);
  }
  return v;
}

}  // namespace sbp

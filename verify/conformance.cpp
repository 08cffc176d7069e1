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
#include "verify/conform_rl.h"
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
      // Packed GRPO (verl's remove-padding layout): each sequence one completion with its own advantage, in groups of
      // 4 sequences across rows. The 21-token completion at [2, 23) crosses the head tiles at 8 and 16 and the layer
      // tile at 16; the 2-token sequences have a completion of one token; rows full (GRPO's packs have no padding);
      // prompts drawn per sequence. The sequence ratio and grpo's mean are per sequence, so a ratio, an advantage or
      // a mean per row (per pack) fails.
      packed_case(make_case("grpo-packed", "GRPO on packed rows (each sequence one completion, its own advantage): "
                            "per-sequence means and importance, a KL term, a completion across tile boundaries, "
                            "completions of one token", tiny, c10::kDouble,
                            "grpo:beta=0.04,loss_type=grpo,importance=sequence", {3, 37, 0.0, 0.0, 15, 4}),
                  {{2, 21, 14}, {17, 2, 18}, {11, 26}}),
      // Two packs with different boundaries in one micro-batch, then one: grpo's mean over the step's 7 sequences,
      // not each micro-batch's; Qwen2-style.
      micro(packed_case(make_case("grpo-packed-micro2", "GRPO over 2 micro-batches of packed rows (2 packs with "
                                  "different boundaries, then 1), MHA, bias, untied lm_head",
                                  variant(true, false, true, false), c10::kDouble, "grpo:loss_type=grpo",
                                  {3, 37, 0.0, 0.0, 16, 3}),
                        {{12, 25}, {2, 2, 33}, {30, 7}}),
            {{0, 2}, {1}}),
  };
}

// A pull request's matrix (issue #47): quick's cases a CI cannot skip, ~1 minute for HF on 2 cores. T = 37 runs
// several tiles of the suggested chunks (3 layer, 5 head, the last short) over a ragged batch; fp64 at 1e-10 for each
// objective, both model families and tied/untied heads; LoRA; one low-precision case (bf16: the rule runs the
// baseline too); one micro-batch step; packed rows of SFT and of GRPO. Left to quick/full: T = 2, fp32, the sequence-parallel
// cases, the other GRPO loss types and importance levels, temperature, the architecture grid, LoRA per objective.
std::vector<ConformCase> ci_cases() {
  std::vector<ConformCase> out;
  for (auto& c : quick_cases())
    for (const auto* name : {"sft-gqa-qknorm-tied", "sft-mha-bias-untied", "grpo-beta0.04-grpo-token",
                             "dpo-3pairs-ls0.1", "sft-lora", "sft-bf16", "sft-micro3", "sft-packed", "grpo-packed"})
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
  // Packed GRPO under LoRA (the reference the base with adapters disabled, on packed rows) with dr_grpo's count of
  // sequences; GRPO rows are full.
  cases.push_back(packed_case(make_case("grpo-packed-lora-dr_grpo", "GRPO dr_grpo on packed rows under LoRA, a KL "
                                        "term against the base model", tiny, c10::kDouble,
                                        "grpo:beta=0.04,loss_type=dr_grpo", {3, 37, 0.0, 0.0, seed++, 3}, kLora),
                              {{4, 21, 12}, {2, 30, 5}, {16, 2, 2, 17}}));
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
  // Packed GRPO where tiling happens: the 130-token completion at [2, 132) crosses the tiles at 64 and 128, the
  // 250-token one four of them; 2-token sequences (a completion of one token); per-sequence means and ratio.
  cases.push_back(tiled(packed_case(make_case("grpo-qwen3-T300-packed", "GRPO on packed rows (each sequence one "
                                              "completion, its own advantage), per-sequence means and importance, "
                                              "a KL term, T = 300", qwen3, c10::kDouble,
                                              "grpo:beta=0.04,loss_type=grpo,importance=sequence",
                                              {3, 300, 0.0, 0.0, 34, 3}),
                                    {{2, 130, 100, 68}, {250, 2, 48}, {37, 263}})));
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

double number(const Spec& spec, const std::string& key) { return std::stod(spec.options.at(key)); }

}  // namespace

const char* parallel_name(ConformParallel p) { return p == ConformParallel::sequence ? "sequence" : "data"; }

const char* conform_kind(const ConformCase& c) { return c.rl_step ? "rl_step" : "batch"; }

const std::vector<std::string>& conform_case_sets() {
  static const std::vector<std::string> sets = {"ci", "quick", "full", "survey", "rl", "rl-verl"};
  return sets;
}

std::string conform_case_id(const ConformCase& c) { return c.name + "-" + dtype_name(c.dtype); }

std::vector<ConformCase> conform_cases(const std::string& which) {
  if (which == "quick") return quick_cases();
  if (which == "ci") return ci_cases();
  if (which == "full") return full_cases();
  if (which == "survey") return survey_cases();
  if (which == "rl") return rl_cases(variant(false, true, false, true));
  if (which == "rl-verl") return rl_verl_cases(variant(false, true, false, true));
  if (!std::filesystem::exists(which)) {
    const auto nearest = nearest_name(which, conform_case_sets());
    throw InputError("--cases " + which + ": neither a case set (ci, quick, full, survey, rl, rl-verl) nor a file" +
                                (nearest.empty() ? "" : " (did you mean " + nearest + "?)"));
  }
  return file_cases(which);
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
    add_rl_step_case_json(c, out);
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

std::string join_problems(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& p : items) out += (out.empty() ? "" : "; ") + p;
  return out;
}

ConformVerdict judge_exact(const TensorList& oracle, const TensorList& got, double rtol) {
  ConformVerdict v;
  v.rule = fmt::format("fp64: normwise <= {:.0e} vs the oracle", rtol);
  v.problem = join_problems(protocol_problems(oracle, got));
  if (!v.problem.empty()) return v;
  const auto cmp = compare_gradients(oracle, got, {kConformOracle, kConformCandidate});
  v.problem = join_problems(cmp.problems);  // the oracle's non-finite entries (the candidate's are protocol problems above)
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
  v.problem = join_problems(protocol_problems(oracle, got));
  if (!v.problem.empty()) return v;
  if (const auto base = protocol_problems(oracle, baseline); !base.empty()) {
    v.problem = "the baseline's gradients: " + join_problems(base);
    return v;
  }
  const auto verdict = low_precision_rule(compare_gradients(oracle, baseline, {kConformOracle, "the baseline's gradients"}),
                                          compare_gradients(oracle, got, {kConformOracle, kConformCandidate}), dtype);
  v.problem = join_problems(verdict.problems);  // the oracle's non-finite entries
  if (!v.problem.empty()) return v;
  v.worst = verdict.worst_ratio;
  v.worst_tensor = verdict.worst_tensor;
  v.passed = verdict.passed();
  return v;
}

}  // namespace sbp

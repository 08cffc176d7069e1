// Conformance of external implementations (ARCHITECTURE.md §13, issue #21): the case matrix `streambp conform` runs another
// implementation over, the protocol's case.json, and the judgement of the gradients it returns. Running the
// implementation (a child process) is the command's job (experiments/cmd_conform.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <nlohmann/json_fwd.hpp>

#include "core/io/safetensors.h"
#include "core/model/config.h"
#include "core/objectives/batch.h"
#include "core/objectives/rl_step.h"

namespace sbp {

class Objective;
struct RlStepResult;

constexpr const char* kConformProtocol = "streambp-conform/1";

// How a case's ranks split the work (case.json "parallel", issue #45): data (each rank its rows of the batch; what a
// one-process case says too) or sequence (each rank its positions of every row, the library splitting the sequence
// and aggregating the loss its own way). Either way the ranks together return the whole batch's gradient.
enum class ConformParallel { data, sequence };
const char* parallel_name(ConformParallel p);

struct ConformCase {
  std::string name, description;  // what the case exposes
  ModelConfig config;
  c10::ScalarType dtype = c10::kDouble;
  std::string objective = "sft";  // harness spec (case.json carries TRL's names)
  std::string lora;               // LoRA spec; empty: full fine-tuning
  RandomBatchOptions batch;
  std::int64_t layer_chunk = 16, head_chunk = 8;  // suggestions to a chunked implementation (tile sizes too)
  // Processes the implementation runs itself (a distributed one: its ranks split the batch or the sequence and
  // together return the whole batch's gradients, judged against one process like every case). 1: one process.
  int ranks = 1;
  ConformParallel parallel = ConformParallel::data;  // sequence needs ranks >= 2
  // The optimizer step's micro-batches (issue #45): each the batch's rows it holds (DPO: its chosen rows, then their
  // rejected rows in the same order). Empty: the step is the whole batch in one pass.
  std::vector<std::vector<std::int64_t>> micro_batches;
  // Rows packed with several sequences each (issue #59; verify/conform_packed.h): each row's sequence lengths; SFT: a
  // row shorter than T padded after its last sequence; GRPO: each sequence one completion with its own advantage,
  // rows full. Empty: one sequence per row (batch's pad_fraction).
  std::vector<std::vector<std::int64_t>> pack_lengths;
  // A whole RL trainer step (issue #60, docs/rl-steps.md): the case is the generation batch (prompts, raw
  // completions, rewards, TRL's settings, the micro-batch layout) and the model the policy at generation time; the
  // implementation runs its trainer from there and returns the gradient at every optimizer step. case.json's `kind`
  // is then "rl_step" (else "batch"), `objective` the GRPO objective of its settings, and `batch` unused.
  std::optional<RlStepCase> rl_step;
};

// case.json's "kind": "batch" (a loss on a batch: every case before issue #60) or "rl_step".
const char* conform_kind(const ConformCase& c);

// What a step of several micro-batches is judged against. union_batch: the promise of accumulation, the objective
// over the union of the micro-batches normalised by the step's totals (HF/TRL's num_items_in_batch). micro_means: the
// mean over micro-batches of each one's own loss (a library that documents it declares it: conform --accumulation).
enum class Accumulation { union_batch, micro_means };
Accumulation parse_accumulation(const std::string& name);  // "union" or "micro-means"; throws naming the flag
std::string accumulation_name(Accumulation a);
std::string accumulation_description(Accumulation a);

// What is wrong with a case's micro-batches for a batch of `rows` rows and `objective` (its rows not each exactly
// once, an empty micro-batch, a DPO pair split); empty when fine or when there are none.
std::string micro_batches_problem(const ConformCase& c, std::int64_t rows);
// The case's micro-batches as batches (Batch::select_rows); the whole batch when it has none.
std::vector<Batch> micro_batch_split(const ConformCase& c, const Batch& batch);
// result.json's "micro_batches" (how many micro-batches the implementation's step ran) against the case's: empty
// when they agree, else what is wrong (missing, not an integer, another count).
std::string result_micro_batches_problem(const std::string& text, std::size_t expected);

// "rl": whole RL steps (rl_step cases only: each a generation batch of prompts of uneven lengths, completions with an
// EOS inside, after their end or missing (truncated), weighted rewards, and TRL's settings: several loss_types,
// scale_rewards, steps_per_generation > 1, num_iterations > 1, a micro-batch layout that mixes groups); "rl-verl": the
// same cases declared as verl documents its actor update (loss_agg_mode, its advantages' epsilon; conform_rl.h).
// "ci" (9 of quick's cases: a pull request's minute for HF), "quick" (a few seconds of harness work, every kind of
// case once), "full" (the whole matrix), "survey" (sequences
// longer than the suggested tiles, so that a tiled implementation runs several; Qwen3- and Llama-shaped models; 2
// ranks), or a JSON file: an array of {"name", "preset", "dtype", "objective", "lora", "batch", "seq", "pad_fraction",
// "prompt_fraction", "group", "seed", "layer_chunk", "head_chunk", and optionally "qk_norm", "attention_bias",
// "tie_word_embeddings", "num_key_value_heads", "ranks", "parallel" (data or sequence), "micro_batches",
// "pack_lengths" (SFT's or GRPO's packed rows: each row's sequence lengths; "batch" its row count, "seq" its longest
// row by default; GRPO's rows all full)} (a missing
// key takes the quick matrix's default). Throws naming the file and key, or naming the case sets when `which` is
// neither a set nor a file.
std::vector<ConformCase> conform_cases(const std::string& which);
// The built-in sets' names: ci, quick, full, survey, rl, rl-verl. A name is one case in every set that holds it.
const std::vector<std::string>& conform_case_sets();
// A case's id in reports (conform's JUnit rows, pytest's items): its name and dtype, "sft-lora-fp64".
std::string conform_case_id(const ConformCase& c);

// result.json's "loss". A non-finite loss written as Python's json.dumps writes it (a bare NaN, Infinity or
// -Infinity, which JSON does not have) is read as that number. Throws nlohmann::json::exception when malformed.
double result_loss(const std::string& text);
// result.json's optional "cpu_seconds": CPU time the implementation spent outside the process conform started (a warm
// worker forked by another process, streambp_conform.warm), which conform adds to what it measured; 0 when absent,
// not a finite non-negative number, or the file is malformed (the run's verdict comes from result_loss).
double result_worker_cpu_seconds(const std::string& text);

// result.json's optional "python" and "torch_version": the interpreter and torch the implementation ran with (the
// adapter package writes them), recorded beside the harness's own; empty when absent or malformed.
struct ImplementationProvenance {
  std::string python, torch_version;
};
ImplementationProvenance result_provenance(const std::string& text);

// The protocol's case.json for a case and its (canonical) objective: TRL's parameter names and values.
nlohmann::json case_json(const ConformCase& c, const Objective& objective);

struct ConformVerdict {
  bool passed = false;
  std::string rule;          // the bar in words: fp64's normwise 1e-10, or the low-precision rule (grad_compare.h)
  std::string worst_tensor;
  double worst = 0;          // fp64: the worst normwise relative error; low precision: the worst ratio to the bar
  std::string problem;       // protocol failures (missing, extra, misshapen or non-finite tensors, unreadable files)
  std::string hint;          // what conform found the error to be (a diagnosis it ran), beside the usual causes
};

// What an implementation's gradients must be before any number is compared: every expected tensor exactly once
// under its name, of its shape, every entry finite. Returns the problems, each naming the tensor.
std::vector<std::string> protocol_problems(const TensorList& expected, const TensorList& got);
// The protocol's dtype: every returned tensor in the case's model dtype. A gradient kept in another one (an fp32
// master gradient in a bf16 case, an fp32 result of an fp64 case) would be judged as if it were the dtype's, so it is a
// protocol problem naming the tensors, not a verdict on their values. Empty when all match.
std::string dtype_problem(const TensorList& got, c10::ScalarType dtype);
// What a judge's problems call its inputs, and its problems in one line ("; " between them).
inline constexpr const char* kConformOracle = "the harness's fp64 oracle";
inline constexpr const char* kConformCandidate = "the implementation's gradients";
std::string join_problems(const std::vector<std::string>& items);
// fp64: every tensor within `rtol` (normwise, ARCHITECTURE.md §8) of the oracle.
ConformVerdict judge_exact(const TensorList& oracle, const TensorList& got, double rtol);
// fp32/bf16: every tensor's l2 error against the fp64 oracle within the low-precision rule's allowance x the
// baseline's (the same dtype) plus the rule's floor (low_precision_rule, verify/grad_compare.h): the same rule as the
// tests and `verify --gate`.
ConformVerdict judge_low_precision(const TensorList& oracle, const TensorList& baseline, const TensorList& got,
                                   c10::ScalarType dtype);

// An rl_step case's returned tensors against the oracle's step (verify/rl_step_oracle.h): every optimizer step's
// gradient as "step{k}/<HF name>" (required, exactly those), and, when returned (optional, each judged when there),
// the trainer's own view of the generation batch in the case's row order: `advantages` [N], `completion_mask`
// [N, max_completion_length] (1 where the loss scores a token) and `token_logps` [N, max_completion_length] (the
// generation-time log-prob of each completion token; compared where the loss scores it, the oracle's completion_mask). A stage that departs from the oracle is named first, in the trainer's order (advantages, the mask,
// the log-probs, then the gradients): the verdict's worst tensor is where the trainer went wrong first, its hint
// what that usually is and how the gradients came out.
ConformVerdict judge_rl_step(const RlStepCase& c, const RlStepResult& oracle, const TensorList& got, double rtol);

}  // namespace sbp

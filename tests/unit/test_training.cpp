// Training is exact (issue #19): every method follows standard BP's trajectory over optimizer steps in fp64, and K
// micro-batches of B are one step of K*B. The outside oracles (torch.optim.AdamW, HF) are tests/oracle/optimizer_oracle.py
// and tests/oracle/train_oracle.py; this file compares the methods with each other through the Trainer.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "baselines/methods.h"
#include "core/model/lora.h"
#include "core/methods/memory_model.h"
#include "core/training/training_memory.h"
#include "core/objectives/sft.h"
#include "core/model/model.h"
#include "core/training/trainer.h"
#include "tests/support/test_support.h"
#include "experiments/batches.h"
#include "experiments/measure.h"
#include "profiler/cpu_meter.h"
#include "verify/grad_compare.h"

namespace {

using sbp::Batch;

struct TrainingCase {
  std::string objective, lora;  // lora "": full fine-tuning
  std::int64_t batch_size = 2, seq_len = 23, group = 0;
  double pad_fraction = 0.3;
};

struct Trajectory {
  std::vector<double> losses;
  sbp::TensorList params;  // the trainable tensors after the last step (copies)
};

sbp::TrainOptions training_options(std::int64_t steps, std::int64_t grad_accum) {
  sbp::TrainOptions o;
  o.optimizer = sbp::parse_optimizer_spec("adamw:lr=2e-3,weight_decay=0.1");
  o.schedule = sbp::parse_lr_schedule("cosine,warmup=3");
  o.total_steps = steps;
  o.grad_accum = grad_accum;
  o.clip_grad_norm = 0.5;  // active: tiny's gradient norms are ~1
  return o;
}

std::unique_ptr<sbp::Model> training_model(const TrainingCase& k) {
  auto model = std::make_unique<sbp::Model>(sbp::test::tiny_config(), at::kDouble, 11);
  if (!k.lora.empty()) model->add_lora(sbp::parse_lora_spec(k.lora), 12);
  return model;
}

// One global batch per step, drawn (with the log-probs GRPO/DPO need) from the initial model, so that every method
// trains on the same tensors.
std::vector<Batch> training_batches(const TrainingCase& k, int steps) {
  auto model = training_model(k);
  auto objective = sbp::make_objective(k.objective);
  std::vector<Batch> out;
  for (int s = 0; s < steps; ++s)
    out.push_back(sbp::test::objective_batch(*model, *objective,
                                             {k.batch_size, k.seq_len, k.pad_fraction, 0.2, 100 + std::uint64_t(s), k.group}));
  return out;
}

Trajectory train(const TrainingCase& k, const std::string& method_spec, const std::vector<Batch>& batches,
                 std::int64_t grad_accum = 1) {
  auto model = training_model(k);
  auto method = sbp::make_method(method_spec);
  auto objective = sbp::make_objective(k.objective);
  sbp::Trainer trainer(*model, *method, *objective, training_options(std::int64_t(batches.size()), grad_accum));
  Trajectory t;
  for (const auto& b : batches) t.losses.push_back(trainer.step(b).loss);
  for (const auto& p : model->trainable()) t.params.push_back({p.name, p.tensor.detach().clone()});
  return t;
}

double trajectory_error(const Trajectory& ref, const Trajectory& other) {
  return sbp::test::trajectory_difference(ref.losses, ref.params, other.losses, other.params);
}

const std::vector<TrainingCase>& training_cases() {
  static const std::vector<TrainingCase> all = {
      {"sft", ""},
      {"sft", "rank=4,alpha=8"},
      {"grpo:beta=0.04,loss_type=grpo", "", 4, 23, 2},
      {"grpo:loss_type=dapo,importance=sequence", "rank=4,alpha=8", 4, 23, 2},
      {"dpo:beta=0.1,label_smoothing=0.1", ""},
      {"dpo:beta=0.1", "rank=4,alpha=8"},
  };
  return all;
}

}  // namespace

TEST_CASE("every method trains along standard BP's trajectory in fp64 (20 AdamW steps, clipping, cosine schedule)",
          "[training][exactness][trajectory]") {
  constexpr int kSteps = 20;
  double worst = 0;
  for (const auto& k : training_cases()) {
    const auto batches = training_batches(k, kSteps);
    const auto reference = train(k, "standard", batches);
    for (const auto& spec : sbp::typical_method_specs(k.seq_len)) {
      if (spec == "standard") continue;  // the reference
      const double err = trajectory_error(reference, train(k, spec, batches));
      INFO(k.objective << " lora=" << k.lora << " " << spec << ": largest relative difference " << err);
      CHECK(err <= 1e-10);
      worst = std::max(worst, err);
    }
  }
  WARN("largest relative difference of losses and final tensors over 6 cases x 3 methods x 20 steps: " << worst);
}

TEST_CASE("K micro-batches of B are one optimizer step of K*B in fp64, for every objective", "[training][exactness]") {
  for (auto k : training_cases()) {
    k.batch_size = 8;  // 4 micro-batches of 2 rows (DPO: of 1 pair), with rows of different target counts
    k.group = 0;
    const auto batches = training_batches(k, 3);
    for (const std::string spec : {"standard", "streambp:layer_chunk=5,head_chunk=7"}) {
      const double err = trajectory_error(train(k, spec, batches, 1), train(k, spec, batches, 4));
      INFO(k.objective << " lora=" << k.lora << " " << spec << ": 4 x B=2 against B=8, relative difference " << err);
      CHECK(err <= 1e-12);
    }
  }
}

TEST_CASE("negative control: micro-batches normalised by their own counts are not one step of K*B",
          "[training][negative-control]") {
  // What a trainer without the step's totals does (HF's loss averaged per micro-batch, then divided by K): with rows
  // of different target counts the gradient is a different weighting of the same tokens.
  TrainingCase k{"sft", ""};
  k.batch_size = 8;
  const auto batches = training_batches(k, 3);
  const auto reference = train(k, "standard", batches, 1);
  auto model = training_model(k);
  auto method = sbp::make_method("standard");
  auto objective = sbp::make_objective(k.objective);
  const auto o = training_options(3, 4);
  sbp::Optimizer optimizer(model->trainable(), o.optimizer);
  Trajectory faulty;
  for (const auto& b : batches) {
    double loss = 0;
    const auto micro = objective->split(b, 4, "batch");
    for (std::size_t i = 0; i < micro.size(); ++i)
      loss += method->step(*model, *objective, micro[i], {.accumulate = i > 0}).loss / 4;
    std::vector<at::Tensor> params;
    for (const auto& p : model->trainable()) {
      p.tensor.mutable_grad().div_(4);
      params.push_back(p.tensor);
    }
    sbp::clip_grad_norm(params, o.clip_grad_norm);
    optimizer.step(sbp::lr_at(o.schedule, o.optimizer.lr, optimizer.steps_taken(), o.total_steps));
    faulty.losses.push_back(loss);
  }
  for (const auto& p : model->trainable()) faulty.params.push_back({p.name, p.tensor.detach().clone()});
  const double err = trajectory_error(reference, faulty);
  INFO("per-micro-batch normalisation: relative difference " << err);
  CHECK(err > 1e-6);
}

TEST_CASE("the memory models of training steps match the measured peaks within 3 percent",
          "[training][meter][memory-model]") {
  // A training step's peak is its BP peak with the optimizer's states beside it, or the update's moment (weights,
  // gradients, states and the update's temporaries), whichever is larger: both kinds on this grid (V = 4096 at
  // T = 16, the update; V = 4096 at T = 128 and V = 512 at T = 512, the BP), AdamW (every method) and SGD with
  // momentum, fp32, bf16 (states in bf16, the paper's pure bf16), mixed (fp32 masters and states), full and LoRA.
  struct Shape {
    std::int64_t vocab, T;
  };
  struct Precision {
    c10::ScalarType dtype;
    bool mixed;
  };
  auto& meter = sbp::CpuMemoryMeter::install();
  struct Run {
    std::string optimizer, spec;
  };
  const std::vector<Run> runs = {{"adamw:lr=1e-3,weight_decay=0.1", "standard"},
                                 {"adamw:lr=1e-3,weight_decay=0.1", "checkpoint"},
                                 {"adamw:lr=1e-3,weight_decay=0.1", "mst:mini_seq=4"},
                                 {"adamw:lr=1e-3,weight_decay=0.1", "streambp:layer_chunk=128,head_chunk=128"},
                                 {"sgd:lr=1e-2,momentum=0.9", "streambp:layer_chunk=128,head_chunk=128"}};
  int update_moments = 0;
  for (const auto& shape : {Shape{4096, 16}, Shape{4096, 128}, Shape{512, 512}})
    for (const auto& precision : {Precision{at::kFloat, false}, Precision{at::kBFloat16, false}, Precision{at::kBFloat16, true}})
      for (const std::string lora : {"", "rank=8"})
        for (const auto& [optimizer, spec] : runs) {
            auto config = sbp::test::tiny_config();
            config.vocab_size = shape.vocab;
            sbp::Model model(config, precision.dtype, 91);
            if (!lora.empty()) model.add_lora(sbp::parse_lora_spec(lora), 93);
            if (precision.mixed) model.set_grad_dtype(at::kFloat);
            const auto batch = sbp::random_sft_batch(config, {2, shape.T, 0.0, 0.1, 92});
            auto method = sbp::make_method(spec);
            sbp::SftObjective objective;
            auto options = training_options(4, 1);
            options.optimizer = sbp::parse_optimizer_spec(optimizer);
            sbp::Trainer trainer(model, *method, objective, options);
            auto workload = sbp::make_workload(model, objective.prepare(batch, config), batch);
            trainer.add_optimizer_memory(workload);
            const auto estimate = sbp::training_memory(*method, workload);
            const auto weights = sbp::model_weight_bytes(model);
            std::int64_t peak = 0;
            // The first update of SGD allocates less (its buffer is the gradient's clone); bf16: the peak of several
            // steps (the attention backward's per-worker scratch, see test_meter.cpp).
            const int steps = precision.dtype == at::kBFloat16 ? 4 : 2;
            for (int s = 0; s < steps; ++s) {
              model.zero_grad();
              meter.reset_peak();
              // Held before the step but not the model's: the batch and what else the test keeps.
              const auto held = meter.current_bytes() - weights - workload.optimizer_state_bytes;
              trainer.step(batch);
              if (s > 0) peak = std::max(peak, meter.peak_bytes() - held);
            }
            const double ratio = double(peak) / double(estimate.total_bytes());
            INFO((precision.mixed ? "bf16-mixed" : c10::toString(precision.dtype)) << " V=" << shape.vocab << " T="
                 << shape.T << " " << spec << " lora=" << lora << " " << optimizer << ": measured " << peak
                 << ", analytic " << estimate.total_bytes() << " at " << estimate.moment << ", ratio " << ratio);
            CHECK(std::abs(ratio - 1.0) <= 0.03);
            update_moments += estimate.moment == "optimizer step";
          }
  INFO("runs whose peak is the optimizer's update");
  CHECK(update_moments > 0);
}

namespace {

// The gradient-ready events of one step: each group's gradients as they were at its event.
struct Event {
  std::string name;
  std::vector<at::Tensor> tensors, grads;  // grads: copies taken at the event (undefined where none existed)
};

// Every trainable tensor in exactly one event, every event's gradients equal (bitwise) to the final ones: nothing
// changed a group's gradient after its event. Returns what is wrong, or "".
std::string check_events(const std::vector<Event>& events, const sbp::Model& model) {
  std::map<const void*, int> seen;
  for (const auto& e : events)
    for (std::size_t i = 0; i < e.tensors.size(); ++i) {
      seen[e.tensors[i].unsafeGetTensorImpl()] += 1;
      const auto& now = e.tensors[i].grad();
      if (!e.grads[i].defined()) return e.name + ": a tensor without a gradient at its event";
      if (!now.defined() || !at::equal(now, e.grads[i])) return e.name + ": a gradient changed after its event";
    }
  for (const auto& p : model.trainable())
    if (seen[p.tensor.unsafeGetTensorImpl()] != 1)
      return p.name + " is in " + std::to_string(seen[p.tensor.unsafeGetTensorImpl()]) + " events";
  return "";
}

}  // namespace

TEST_CASE("every method fires one gradient-ready event per group, when its gradients are final",
          "[training][gradient-ready]") {
  for (const std::string lora : {"", "rank=4,alpha=8"})
    for (const bool tied : {true, false})
      for (const auto& spec : sbp::typical_method_specs(23)) {
        auto config = sbp::test::tiny_config();
        config.tie_word_embeddings = tied;
        sbp::Model model(config, at::kDouble, 11);
        if (!lora.empty()) model.add_lora(sbp::parse_lora_spec(lora), 12);
        auto method = sbp::make_method(spec);
        auto objective = sbp::make_objective("sft");
        const auto batch = sbp::random_sft_batch(config, {2, 23, 0.3, 0.2, 5});
        std::vector<Event> events;
        auto recording = method->on_gradient_ready([&](const sbp::GradientGroup& g) {
          Event e{g.name, g.tensors, {}};
          for (const auto& t : g.tensors) e.grads.push_back(t.grad().defined() ? t.grad().clone() : at::Tensor());
          events.push_back(std::move(e));
        });
        method->step(model, *objective, batch);
        INFO(spec << " lora=" << lora << " tied=" << tied);
        CHECK(check_events(events, model) == "");
        // The order a distributed reduction overlaps with: the head, the layers from the last, the embedding.
        std::vector<std::string> names, expected;
        for (const auto& e : events) names.push_back(e.name);
        if (lora.empty()) expected.push_back("head");
        for (int l = config.num_hidden_layers - 1; l >= 0; --l) expected.push_back("layer." + std::to_string(l));
        if (lora.empty()) expected.push_back("embedding");
        CHECK(names == expected);

        // Negative control: a second micro-batch accumulating into the same gradients changes them after the first
        // one's events, and the check sees it.
        if (spec == "standard" && lora.empty() && tied) {
          auto first = events;
          recording.reset();
          method->step(model, *objective, sbp::random_sft_batch(config, {2, 23, 0.3, 0.2, 6}), {.accumulate = true});
          CHECK(check_events(first, model) != "");
        }
      }
}

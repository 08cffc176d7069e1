#include "experiments/step_progress.h"

#include <unistd.h>

#include <fmt/format.h>

namespace sbp {

StepProgress::StepProgress(std::string label, int layers, std::FILE* out, double delay_seconds)
    : label_(std::move(label)),
      layers_(layers),
      out_(out),
      rewrite_(isatty(fileno(out)) != 0),
      start_(std::chrono::steady_clock::now()),
      delay_(delay_seconds),
      next_(phase_listener()) {
  set_phase_listener(this);
}

StepProgress::~StepProgress() {
  set_phase_listener(next_);
  if (printed_ && rewrite_) {
    std::fputs("\r\033[K", out_);  // the summary follows on a clean line
    std::fflush(out_);
  }
}

void StepProgress::enter_phase(const std::string& name) {
  if (next_) next_->enter_phase(name);
  open_.push_back(name);
  // Without a terminal, one line per outermost phase outside the layers (forward, head, embedding ...), once in a
  // row: a layer's own phases (kv_recompute, layer, kv_path) would be a line each, for every layer.
  if (rewrite_)
    report(false);
  else if (open_.size() == 1 && layer_ < 0 && name != last_phase_line_ && report(true))
    last_phase_line_ = name;
}

void StepProgress::leave_phase(const std::string& name) {
  if (next_) next_->leave_phase(name);
  if (!open_.empty() && open_.back() == name) open_.pop_back();
}

void StepProgress::enter_layer(int layer) {
  if (next_) next_->enter_layer(layer);
  layer_ = layer;
  report(true);
}

void StepProgress::leave_layer(int layer) {
  if (next_) next_->leave_layer(layer);
  layer_ = -1;
}

bool StepProgress::report(bool new_line) {
  const auto elapsed = std::chrono::steady_clock::now() - start_;
  if (elapsed < delay_) return false;
  // "forward, layer 3 of 0-27", "backward, layer 17 of 0-27 (kv_path)", "head": the layer's direction from the
  // forward phase, the phases open inside it in brackets.
  const bool forward = !open_.empty() && open_.front() == "forward";
  std::string where;
  if (layer_ >= 0) {
    std::string inner;
    for (const auto& p : open_)
      if (p != "forward") inner += (inner.empty() ? "" : " > ") + p;
    where = fmt::format("{}, layer {} of 0-{}{}", forward ? "forward" : "backward", layer_, layers_ - 1,
                        inner.empty() ? "" : " (" + inner + ")");
  } else {
    for (const auto& p : open_) where += (where.empty() ? "" : " > ") + p;
  }
  const auto line = fmt::format("progress  {}, {:.1f} s: {}", label_,
                                std::chrono::duration<double>(elapsed).count(), where);
  if (rewrite_)
    fmt::print(out_, "\r{}\033[K", line);
  else if (new_line)
    fmt::print(out_, "{}\n", line);
  else
    return false;
  std::fflush(out_);
  printed_ = true;
  return true;
}

}  // namespace sbp

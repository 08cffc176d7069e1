// Data parallelism, ZeRO stage 0 (DDP), over a Communicator (DESIGN §12). Each rank back-propagates its rows of the
// global batch; the paper's rule: a gradient group (the head, a layer, the embedding) is summed over ranks once, at
// its gradient-ready event of the step's last micro-batch (StreamBP: after the layer's chunk loop has committed its
// sums), never per chunk, so StreamBP communicates exactly what standard BP does. The objective is normalised by the
// global batch's totals (summed over ranks), so the SUM over ranks is the whole batch's gradient: never an average of
// per-rank means, which is wrong whenever ranks hold different numbers of target tokens.
#pragma once

#include "core/methods/method.h"
#include "core/objectives/objective.h"
#include "core/training/communicator.h"

namespace sbp {

class DataParallel {
 public:
  explicit DataParallel(Communicator& communicator) : communicator_(communicator) {}
  virtual ~DataParallel() = default;
  Communicator& communicator() const { return communicator_; }

  // The step's totals over every rank's micro-batches (one all-reduce).
  virtual StepTotals global_totals(const StepTotals& local);
  // Sums one group's gradients over the ranks, in place, as one flat all-reduce (a gradient a rank lacks counts as
  // zeros).
  virtual void reduce(const GradientGroup& group);
  // The step's loss over ranks (each rank's share is already normalised by the global totals).
  double global_loss(double local);

 private:
  Communicator& communicator_;
};

}  // namespace sbp

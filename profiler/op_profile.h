// Where a step's time goes, op by op: ATen's RecordFunction callbacks time every outermost op on each thread (an
// autograd node such as MmBackward0 counts with the ops it calls; an op inside another op is not counted again).
// `streambp run --op-profile FILE` writes the table; it is how the bf16 and head costs in results/README were found.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

namespace sbp {

struct OpTime {
  std::string name;  // "aten::mm", "MmBackward0", ...
  std::int64_t calls = 0;
  double seconds = 0;  // summed wall time of the outermost calls
};

// Active while alive; at most one at a time (it owns a global RecordFunction callback).
class OpProfile {
 public:
  OpProfile();
  ~OpProfile();
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;
  std::vector<OpTime> totals() const;  // by seconds, largest first

  struct State;  // defined in the .cpp (the callbacks reach it)

 private:
  std::unique_ptr<State> state_;
};

// CSV: name,calls,seconds,share (of `total_seconds`; empty when it is not positive).
void write_op_profile_csv(const std::vector<OpTime>& ops, double total_seconds, std::ostream& out);

}  // namespace sbp

// Whether the machine was shared while something was timed (issue #30): the CPU time other processes and the
// hypervisor took, from /proc/stat, against this process's own CPU time. A ratio of two methods' times means what
// it says only on an otherwise idle machine: StreamBP's many small ops suffer most when OpenMP's waiting workers
// compete with another process for the cores (a shared 2-core machine once gave 2.07x checkpointing's time where
// the idle one gives 0.78x).
#pragma once

#include <string>

namespace sbp {

// A reading of the machine's and this process's CPU counters.
struct CpuCounters {
  double wall_seconds = 0;   // steady clock
  double own_seconds = 0;    // this process's CPU time (all threads)
  double busy_seconds = 0;   // every CPU's user + nice + system + irq + softirq time (/proc/stat), this process's too
  double steal_seconds = 0;  // time the hypervisor gave to other guests
  double total_seconds = 0;  // every CPU's time in all states
  double load_average = -1;  // 1-minute load average (-1: unreadable)
  bool readable = false;     // /proc/stat was readable
};
CpuCounters read_cpu_counters();

// What happened between two readings.
struct MachineLoad {
  double other_cores = 0;   // cores' worth of CPU time other processes used, on average
  double steal = 0;         // fraction of all CPU time stolen by the hypervisor
  double own_per_wall = 0;  // this process's CPU seconds per wall second (about the thread count when alone)
  double load_before = -1, load_after = -1;
  bool known = false;       // both readings had /proc/stat
  // Shared: other processes used at least a quarter of a core, or the hypervisor stole at least 5% of the time.
  bool shared() const { return known && (other_cores >= 0.25 || steal >= 0.05); }
  std::string describe() const;  // "2.0 other cores busy, steal 0%, load 1.9 -> 2.1"
};
MachineLoad load_between(const CpuCounters& before, const CpuCounters& after);

// The CPU the machine's other processes use right now, measured over `seconds`.
MachineLoad sample_machine_load(double seconds);

}  // namespace sbp

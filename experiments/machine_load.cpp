#include "experiments/machine_load.h"

#include <chrono>
#include <ctime>
#include <fstream>
#include <sstream>
#include <thread>

#include <unistd.h>

#include <fmt/format.h>

namespace sbp {

CpuCounters read_cpu_counters() {
  CpuCounters c;
  c.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  timespec ts{};
  if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts) == 0) c.own_seconds = double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
  std::ifstream stat("/proc/stat");
  std::string line;
  if (std::getline(stat, line) && line.rfind("cpu ", 0) == 0) {
    // cpu user nice system idle iowait irq softirq steal guest guest_nice (guest time is inside user already)
    std::istringstream in(line.substr(4));
    double v[8] = {};
    for (double& x : v) in >> x;
    const double tick = double(sysconf(_SC_CLK_TCK));
    c.busy_seconds = (v[0] + v[1] + v[2] + v[5] + v[6]) / tick;
    c.steal_seconds = v[7] / tick;
    c.total_seconds = (v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7]) / tick;
    c.readable = bool(in) || in.eof();
  }
  std::ifstream loadavg("/proc/loadavg");
  if (!(loadavg >> c.load_average)) c.load_average = -1;
  return c;
}

MachineLoad load_between(const CpuCounters& before, const CpuCounters& after) {
  MachineLoad m;
  m.load_before = before.load_average, m.load_after = after.load_average;
  const double wall = after.wall_seconds - before.wall_seconds;
  const double own = after.own_seconds - before.own_seconds;
  m.own_per_wall = wall > 0 ? own / wall : 0;
  if (!before.readable || !after.readable || wall <= 0) return m;
  m.known = true;
  // The kernel's counters tick at USER_HZ and this process's clock does not: clamp the rounding below zero away.
  m.other_cores = std::max(0.0, (after.busy_seconds - before.busy_seconds - own) / wall);
  const double total = after.total_seconds - before.total_seconds;
  m.steal = total > 0 ? (after.steal_seconds - before.steal_seconds) / total : 0;
  return m;
}

MachineLoad sample_machine_load(double seconds) {
  const auto before = read_cpu_counters();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  return load_between(before, read_cpu_counters());
}

std::string MachineLoad::describe() const {
  if (!known) return "unknown (no /proc/stat)";
  return fmt::format("{:.1f} other cores busy, steal {:.0f}%, load {:.1f} -> {:.1f}", other_cores, 100 * steal,
                     load_before, load_after);
}

}  // namespace sbp

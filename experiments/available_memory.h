// How much more memory this process can get before the system refuses it or kills it: what is left under each limit
// that applies (a cgroup's memory limit, the address-space limit `ulimit -v`, the machine's MemAvailable). `run`
// compares a step's modelled peak with the tightest (experiments/memory_check.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sbp {

struct MemoryLimit {
  std::string name;             // "cgroup memory limit", "ulimit -v", "MemAvailable"
  std::int64_t left_bytes = 0;  // what more this process can get under it (0 when it is used up)
  std::string detail;           // how it was read, for the message: "limit 11.18 GiB, 2.05 GiB mapped"
};

// The limits in force now, read from /proc and /sys (none that cannot be read; no cgroup limit when it is "max").
// A cgroup's usage leaves out its inactive file pages (the kernel reclaims them before it kills); the address-space
// limit is against the process's virtual size (VmSize), which counts every library mapping as well as the heap.
std::vector<MemoryLimit> memory_limits();

// The limit with the least left (nullptr for none).
const MemoryLimit* tightest_limit(const std::vector<MemoryLimit>& limits);

}  // namespace sbp

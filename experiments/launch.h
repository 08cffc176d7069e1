// Ranks of a distributed `train` (ARCHITECTURE.md §12): which rank this process is, from the environment, and the local
// launcher behind `--nproc N`, which starts N ranks of the same command line as fresh processes (fork + exec of this
// binary), relays their output and, when one fails, stops the others and names it.
#pragma once

#include <optional>
#include <string>
#include "core/io/input_error.h"

namespace sbp {

struct RankEnv {
  int rank = 0, world_size = 1, local_rank = 0;
  std::string file_store;           // STREAMBP_STORE: set by the launcher (a FileStore in its temporary directory)
  std::string master_addr;          // torchrun: MASTER_ADDR / MASTER_PORT (a TCPStore)
  int master_port = 0;
};

// This process's rank: STREAMBP_RANK / STREAMBP_WORLD_SIZE / STREAMBP_STORE (the launcher's), else torchrun's RANK,
// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; nothing when neither is set (a single process, or the launcher
// itself). Throws InputError naming the variable when they are malformed or incomplete.
std::optional<RankEnv> rank_from_environment();

// Runs `nproc` ranks of this process's own command line (from /proc/self/cmdline) with STREAMBP_RANK etc. set and
// waits for them. Rank 0's output passes through; other ranks' lines are prefixed "[rank r]". When a rank exits
// non-zero or dies, the others get SIGTERM (SIGKILL after `grace_seconds`), and the returned code is that rank's
// (1 when it died by a signal), after "streambp: rank r <how>: <its last line>" on stderr.
int launch_ranks(int nproc, int grace_seconds = 10);

}  // namespace sbp

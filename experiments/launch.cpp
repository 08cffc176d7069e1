#include "experiments/launch.h"

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <vector>

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include "experiments/interrupt.h"
#include "core/io/input_error.h"

namespace sbp {
namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::optional<std::string>(v) : std::nullopt;
}

int env_int(const char* name, const std::string& text) {
  std::size_t used = 0;
  int value = -1;
  try {
    value = std::stoi(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || value < 0) throw InputError(fmt::format("{}='{}' is not a rank count", name, text));
  return value;
}

std::vector<std::string> own_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  for (std::size_t start = 0; start < all.size();) {
    const auto end = all.find('\0', start);
    args.push_back(all.substr(start, end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return args;
}

struct Rank {
  pid_t pid = -1;
  int out = -1;           // read end of its stderr
  std::string pending;    // a line not yet complete
  std::string last_line;  // its last non-empty line
  bool running = true;
};

void relay(Rank& r, int index, bool flush_all) {
  std::size_t nl;
  while ((nl = r.pending.find('\n')) != std::string::npos || (flush_all && !r.pending.empty())) {
    const auto line = nl == std::string::npos ? r.pending : r.pending.substr(0, nl);
    r.pending.erase(0, nl == std::string::npos ? r.pending.size() : nl + 1);
    if (!line.empty()) r.last_line = line;
    const auto text = index == 0 ? line + "\n" : fmt::format("[rank {}] {}\n", index, line);
    (void)!::write(STDERR_FILENO, text.data(), text.size());
  }
}

}  // namespace

std::optional<RankEnv> rank_from_environment() {
  RankEnv e;
  if (const auto rank = env("STREAMBP_RANK")) {
    e.rank = e.local_rank = env_int("STREAMBP_RANK", *rank);
    e.world_size = env_int("STREAMBP_WORLD_SIZE", env("STREAMBP_WORLD_SIZE").value_or(""));
    e.file_store = env("STREAMBP_STORE").value_or("");
    if (e.file_store.empty()) throw InputError("STREAMBP_RANK is set but STREAMBP_STORE is not");
  } else if (const auto rank = env("RANK")) {  // torchrun
    e.rank = env_int("RANK", *rank);
    e.world_size = env_int("WORLD_SIZE", env("WORLD_SIZE").value_or(""));
    e.local_rank = env_int("LOCAL_RANK", env("LOCAL_RANK").value_or("0"));
    e.master_addr = env("MASTER_ADDR").value_or("");
    if (e.master_addr.empty()) throw InputError("RANK is set but MASTER_ADDR is not (torchrun sets both)");
    e.master_port = env_int("MASTER_PORT", env("MASTER_PORT").value_or(""));
  } else {
    return std::nullopt;
  }
  if (e.world_size < 1 || e.rank >= e.world_size)
    throw InputError(fmt::format("rank {} of world size {}", e.rank, e.world_size));
  return e;
}

int launch_ranks(int nproc, int grace_seconds) {
  char pattern[] = "/tmp/streambp-ranks-XXXXXX";
  if (!::mkdtemp(pattern)) throw std::runtime_error(std::string("--nproc: no temporary directory: ") + std::strerror(errno));
  const std::filesystem::path dir = pattern;
  const auto store = (dir / "store").string();
  const auto args = own_command_line();
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);

  std::vector<Rank> ranks(nproc);
  for (int r = 0; r < nproc; ++r) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error(std::string("--nproc: pipe: ") + std::strerror(errno));
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error(std::string("--nproc: fork: ") + std::strerror(errno));
    if (pid == 0) {
      ::dup2(fds[1], STDERR_FILENO);
      ::close(fds[0]);
      ::close(fds[1]);
      ::setenv("STREAMBP_RANK", std::to_string(r).c_str(), 1);
      ::setenv("STREAMBP_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("STREAMBP_STORE", store.c_str(), 1);
      ::execv("/proc/self/exe", argv.data());
      const auto text = fmt::format("exec of {} failed: {}\n", args.at(0), std::strerror(errno));
      (void)!::write(STDERR_FILENO, text.data(), text.size());
      ::_exit(127);
    }
    ::close(fds[1]);
    ranks[r].pid = pid;
    ranks[r].out = fds[0];
  }

  // Ctrl-C reaches every rank from the terminal; `train` stops them after an agreed step (interrupt.h). The launcher
  // outlives them to relay their last lines and report.
  std::signal(SIGINT, SIG_IGN);
  int failed = -1, code = 0;
  bool interrupted = false;
  std::string how;
  auto stop_at = std::chrono::steady_clock::time_point::max();
  for (int running = nproc; running > 0;) {
    std::vector<pollfd> fds;
    std::vector<int> owner;
    for (int r = 0; r < nproc; ++r)
      if (ranks[r].out >= 0) fds.push_back({ranks[r].out, POLLIN, 0}), owner.push_back(r);
    if (!fds.empty()) ::poll(fds.data(), fds.size(), 100);
    else ::usleep(100'000);
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      auto& rank = ranks[owner[i]];
      char buffer[4096];
      const auto n = ::read(rank.out, buffer, sizeof buffer);
      if (n > 0) {
        rank.pending.append(buffer, std::size_t(n));
        relay(rank, owner[i], false);
      } else {
        relay(rank, owner[i], true);
        ::close(rank.out);
        rank.out = -1;
      }
    }
    int status = 0;
    for (pid_t pid; (pid = ::waitpid(-1, &status, WNOHANG)) > 0;) {
      int r = 0;
      while (r < nproc && ranks[r].pid != pid) ++r;
      if (r == nproc) continue;
      ranks[r].running = false;
      --running;
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      // Stopped by Ctrl-C after a step every rank agreed on: not a failure, and the others are finishing too (rank 0
      // may still be writing the checkpoint).
      const bool stopped = WIFEXITED(status) && WEXITSTATUS(status) == kInterruptedExit;
      interrupted = interrupted || stopped;
      if (ok || stopped || failed >= 0) continue;
      failed = r;
      code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
      how = WIFEXITED(status) ? fmt::format("exited with status {}", WEXITSTATUS(status))
                              : fmt::format("was killed by signal {} ({})", WTERMSIG(status), ::strsignal(WTERMSIG(status)));
      for (auto& other : ranks)
        if (other.running) ::kill(other.pid, SIGTERM);
      stop_at = std::chrono::steady_clock::now() + std::chrono::seconds(grace_seconds);
    }
    if (std::chrono::steady_clock::now() > stop_at) {
      for (auto& other : ranks)
        if (other.running) ::kill(other.pid, SIGKILL);
      stop_at = std::chrono::steady_clock::time_point::max();
    }
  }
  for (auto& rank : ranks) {  // what is left in the pipes
    if (rank.out < 0) continue;
    char buffer[4096];
    for (ssize_t n; (n = ::read(rank.out, buffer, sizeof buffer)) > 0;) rank.pending.append(buffer, std::size_t(n));
    relay(rank, int(&rank - ranks.data()), true);
    ::close(rank.out);
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  if (failed >= 0) {
    fmt::print(stderr, "streambp: rank {} of {} {}: {}\n", failed, nproc, how,
               ranks[failed].last_line.empty() ? "(no output)" : ranks[failed].last_line);
    return code == 0 ? 1 : code;
  }
  return interrupted ? kInterruptedExit : 0;
}

}  // namespace sbp

#include "experiments/conform_child.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include "experiments/interrupt.h"

namespace sbp {

namespace fs = std::filesystem;

// After the timeout's SIGTERM the group keeps this long to write its last words before SIGKILL.
constexpr double kTermGraceSeconds = 3;

std::string quoted(const std::string& s) {
  std::string out = "'";
  for (const char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// The largest VmHWM (peak resident set) among the live processes of process group `group`. Not rusage's ru_maxrss: a forked child starts with this process's resident pages (libtorch), and
// the kernel keeps that high-water mark across exec.
static std::int64_t group_peak_rss(pid_t group) {
  std::error_code ec;
  const auto self = fs::read_symlink("/proc/self/exe", ec);
  std::int64_t peak = 0;
  for (const auto& entry : fs::directory_iterator("/proc", ec)) {
    const auto name = entry.path().filename().string();
    if (name.empty() || !std::all_of(name.begin(), name.end(), ::isdigit)) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string text;
    std::getline(stat, text);
    const auto close = text.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(text.substr(close + 2));
    std::string state;
    long ppid = 0, pgrp = 0;
    rest >> state >> ppid >> pgrp;
    if (pgrp != group) continue;
    std::error_code exe_error;
    // The group's leader before its exec is a fork of this process (the implementation may run this binary too).
    if (std::stol(name) == group && fs::read_symlink(entry.path() / "exe", exe_error) == self) continue;
    std::ifstream status(entry.path() / "status");
    for (std::string line; std::getline(status, line);)
      if (line.rfind("VmHWM:", 0) == 0) peak = std::max(peak, std::int64_t(std::stoll(line.substr(6))) * 1024);
  }
  return peak;
}


// `command case_dir` through /bin/sh in its own process group, output to case_dir/impl.log; after `timeout` seconds
// SIGTERM to the group and SIGKILL kTermGraceSeconds later: the grace lets a distributed adapter say which of its
// ranks had not finished (hf_sp_adapter.py) before it goes.
ChildRun run_child(const std::string& command, const fs::path& case_dir, double timeout) {
  const auto log = (case_dir / "impl.log").string();
  const auto line = command + " " + quoted(case_dir.string());
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    setpgid(0, 0);
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  setpgid(pid, pid);
  ChildRun r;
  int status = 0;
  rusage usage{};
  bool timed_out = false, stopped = false;
  const auto seconds_since_start = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  while (true) {
    r.peak_rss_bytes = std::max(r.peak_rss_bytes, group_peak_rss(pid));
    const pid_t done = wait4(pid, &status, WNOHANG, &usage);
    if (done == pid) break;
    const double elapsed = seconds_since_start();
    if (!timed_out && !stopped && elapsed > timeout) {
      timed_out = true;
      kill(-pid, SIGTERM);
    }
    if (timed_out && elapsed > timeout + kTermGraceSeconds) kill(-pid, SIGKILL);
    if (!timed_out && !stopped && interrupted()) {  // Ctrl-C reaches only the terminal's group, not the child's own
      stopped = true;
      kill(-pid, SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // The shell may go first at a SIGTERM: the rest of the group keeps the grace to write its last words.
  while (timed_out && kill(-pid, 0) == 0 && seconds_since_start() < timeout + kTermGraceSeconds)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  kill(-pid, SIGKILL);  // anything the command left running in its group
  r.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.cpu_seconds = double(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
                  1e-6 * double(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec);
  if (std::ifstream in(case_dir / "result.json"); in) {
    const std::string text(std::istreambuf_iterator<char>(in), {});
    r.cpu_seconds += result_worker_cpu_seconds(text);  // a warm worker's own CPU time: not this process's child
    r.provenance = result_provenance(text);
  }
  r.exit_status = timed_out || stopped || WIFSIGNALED(status) ? -1 : WEXITSTATUS(status);
  r.interrupted = stopped;
  if (stopped) {
    r.outcome = "stopped by Ctrl-C";
  } else if (timed_out) {
    r.outcome = fmt::format("timed out after {:.0f} s (--timeout)", timeout);
  } else if (WIFSIGNALED(status)) {
    r.outcome = fmt::format("killed by signal {}", WTERMSIG(status));
  } else if (r.exit_status != 0) {
    r.outcome = fmt::format("exited with status {}", r.exit_status);
  }
  return r;
}

// A progress bar's line (tqdm's "Loading weights: 100%|#####| 9/9 [00:00<00:00, 12.3it/s]"): never the last word.
static bool progress_bar(const std::string& line) {
  static const std::regex bar(R"((\d+%\|)|(\| *\d+/\d+ \[\d))");
  return std::regex_search(line, bar);
}

// The last `count` non-empty lines of a file, each cut at 200 characters; a carriage return ends a line too (a
// progress bar redraws itself with one), and progress bars are left out.
static std::vector<std::string> last_lines(const fs::path& file, std::size_t count) {
  std::ifstream in(file);
  std::vector<std::string> lines;
  for (std::string text; std::getline(in, text);) {
    std::istringstream parts(text);
    for (std::string line; std::getline(parts, line, '\r');) {
      if (line.find_first_not_of(" \t") == std::string::npos || progress_bar(line)) continue;
      lines.push_back(line.size() > 200 ? line.substr(0, 200) + "..." : line);
      if (lines.size() > count) lines.erase(lines.begin());
    }
  }
  return lines;
}

std::string last_line(const fs::path& file) {
  const auto lines = last_lines(file, 1);
  return lines.empty() ? "" : lines.back();
}

// Where a command's first word, when it names a python, resolves: the path /bin/sh runs ("" when not on PATH), so
// that a failure can say which interpreter ran (a system python without torch fails every case alike).
static std::optional<std::string> python_of(const std::string& command) {
  const auto begin = command.find_first_not_of(" \t");
  if (begin == std::string::npos) return std::nullopt;
  std::string word;
  if (command[begin] == '\'' || command[begin] == '"') {
    word = command.substr(begin + 1, command.find(command[begin], begin + 1) - begin - 1);
  } else {
    word = command.substr(begin, command.find_first_of(" \t", begin) - begin);
    const char* home = std::getenv("HOME");
    if (word.rfind("~/", 0) == 0 && home) word = home + word.substr(1);
  }
  if (!std::regex_match(fs::path(word).filename().string(), std::regex(R"(python[0-9.]*)"))) return std::nullopt;
  if (word.find('/') != std::string::npos) return fs::absolute(word).lexically_normal().string();
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');)
    if (const auto candidate = fs::path(dir.empty() ? "." : dir) / word; access(candidate.c_str(), X_OK) == 0)
      return fs::absolute(candidate).lexically_normal().string();
  return std::string();
}

// Whether `python` (a resolved path; "" when not on PATH) can import torch, asked without importing it.
static bool has_torch(const std::string& python) {
  if (python.empty()) return false;
  const auto probe = quoted(python) + " -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec(\"torch\") "
                     "is None)' >/dev/null 2>&1";
  return std::system(probe.c_str()) == 0;
}

// After the table, for the first command that failed to run: the command line, the end of its output, and which
// python ran it, with the harness's own as the remedy when that one has no torch.
std::string failed_run_note(const std::string& who, const std::string& command, const fs::path& dir,
                            const std::string& outcome, const std::string& ours) {
  auto note = fmt::format("{} failed ({}): {} {}\n", who, outcome, command, quoted(dir.string()));
  if (const auto tail = last_lines(dir / "impl.log", 5); !tail.empty()) {
    note += "  the end of its output (impl.log):\n";
    for (const auto& line : tail) note += "    " + line + "\n";
  }
  const auto python = python_of(command);
  if (!python) return note;
  const auto first = command.substr(0, command.find_first_of(" \t", command.find_first_not_of(" \t")));
  note += python->empty() ? fmt::format("  {} is not on PATH\n", first)
                          : fmt::format("  {} is {}\n", first, *python);
  // The harness's python as the remedy only when the command's has no torch: a user's library runs in its own venv.
  if (!ours.empty() && fs::absolute(ours).lexically_normal().string() != *python && !has_torch(*python))
    note += fmt::format("  the harness's python (torch, transformers, peft) is {}: --impl \"{}{}\"\n", ours, ours,
                        command.substr(first.size()));
  return note;
}

}  // namespace sbp

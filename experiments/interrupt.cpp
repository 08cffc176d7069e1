#include "experiments/interrupt.h"

#include <atomic>
#include <csignal>

#include <unistd.h>

namespace sbp {
namespace {

std::atomic<bool> stop_requested{false};

void on_sigint(int) {
  if (stop_requested.exchange(true)) {  // the second Ctrl-C: stop now
    std::signal(SIGINT, SIG_DFL);
    std::raise(SIGINT);
    return;
  }
  static const char text[] = "\ninterrupt: stopping after this step to write a checkpoint (Ctrl-C again to stop now)\n";
  (void)!::write(STDERR_FILENO, text, sizeof text - 1);
}

}  // namespace

void watch_interrupts() {
  struct sigaction action{};
  action.sa_handler = on_sigint;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &action, nullptr);
}

bool interrupted() { return stop_requested.load(); }

}  // namespace sbp

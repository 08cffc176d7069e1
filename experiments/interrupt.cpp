#include "experiments/interrupt.h"

#include <atomic>
#include <csignal>
#include <cstring>

#include <unistd.h>

namespace sbp {
namespace {

std::atomic<bool> stop_requested{false};
const char* interrupt_note = "";
std::size_t interrupt_note_size = 0;  // measured outside the handler

void on_sigint(int) {
  if (stop_requested.exchange(true)) {  // the second Ctrl-C: stop now
    std::signal(SIGINT, SIG_DFL);
    std::raise(SIGINT);
    return;
  }
  (void)!::write(STDERR_FILENO, interrupt_note, interrupt_note_size);
}

}  // namespace

void watch_interrupts(const char* note) {
  interrupt_note = note;
  interrupt_note_size = std::strlen(note);
  struct sigaction action{};
  action.sa_handler = on_sigint;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &action, nullptr);
}

bool interrupted() { return stop_requested.load(); }

}  // namespace sbp

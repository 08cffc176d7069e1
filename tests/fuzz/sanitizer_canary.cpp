// The negative controls of the sanitized tree: each mode commits one defect the tree exists to catch, and CTest
// expects the sanitizer's (or the fuzz rule's) report. A build whose flags were lost would run these to exit 0 and
// fail the tests, instead of passing every other test without checking anything.
//   sanitizer_canary heap|overflow|leak|refusal
#include <nlohmann/json.hpp>

#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "tests/fuzz/fuzz_support.h"

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  if (std::strcmp(mode, "heap") == 0) {  // AddressSanitizer: one element past a heap block
    std::vector<int> v(4, 1);
    volatile int* p = v.data();
    std::printf("%d\n", p[argc + 2]);
  } else if (std::strcmp(mode, "overflow") == 0) {  // UndefinedBehaviorSanitizer: signed overflow
    volatile std::int64_t big = std::numeric_limits<std::int64_t>::max();
    std::printf("%lld\n", static_cast<long long>(big + argc));
  } else if (std::strcmp(mode, "leak") == 0) {  // LeakSanitizer: a block nobody frees
    volatile char* lost = new char[1000];
    lost[0] = 1;
    lost = nullptr;
  } else if (std::strcmp(mode, "refusal") == 0) {  // the fuzz rule: a reader's exception that names no file
    // The rule aborts (libFuzzer keeps the input); CTest would call a death by signal a crash whatever it printed.
    std::signal(SIGABRT, [](int) { std::_Exit(3); });
    sbp::fuzz::refuses_cleanly("a reader", "config.json",
                               [] { (void)nlohmann::json::parse("{\"a\": 1}").at("b").get<int>(); });
  } else {
    std::fprintf(stderr, "usage: sanitizer_canary heap|overflow|leak|refusal\n");
    return 2;
  }
  return 0;
}

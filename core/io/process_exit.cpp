#include "core/io/process_exit.h"

#include <cstdio>
#include <cstdlib>
#include <iostream>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define STREAMBP_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define STREAMBP_ASAN 1
#endif

namespace sbp {

void exit_without_teardown(int status) {
  // iostreams first (std::cout may buffer apart from stdout), then every C stream (fmt::print writes through them).
  std::cout.flush();
  std::cerr.flush();
  std::clog.flush();
  std::fflush(nullptr);
#ifdef STREAMBP_ASAN
  std::exit(status);
#else
  std::_Exit(status);
#endif
}

}  // namespace sbp

#include "experiments/exit_status.h"

#include <exception>
#include <system_error>
#include <new>

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "core/io/input_error.h"
#include "core/training/communicator.h"

namespace sbp {

namespace {
int internal_error(const char* what) {
  fmt::print(stderr, "streambp: internal error: {} (please report it with the command line: this is a bug, not your "
             "input)\n", what);
  return kExitInternal;
}
}  // namespace

int run_with_exit_status(const std::function<int()>& command) {
  try {
    return command();
  } catch (const InputError& e) {
    fmt::print(stderr, "streambp: error: {}\n", e.what());
    return kExitInput;
  } catch (const std::system_error& e) {
    // The system refused a path (std::filesystem's errors are system errors too): one the user named (--out,
    // --save-*, a checkpoint folder) or its folder, a full disk; the message names the path.
    fmt::print(stderr, "streambp: error: {}\n", e.what());
    return kExitInput;
  } catch (const c10::OutOfMemoryError& e) {
    // Out of memory outside a measured step (those end as `oom` rows and records): the same exit as an oom result.
    // The CPU meter's message names the block the system refused.
    fmt::print(stderr, "streambp: out of memory: {}\n", e.what_without_backtrace());
    return kExitOutOfMemory;
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "streambp: out of memory: a C++ allocation failed (std::bad_alloc)\n");
    return kExitOutOfMemory;
  } catch (const PeerFailure& e) {
    fmt::print(stderr, "streambp: a peer rank failed: {}\n", e.what());
    return kExitFailed;
  } catch (const c10::Error& e) {
    return internal_error(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return internal_error(e.what());
  } catch (...) {
    return internal_error("an exception of unknown type");
  }
}

}  // namespace sbp

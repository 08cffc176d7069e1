#pragma once
// The end of a program's main: the status returned, everything written flushed, and the process gone without running
// static destructors. LibTorch's deregister every operator its libraries registered at load, about 0.14 CPU-s of a
// process whose whole start costs ~0.35 (libtorch_cpu and the CUDA wheel's libraries, measured on 2026-12-02: a main
// that returns takes 0.51 CPU-s, one that _exits 0.36). The suite starts over a thousand such processes (every CLI
// call, every rank, every Catch2 case), so this is ~150 CPU-s of it, and a user's script of many short calls saves
// the same share.
// Call it from main with nothing of main's own left to destroy: main(argc, argv) { return finish(run(argc, argv)); }.
// Under AddressSanitizer the normal exit stays: LeakSanitizer checks at exit.
namespace sbp {

[[noreturn]] void exit_without_teardown(int status);

}  // namespace sbp

// The bf16 GEMM paths measured once per machine and reused (core/model/gemm_store.h, issue #49), with injected
// timings: nothing here times a product. The store, its lock between two processes, what it does with a corrupt or
// foreign file and with a folder it cannot write, and what a process takes from a stored choice.
#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/model/gemm.h"
#include "core/model/gemm_store.h"
#include "tests/support/test_support.h"

namespace {

namespace fs = std::filesystem;
using sbp::GemmMeasurement;
using sbp::GemmStoreMode;

sbp::GemmMachineKey key() {
  return {"AMD EPYC 9R14", "avx2 avx512f avx512_bf16", "2.14.1", "", "bf16", 2};
}

// nt 2x faster native, nn 1.05x (within the margin: widened), tn slower native.
GemmMeasurement timings() {
  GemmMeasurement m;
  m.layouts = {{{0.010, 0.020}, {0.019, 0.020}, {0.030, 0.020}}};
  m.shapes = "injected";
  return m;
}

// A probe that counts its calls.
struct CountingProbe {
  int calls = 0;
  GemmMeasurement operator()() {
    ++calls;
    return timings();
  }
};

// Sets an environment variable for one scope.
struct ScopedEnv {
  std::string name;
  std::optional<std::string> before;
  ScopedEnv(std::string n, const std::string& value) : name(std::move(n)) {
    if (const char* v = std::getenv(name.c_str())) before = v;
    setenv(name.c_str(), value.c_str(), 1);
  }
  ~ScopedEnv() { before ? setenv(name.c_str(), before->c_str(), 1) : unsetenv(name.c_str()); }
};

}  // namespace

TEST_CASE("a layout is native only when its measured native time beats widened by the margin", "[gemm-store]") {
  CHECK(sbp::paths_from(timings()).describe() == "nt=native,nn=widened,tn=widened");
  GemmMeasurement tie;
  tie.layouts = {{{0.02, 0.02}, {0.02, 0.02}, {0.02, 0.02}}};
  CHECK(sbp::paths_from(tie).describe() == "nt=widened,nn=widened,tn=widened");
}

TEST_CASE("the GEMM paths are measured once, stored, and read back by every later call", "[gemm-store]") {
  const sbp::test::TempDir dir;
  const auto folder = dir.path() / "cache";  // created by the store
  CountingProbe probe;
  const auto call = [&](GemmStoreMode mode) { return sbp::stored_gemm_paths(folder, key(), std::ref(probe), mode); };

  CHECK_FALSE(call(GemmStoreMode::read_only));  // nothing stored: a test or CI never measures
  CHECK(probe.calls == 0);
  const auto first = call(GemmStoreMode::reuse);
  REQUIRE(first);
  CHECK(probe.calls == 1);
  CHECK(first->measured_now);
  CHECK(first->paths.describe() == "nt=native,nn=widened,tn=widened");
  CHECK(first->file == folder / key().file_name());
  CHECK_THAT(first->reason(), Catch::Contains("stored in " + first->file.string()) &&
                                  Catch::Contains(", nt native/widened 0.50, nn native/widened 0.95"));
  for (const auto mode : {GemmStoreMode::reuse, GemmStoreMode::read_only}) {
    const auto again = call(mode);
    REQUIRE(again);
    CHECK(probe.calls == 1);
    CHECK_FALSE(again->measured_now);
    CHECK(again->paths.describe() == first->paths.describe());
    CHECK(again->date == first->date);
    CHECK(again->measurement.layouts[2].native == 0.030);
  }
  // The file records what decided: the key, the timings, the margin, the date.
  const auto j = nlohmann::json::parse(sbp::test::read_bytes(first->file));
  CHECK(j.at("key").at("cpu_model") == "AMD EPYC 9R14");
  CHECK(j.at("key").at("threads") == 2);
  CHECK(j.at("seconds").at("nt").at("widened") == 0.020);
  CHECK(j.at("margin") == sbp::kNativeMargin);
  // Another thread count is another key: measured on its own, the first one untouched.
  auto four = key();
  four.threads = 4;
  CHECK(four.file_name() != key().file_name());
  REQUIRE(sbp::stored_gemm_paths(folder, four, std::ref(probe), GemmStoreMode::reuse));
  CHECK(probe.calls == 2);
  // --remeasure replaces it.
  REQUIRE(call(GemmStoreMode::remeasure));
  CHECK(probe.calls == 3);
}

TEST_CASE("a corrupt or foreign stored file is ignored and measured again", "[gemm-store]") {
  const sbp::test::TempDir dir;
  const auto file = dir.path() / key().file_name();
  CountingProbe probe;
  SECTION("corrupt") { sbp::test::write_bytes(file, "{\"format\": \"streambp-gemm-path-1\", \"key\": "); }
  SECTION("another format") { sbp::test::write_bytes(file, "{\"format\": \"something else\"}\n"); }
  SECTION("another machine's key under this file name") {
    REQUIRE(sbp::stored_gemm_paths(dir.path(), key(), std::ref(probe), GemmStoreMode::reuse));
    auto j = nlohmann::json::parse(sbp::test::read_bytes(file));
    j["key"]["cpu_model"] = "Intel Xeon Platinum 8488C";
    sbp::test::write_bytes(file, j.dump());
    probe.calls = 0;
  }
  SECTION("malformed paths") {
    REQUIRE(sbp::stored_gemm_paths(dir.path(), key(), std::ref(probe), GemmStoreMode::reuse));
    auto j = nlohmann::json::parse(sbp::test::read_bytes(file));
    j["paths"] = "nt=fast,nn=widened,tn=widened";
    sbp::test::write_bytes(file, j.dump());
    probe.calls = 0;
  }
  CHECK_FALSE(sbp::stored_gemm_paths(dir.path(), key(), std::ref(probe), GemmStoreMode::read_only));
  const auto s = sbp::stored_gemm_paths(dir.path(), key(), std::ref(probe), GemmStoreMode::reuse);
  REQUIRE(s);
  CHECK(probe.calls == 1);
  CHECK(s->paths.describe() == "nt=native,nn=widened,tn=widened");
  // Replaced by a whole file of this key.
  CHECK(sbp::stored_gemm_paths(dir.path(), key(), std::ref(probe), GemmStoreMode::read_only));
}

TEST_CASE("a cache folder that cannot be written gives no stored choice and measures nothing", "[gemm-store]") {
  const sbp::test::TempDir dir;
  sbp::test::write_bytes(dir.path() / "file", "a file, not a folder");
  CountingProbe probe;
  CHECK_FALSE(sbp::stored_gemm_paths(dir.path() / "file" / "cache", key(), std::ref(probe), GemmStoreMode::reuse));
  CHECK(probe.calls == 0);
}

TEST_CASE("two processes started at once on an empty cache take the same paths, measured once", "[gemm-store]") {
  const sbp::test::TempDir dir;
  const auto folder = dir.path() / "cache";
  const auto counter = dir.path() / "measurements";
  // Each process says it is ready and waits for the other's word, so that both ask the store at once; the probe
  // then takes long enough that without the lock both would measure (a negative control: the count is 2).
  const auto run = [&](const std::string& me, const std::string& other) {
    sbp::test::write_bytes(dir.path() / me, "");
    while (!fs::exists(dir.path() / other)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const auto probe = [&] {
      std::ofstream(counter, std::ios::app) << me << "\n";
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      return timings();
    };
    const auto s = sbp::stored_gemm_paths(folder, key(), probe, GemmStoreMode::reuse);
    sbp::test::write_bytes(dir.path() / (me + ".paths"), s ? s->paths.describe() : "none");
  };
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // no Catch2 in the child: its verdict is the file it writes
    run("child", "parent");
    _exit(0);
  }
  run("parent", "child");
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  const auto measured = sbp::test::read_bytes(counter);
  CHECK(std::count(measured.begin(), measured.end(), '\n') == 1);
  CHECK(sbp::test::read_bytes(dir.path() / "parent.paths") == "nt=native,nn=widened,tn=widened");
  CHECK(sbp::test::read_bytes(dir.path() / "child.paths") == "nt=native,nn=widened,tn=widened");
}

TEST_CASE("a process takes this machine's stored paths, or the flag rule when none is stored", "[gemm-store]") {
  const sbp::test::TempDir dir;
  const ScopedEnv cache("STREAMBP_CACHE", dir.path().string());
  const auto running = sbp::running_gemm_key(at::kBFloat16);
  if (!sbp::native_narrow_kernels(running.cpu_flags, running.onednn_max_isa, at::kBFloat16)) {
    // No native bf16 kernels (AVX2, AVX512_CORE or a lower oneDNN cap): widened, nothing to measure or read.
    const auto [paths, why] = sbp::machine_gemm_paths(at::kBFloat16);
    CHECK(paths.describe() == "nt=widened,nn=widened,tn=widened");
    CHECK(fs::is_empty(dir.path()));
    return;
  }
  const auto [rule, rule_why] = sbp::machine_gemm_paths(at::kBFloat16);
  CHECK_THAT(rule_why, Catch::Contains("none stored in " + dir.path().string()));
  CHECK(fs::is_empty(dir.path()));  // nothing measured
  // A choice no rule makes (mixed), stored for this process's key: taken, with where it came from.
  REQUIRE(sbp::stored_gemm_paths(dir.path(), running, timings, GemmStoreMode::reuse));
  const auto [paths, why] = sbp::machine_gemm_paths(at::kBFloat16);
  CHECK(paths.describe() == "nt=native,nn=widened,tn=widened");
  CHECK_THAT(why, Catch::StartsWith("measured ") && Catch::Contains((dir.path() / running.file_name()).string()));
  CHECK(sbp::machine_gemm_paths(at::kFloat).first.describe() == "nt=native,nn=native,tn=native");
}

TEST_CASE("which CPUs have native narrow kernels to measure", "[gemm-store]") {
  const std::string avx2 = "fpu sse avx avx2 fma", avx512 = avx2 + " avx512f avx512bw";
  const std::string bf16 = avx512 + " avx512_bf16", amx = bf16 + " amx_bf16 amx_tile";
  CHECK_FALSE(sbp::native_narrow_kernels(avx2, "", at::kBFloat16));
  CHECK_FALSE(sbp::native_narrow_kernels(avx512, "", at::kBFloat16));
  CHECK(sbp::native_narrow_kernels(bf16, "", at::kBFloat16));
  CHECK(sbp::native_narrow_kernels(amx, "", at::kBFloat16));
  CHECK(sbp::native_narrow_kernels(amx, "avx512_core_bf16", at::kBFloat16));  // AVX512-BF16 under the cap
  CHECK_FALSE(sbp::native_narrow_kernels(bf16, "AVX2", at::kBFloat16));
  CHECK_FALSE(sbp::native_narrow_kernels(amx, "avx512_core", at::kBFloat16));
  CHECK_FALSE(sbp::native_narrow_kernels(bf16, "", at::kHalf));  // no AVX512-FP16
}

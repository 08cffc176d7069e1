#include "core/model/gemm_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/version.h>

namespace sbp {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "streambp-gemm-path-1";
constexpr std::array<const char*, 3> kLayoutNames = {"nt", "nn", "tn"};

std::string cpuinfo_field(const std::string& field) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field, 0) == 0 && line.find(':') != std::string::npos) {
      auto value = line.substr(line.find(':') + 1);
      while (!value.empty() && value.front() == ' ') value.erase(0, 1);
      return value;
    }
  return "";
}

// FNV-1a, 64 bits: a file name that every build of the harness computes alike (std::hash need not).
std::uint64_t fnv1a(const std::string& text) {
  std::uint64_t h = 1469598103934665603ull;
  for (const unsigned char ch : text) h = (h ^ ch) * 1099511628211ull;
  return h;
}

nlohmann::json key_json(const GemmMachineKey& k) {
  return {{"cpu_model", k.cpu_model}, {"cpu_flags", k.cpu_flags},        {"torch_version", k.torch_version},
          {"onednn_max_isa", k.onednn_max_isa}, {"dtype", k.dtype}, {"threads", k.threads}};
}

GemmMachineKey key_of(const nlohmann::json& j) {
  GemmMachineKey k;
  k.cpu_model = j.at("cpu_model").get<std::string>();
  k.cpu_flags = j.at("cpu_flags").get<std::string>();
  k.torch_version = j.at("torch_version").get<std::string>();
  k.onednn_max_isa = j.at("onednn_max_isa").get<std::string>();
  k.dtype = j.at("dtype").get<std::string>();
  k.threads = j.at("threads").get<int>();
  return k;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

void warn(const std::string& message) { fmt::print(stderr, "warning: {}\n", message); }

// The stored choice in `file` for `key`: nothing when the file is missing; a warning and nothing when it is not a
// stored choice (corrupt, another format) or another key's (copied from another machine, a hash collision).
std::optional<StoredGemmPaths> read_stored(const fs::path& file, const GemmMachineKey& key) {
  std::ifstream in(file);
  if (!in) return std::nullopt;
  try {
    const auto j = nlohmann::json::parse(in);
    if (j.at("format") != kFormat) throw std::runtime_error("format is not " + std::string(kFormat));
    if (!(key_of(j.at("key")) == key)) {
      warn(fmt::format("{}: stored for another machine or setting ({}), not this one ({}); ignored",
                       file.string(), key_of(j.at("key")).describe(), key.describe()));
      return std::nullopt;
    }
    StoredGemmPaths s;
    s.paths = parse_gemm_paths(j.at("paths").get<std::string>(), file.string());
    s.date = j.at("date").get<std::string>();
    s.measurement.attempts = j.at("attempts").get<int>();
    s.measurement.shapes = j.at("shapes").get<std::string>();
    for (std::size_t i = 0; i < kLayoutNames.size(); ++i) {
      const auto& t = j.at("seconds").at(kLayoutNames[i]);
      s.measurement.layouts[i] = {t.at("native").get<double>(), t.at("widened").get<double>()};
    }
    s.file = file;
    return s;
  } catch (const std::exception& e) {
    warn(fmt::format("{}: not a stored GEMM path choice ({}); ignored", file.string(), e.what()));
    return std::nullopt;
  }
}

// Temp file then rename: a reader never sees half a file. False (and a warning) when it cannot be written.
bool write_stored(const StoredGemmPaths& s, const GemmMachineKey& key) {
  nlohmann::json seconds;
  for (std::size_t i = 0; i < kLayoutNames.size(); ++i)
    seconds[kLayoutNames[i]] = {{"native", s.measurement.layouts[i].native},
                                {"widened", s.measurement.layouts[i].widened}};
  const nlohmann::json j = {{"format", kFormat}, {"key", key_json(key)},  {"paths", s.paths.describe()},
                            {"date", s.date},    {"margin", kNativeMargin}, {"attempts", s.measurement.attempts},
                            {"shapes", s.measurement.shapes}, {"seconds", seconds}};
  const auto temp = s.file.string() + fmt::format(".tmp.{}", ::getpid());
  {
    std::ofstream out(temp);
    out << j.dump(2) << "\n";
    if (!out.flush()) {
      warn(fmt::format("{}: cannot write the measured GEMM paths", temp));
      std::error_code ec;
      fs::remove(temp, ec);
      return false;
    }
  }
  std::error_code ec;
  fs::rename(temp, s.file, ec);
  if (ec) {
    warn(fmt::format("{}: cannot store the measured GEMM paths ({})", s.file.string(), ec.message()));
    fs::remove(temp, ec);
    return false;
  }
  return true;
}

// An exclusive flock on a file of the folder for this object's lifetime; !held() where it cannot be taken.
class FolderLock {
 public:
  explicit FolderLock(const fs::path& file) : fd_(::open(file.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644)) {
    if (fd_ >= 0 && ::flock(fd_, LOCK_EX) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~FolderLock() {
    if (fd_ >= 0) ::close(fd_);  // closing releases the lock
  }
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;
  bool held() const { return fd_ >= 0; }

 private:
  int fd_;
};

}  // namespace

std::string GemmMachineKey::describe() const {
  return fmt::format("{}, flags '{}', torch {}, ONEDNN_MAX_CPU_ISA '{}', {}, {} threads", cpu_model, cpu_flags,
                     torch_version, onednn_max_isa, dtype, threads);
}

std::string GemmMachineKey::file_name() const {
  const auto text = fmt::format("{}\n{}\n{}\n{}\n{}\n{}", cpu_model, cpu_flags, torch_version, onednn_max_isa, dtype,
                                threads);
  return fmt::format("gemm-path-{:016x}.json", fnv1a(text));
}

GemmMachineKey running_gemm_key(c10::ScalarType dtype) {
  GemmMachineKey k;
  k.cpu_model = cpuinfo_field("model name");
  const auto flags = " " + cpuinfo_field("flags") + " ";
  // The flags whose presence changes oneDNN's kernels for a narrow product; the rest (microcode, mitigations) would
  // split one machine's choice for nothing.
  for (const char* f : {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16"})
    if (flags.find(fmt::format(" {} ", f)) != std::string::npos) k.cpu_flags += (k.cpu_flags.empty() ? "" : " ") + std::string(f);
  k.torch_version = TORCH_VERSION;
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  if (!cap || !*cap) cap = std::getenv("DNNL_MAX_CPU_ISA");  // oneDNN's older name of the same knob
  k.onednn_max_isa = cap ? cap : "";
  k.dtype = dtype == at::kHalf ? "fp16" : "bf16";
  k.threads = at::get_num_threads();
  return k;
}

GemmPaths paths_from(const GemmMeasurement& m) {
  const auto path = [](const LayoutSeconds& s) {
    return s.native < s.widened * (1 - kNativeMargin) ? GemmPath::native : GemmPath::widened;
  };
  return {path(m.layouts[0]), path(m.layouts[1]), path(m.layouts[2])};
}

fs::path streambp_cache_folder() {
  if (const char* folder = std::getenv("STREAMBP_CACHE"); folder && *folder) return folder;
  const char* home = std::getenv("HOME");
  return fs::path(home && *home ? home : ".") / ".cache" / "streambp";
}

std::string StoredGemmPaths::reason() const {
  std::string ratios;
  for (std::size_t i = 0; i < kLayoutNames.size(); ++i) {
    const auto& s = measurement.layouts[i];
    ratios += fmt::format(", {} native/widened {:.2f}", kLayoutNames[i], s.native / s.widened);
  }
  return fmt::format("{} {}{}; stored in {}", measured_now ? "measured now" : "measured", date, ratios, file.string());
}

std::optional<StoredGemmPaths> stored_gemm_paths(const fs::path& folder, const GemmMachineKey& key,
                                                 const std::function<GemmMeasurement()>& probe, GemmStoreMode mode) {
  const auto file = folder / key.file_name();
  // A file is replaced by a rename, so a reader without the lock sees a whole one or none.
  if (mode == GemmStoreMode::read_only) return read_stored(file, key);
  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec) {
    warn(fmt::format("{}: cannot create the cache folder ({}); the GEMM paths are not measured", folder.string(),
                     ec.message()));
    return std::nullopt;
  }
  const FolderLock lock(folder / "gemm-path.lock");
  if (!lock.held()) {
    warn(fmt::format("{}: cannot lock {}; the GEMM paths are not measured", folder.string(), "gemm-path.lock"));
    return std::nullopt;
  }
  // Under the lock: a process that waited here reads what the one before it stored.
  if (mode == GemmStoreMode::reuse)
    if (auto stored = read_stored(file, key)) return stored;
  StoredGemmPaths s;
  s.measurement = probe();
  s.paths = paths_from(s.measurement);
  s.date = utc_now();
  s.file = file;
  s.measured_now = true;
  if (!write_stored(s, key)) return std::nullopt;
  return s;
}

}  // namespace sbp

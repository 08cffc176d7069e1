// The safetensors reader and writer, and the HF checkpoint folder on top of them (sharded index, dtypes, atomic
// writes). Over 500 lines on purpose: every check of an untrusted file (header length, offsets, overlaps, dtype and
// shape against bytes) sits beside the read it guards, which is what the fuzz targets exercise; split, the checks
// would drift from the reads.
#include "core/io/safetensors.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <fstream>
#include <optional>
#include <random>
#include <set>
#include <system_error>
#include <utility>

namespace sbp {
namespace {

namespace fs = std::filesystem;
// Keeps header order, so zero-size tensors sharing an offset come back in the order they were written.
using Json = nlohmann::ordered_json;

// Tensor bytes are copied as they are, so the host must use the format's byte order.
static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

// The reference implementation's limit; stops a garbage length from allocating gigabytes.
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

struct Dtype {
  const char* name;
  at::ScalarType type;
};
constexpr std::array<Dtype, 10> kDtypes{{{"F64", at::kDouble},
                                         {"F32", at::kFloat},
                                         {"F16", at::kHalf},
                                         {"BF16", at::kBFloat16},
                                         {"I64", at::kLong},
                                         {"I32", at::kInt},
                                         {"I16", at::kShort},
                                         {"I8", at::kChar},
                                         {"U8", at::kByte},
                                         {"BOOL", at::kBool}}};

std::optional<at::ScalarType> dtype_from_name(const std::string& name) {
  for (const Dtype& d : kDtypes) {
    if (name == d.name) return d.type;
  }
  return std::nullopt;
}

std::optional<std::string> safetensors_dtype(at::ScalarType type) {
  for (const Dtype& d : kDtypes) {
    if (type == d.type) return d.name;
  }
  return std::nullopt;
}

[[noreturn]] void fail(const fs::path& path, const std::string& what) {
  throw FormatError(path.string() + ": " + what);
}

std::string quoted(const std::string& tensor_name) { return "tensor '" + tensor_name + "'"; }

[[noreturn]] void fail_tensor(const fs::path& path, const std::string& tensor_name, const std::string& what) {
  fail(path, quoted(tensor_name) + ": " + what);
}

// ---------------------------------------------------------------------------------------------------------------
// Reading

struct Entry {
  std::string name;
  at::ScalarType dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin;
  std::uint64_t end;
};

struct Header {
  std::vector<Entry> entries;  // sorted by data offset, i.e. in the order of their bytes in the file
  std::map<std::string, std::string> metadata;
};

std::ifstream open_for_reading(const fs::path& file) {
  if (!fs::is_regular_file(file)) fail(file, fs::exists(file) ? "not a regular file" : "no such file");
  std::ifstream in(file, std::ios::binary);
  if (!in) fail(file, "cannot open for reading");
  return in;
}

void read_exactly(std::ifstream& in, const fs::path& file, void* destination, std::uint64_t bytes) {
  if (bytes == 0) return;
  in.read(static_cast<char*>(destination), static_cast<std::streamsize>(bytes));
  if (static_cast<std::uint64_t>(in.gcount()) != bytes) fail(file, "truncated: the file ended while reading it");
}

std::string read_whole_file(const fs::path& file) {
  std::ifstream in = open_for_reading(file);
  std::string text(fs::file_size(file), '\0');
  read_exactly(in, file, text.data(), text.size());
  return text;
}

// Where a JSON text comes from: top-level keys of a header are tensor names, and errors say which text is broken.
enum class JsonSource { kHeader, kIndex };

// nlohmann keeps one of two equal keys without a word; two tensors of one name make a checkpoint ambiguous.
Json parse_json_rejecting_duplicates(const fs::path& file, const std::string& text, JsonSource source) {
  std::vector<std::set<std::string>> keys_of_open_objects;
  const auto on_event = [&](int /*depth*/, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::object_start) {
      keys_of_open_objects.emplace_back();
    } else if (event == Json::parse_event_t::object_end) {
      keys_of_open_objects.pop_back();
    } else if (event == Json::parse_event_t::key) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (!keys_of_open_objects.back().insert(key).second) {
        const bool is_tensor = source == JsonSource::kHeader && keys_of_open_objects.size() == 1;
        fail(file, is_tensor ? quoted(key) + " appears twice in the header" : "duplicate key '" + key + "'");
      }
    }
    return true;
  };
  try {
    return Json::parse(text, on_event);
  } catch (const Json::exception& e) {  // parse_error, and out_of_range for a number beyond double (1e400)
    fail(file, std::string(source == JsonSource::kHeader ? "header is not valid JSON: " : "not valid JSON: ") +
                   e.what());
  }
}

std::vector<std::int64_t> parse_shape(const fs::path& file, const std::string& name, const Json& shape) {
  if (!shape.is_array()) fail_tensor(file, name, "\"shape\" is not an array of integers");
  std::vector<std::int64_t> dims;
  for (const Json& dim : shape) {
    if (!dim.is_number_integer()) fail_tensor(file, name, "\"shape\" is not an array of integers");
    if (!dim.is_number_unsigned()) fail_tensor(file, name, "negative dimension in \"shape\"");
    if (dim.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX)) {
      fail_tensor(file, name, "dimension too large");
    }
    dims.push_back(dim.get<std::int64_t>());
  }
  return dims;
}

std::optional<std::uint64_t> checked_byte_size(const std::vector<std::int64_t>& shape, at::ScalarType dtype) {
  std::uint64_t bytes = c10::elementSize(dtype);
  for (const std::int64_t dim : shape) {
    if (__builtin_mul_overflow(bytes, static_cast<std::uint64_t>(dim), &bytes)) return std::nullopt;
  }
  return bytes;
}

std::string shape_text(const std::vector<std::int64_t>& shape) { return Json(shape).dump(); }

// Checks one entry on its own: fields, types, dtype, and that its byte range fits its shape and the data section.
Entry parse_entry(const fs::path& file, const std::string& name, const Json& value, std::uint64_t data_bytes) {
  if (!value.is_object()) fail_tensor(file, name, "entry is not an object");
  const auto dtype = value.find("dtype");
  const auto shape = value.find("shape");
  const auto offsets = value.find("data_offsets");
  if (dtype == value.end() || !dtype->is_string()) fail_tensor(file, name, "\"dtype\" is missing or not a string");
  if (shape == value.end()) fail_tensor(file, name, "\"shape\" is missing");
  if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
      !(*offsets)[1].is_number_unsigned()) {
    fail_tensor(file, name, "\"data_offsets\" is missing or not two non-negative integers");
  }
  const std::string dtype_text = dtype->get<std::string>();
  const std::optional<at::ScalarType> type = dtype_from_name(dtype_text);
  if (!type) fail_tensor(file, name, "unknown dtype '" + dtype_text + "'");

  Entry entry{name, *type, parse_shape(file, name, *shape), (*offsets)[0].get<std::uint64_t>(),
              (*offsets)[1].get<std::uint64_t>()};
  const std::string range = "data_offsets [" + std::to_string(entry.begin) + ", " + std::to_string(entry.end) + "]";
  if (entry.end < entry.begin) fail_tensor(file, name, range + " end before begin");
  if (entry.end > data_bytes) {
    fail_tensor(file, name,
                range + " beyond the " + std::to_string(data_bytes) + "-byte data section (file truncated?)");
  }
  const std::optional<std::uint64_t> expected = checked_byte_size(entry.shape, entry.dtype);
  if (expected != entry.end - entry.begin) {
    fail_tensor(file, name,
                "shape mismatch: " + dtype_text + " " + shape_text(entry.shape) + " needs " +
                    (expected ? std::to_string(*expected) : std::string("too many")) + " bytes but " + range +
                    " spans " + std::to_string(entry.end - entry.begin));
  }
  return entry;
}

std::map<std::string, std::string> parse_metadata(const fs::path& file, const Json& value) {
  if (!value.is_object()) fail(file, "\"__metadata__\" is not an object");
  std::map<std::string, std::string> metadata;
  for (const auto& [key, text] : value.items()) {
    if (!text.is_string()) fail(file, "\"__metadata__\" value of '" + key + "' is not a string");
    metadata.emplace(key, text.get<std::string>());
  }
  return metadata;
}

// The spec asks for tensors that tile the data section exactly: no overlap, no hole, no trailing bytes.
void sort_and_check_layout(const fs::path& file, std::vector<Entry>& entries, std::uint64_t data_bytes) {
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::pair(a.begin, a.end) < std::pair(b.begin, b.end);
  });
  std::uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const Entry& entry : entries) {
    if (entry.begin < covered) fail_tensor(file, entry.name, "overlaps " + quoted(previous->name));
    if (entry.begin > covered) {
      fail_tensor(file, entry.name,
                  "data bytes [" + std::to_string(covered) + ", " + std::to_string(entry.begin) +
                      ") before it belong to no tensor (hole in the data section)");
    }
    covered = entry.end;
    previous = &entry;
  }
  if (covered != data_bytes) {
    fail(file, "data bytes [" + std::to_string(covered) + ", " + std::to_string(data_bytes) +
                   ") at the end of the data section belong to no tensor");
  }
}

Header parse_header(const fs::path& file, const std::string& text, std::uint64_t data_bytes) {
  const Json json = parse_json_rejecting_duplicates(file, text, JsonSource::kHeader);
  if (!json.is_object()) fail(file, "header is not a JSON object");
  Header header;
  for (const auto& [key, value] : json.items()) {
    if (key == kMetadataKey) {
      header.metadata = parse_metadata(file, value);
    } else {
      header.entries.push_back(parse_entry(file, key, value, data_bytes));
    }
  }
  sort_and_check_layout(file, header.entries, data_bytes);
  return header;
}

// Reads and validates everything before the data section of the open `file` and leaves `in` at the start of the
// data.
Header read_header(const fs::path& file, std::ifstream& in) {
  const std::uint64_t file_bytes = fs::file_size(file);
  if (file_bytes < 8) {
    fail(file, "file is " + std::to_string(file_bytes) + " bytes, shorter than the 8-byte header length");
  }
  std::array<unsigned char, 8> length_bytes{};
  read_exactly(in, file, length_bytes.data(), length_bytes.size());
  std::uint64_t header_bytes = 0;
  for (std::size_t i = 0; i < length_bytes.size(); ++i) header_bytes |= std::uint64_t{length_bytes[i]} << (8 * i);
  if (header_bytes > file_bytes - 8) {
    fail(file, "truncated: header length " + std::to_string(header_bytes) + " exceeds the " +
                   std::to_string(file_bytes - 8) + " bytes after it");
  }
  if (header_bytes > kMaxHeaderBytes) fail(file, "header length " + std::to_string(header_bytes) + " is implausible");
  std::string text(header_bytes, '\0');
  read_exactly(in, file, text.data(), text.size());
  return parse_header(file, text, file_bytes - 8 - header_bytes);
}

// ---------------------------------------------------------------------------------------------------------------
// Writing

[[noreturn]] void throw_errno(const fs::path& path, const std::string& what) {
  const int error = errno;  // before building the message, whose allocations may change errno
  throw std::system_error(error, std::generic_category(), path.string() + ": " + what);
}

std::string random_hex() {
  std::random_device device;
  const std::uint64_t value = (std::uint64_t{device()} << 32) | device();
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value));
  return text;
}

// A temporary file next to the target that replaces it on commit() and disappears if never committed. Same folder,
// so the rename cannot cross file systems and is atomic.
class AtomicFile {
 public:
  explicit AtomicFile(const fs::path& target) : target_(target), temp_(target) {
    temp_ += ".tmp." + random_hex();
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd_ < 0) throw_errno(temp_, "cannot create");
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!temp_.empty()) {
      std::error_code ignored;
      fs::remove(temp_, ignored);
    }
  }

  void write(const void* data, std::size_t bytes) {
    const char* next = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t written = ::write(fd_, next, bytes);
      if (written < 0 && errno == EINTR) continue;
      if (written < 0) throw_errno(temp_, "write failed");
      next += written;
      bytes -= static_cast<std::size_t>(written);
    }
  }

  void commit() {
    // Without the fsync a crash after the rename can leave an empty or partial file under the target's name.
    if (::fsync(fd_) != 0) throw_errno(temp_, "fsync failed");
    if (::close(std::exchange(fd_, -1)) != 0) throw_errno(temp_, "close failed");
    fs::rename(temp_, target_);
    temp_.clear();
  }

 private:
  fs::path target_;
  fs::path temp_;
  int fd_ = -1;
};

std::uint64_t byte_size(const at::Tensor& tensor) {
  return static_cast<std::uint64_t>(tensor.numel()) * static_cast<std::uint64_t>(tensor.element_size());
}

// Checked before anything is written, so a bad list leaves no file (or shard) behind.
void check_writable(const fs::path& where, const TensorList& tensors) {
  std::set<std::string> names;
  for (const auto& [name, tensor] : tensors) {
    if (name == kMetadataKey) fail_tensor(where, name, "the name is reserved for metadata");
    if (!names.insert(name).second) fail_tensor(where, name, "the name is used twice");
    if (!tensor.defined()) fail_tensor(where, name, "undefined tensor");
    if (!safetensors_dtype(tensor.scalar_type())) {
      fail_tensor(where, name, std::string("dtype ") + c10::toString(tensor.scalar_type()) + " is not supported");
    }
  }
}

std::string build_header(const TensorList& tensors, const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  std::uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const std::uint64_t bytes = byte_size(tensor);
    header[name] = {{"dtype", *safetensors_dtype(tensor.scalar_type())},
                    {"shape", tensor.sizes().vec()},
                    {"data_offsets", Json::array({offset, offset + bytes})}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section then starts 8-byte aligned, as HF's writer does
  return text;
}

std::array<unsigned char, 8> little_endian(std::uint64_t value) {
  std::array<unsigned char, 8> bytes{};
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(value >> (8 * i));
  return bytes;
}

std::string shard_name(std::size_t number, std::size_t count) {
  char text[64];
  std::snprintf(text, sizeof text, "model-%05zu-of-%05zu.safetensors", number, count);
  return text;
}

bool is_shard_name(const std::string& name) {
  static const std::string pattern = "model-#####-of-#####.safetensors";
  return name.size() == pattern.size() && std::equal(pattern.begin(), pattern.end(), name.begin(), [](char p, char c) {
           return p == '#' ? std::isdigit(static_cast<unsigned char>(c)) != 0 : p == c;
         });
}

// Greedy in order, which keeps each layer's tensors together, as HF's sharding does.
std::vector<TensorList> split_into_shards(const TensorList& tensors, std::uint64_t max_shard_bytes) {
  std::vector<TensorList> shards;
  std::uint64_t filled = 0;
  for (const NamedTensor& named : tensors) {
    const std::uint64_t bytes = byte_size(named.tensor);
    if (shards.empty() || (!shards.back().empty() && filled + bytes > max_shard_bytes)) {
      shards.emplace_back();
      filled = 0;
    }
    shards.back().push_back(named);
    filled += bytes;
  }
  return shards;
}

// Removes the checkpoint files of an earlier write that the new one does not use, so the folder holds exactly one
// checkpoint: a stale model.safetensors would shadow a new index, and stale shards waste gigabytes.
void remove_stale_checkpoint_files(const fs::path& dir, const std::set<std::string>& keep) {
  std::vector<fs::path> stale;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const bool is_checkpoint_file = name == kSingleFile || name == kIndexFile || is_shard_name(name);
    if (is_checkpoint_file && !keep.contains(name)) stale.push_back(entry.path());
  }
  for (const fs::path& path : stale) fs::remove(path);
}

std::set<std::string> write_shards(const fs::path& dir, const TensorList& tensors, std::uint64_t max_shard_bytes,
                                   const std::map<std::string, std::string>& metadata, std::uint64_t total_bytes) {
  const std::vector<TensorList> shards = split_into_shards(tensors, max_shard_bytes);
  std::set<std::string> written;
  nlohmann::json weight_map = nlohmann::json::object();
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const std::string name = shard_name(i + 1, shards.size());
    write_safetensors(dir / name, shards[i], metadata);
    for (const NamedTensor& named : shards[i]) weight_map[named.name] = name;
    written.insert(name);
  }
  // Written last: the index is what makes the new shards the checkpoint.
  const nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  write_file_atomically(dir / kIndexFile, index.dump(2) + "\n");
  written.insert(kIndexFile);
  return written;
}

// ---------------------------------------------------------------------------------------------------------------
// Reading a folder

std::map<std::string, std::string> read_weight_map(const fs::path& index) {
  const Json json = parse_json_rejecting_duplicates(index, read_whole_file(index), JsonSource::kIndex);
  const auto weight_map = json.is_object() ? json.find("weight_map") : json.end();
  if (weight_map == json.end() || !weight_map->is_object()) fail(index, "no \"weight_map\" object");
  std::map<std::string, std::string> shard_of;
  for (const auto& [name, shard] : weight_map->items()) {
    if (!shard.is_string()) fail_tensor(index, name, "shard file name is not a string");
    const std::string file = shard.get<std::string>();
    // A plain name in the index's own folder: a path ("/x", "../x", "a/b") would read a file outside the checkpoint,
    // and an error about it would name that file instead of the folder.
    if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos) {
      fail_tensor(index, name, "shard file name '" + file + "' is not a file name in the checkpoint's folder");
    }
    shard_of.emplace(name, file);
  }
  return shard_of;
}

void append_shard(const fs::path& shard, const std::map<std::string, std::string>& shard_of, TensorList& out) {
  const std::string shard_file = shard.filename().string();
  if (!fs::exists(shard)) fail(shard, std::string("shard listed in ") + kIndexFile + " is missing");
  std::set<std::string> found;
  for (NamedTensor& named : read_safetensors(shard)) {
    const auto listed = shard_of.find(named.name);
    if (listed == shard_of.end()) fail_tensor(shard, named.name, std::string("not listed in ") + kIndexFile);
    if (listed->second != shard_file) {
      fail_tensor(shard, named.name, "stored here, but the index assigns it to '" + listed->second +
                                         "' (a second copy or a misplaced tensor)");
    }
    found.insert(named.name);
    out.push_back(std::move(named));
  }
  for (const auto& [name, file] : shard_of) {
    if (file == shard_file && !found.contains(name)) {
      fail_tensor(shard, name, std::string("listed in ") + kIndexFile + " but absent from this shard");
    }
  }
}

}  // namespace

TensorList read_safetensors(const fs::path& file) {
  std::ifstream in = open_for_reading(file);
  const Header header = read_header(file, in);
  TensorList tensors;
  tensors.reserve(header.entries.size());
  // The entries tile the data section in order, so one sequential pass reads each tensor straight into its own
  // storage: no staging buffer the size of the file.
  for (const Entry& entry : header.entries) {
    at::Tensor tensor = at::empty(entry.shape, at::TensorOptions().dtype(entry.dtype));
    read_exactly(in, file, tensor.data_ptr(), entry.end - entry.begin);
    tensors.push_back({entry.name, std::move(tensor)});
  }
  return tensors;
}

std::map<std::string, std::string> read_safetensors_metadata(const fs::path& file) {
  std::ifstream in = open_for_reading(file);
  return read_header(file, in).metadata;
}

TensorList read_safetensors_dir(const fs::path& dir) {
  if (fs::exists(dir / kSingleFile)) return read_safetensors(dir / kSingleFile);
  const fs::path index = dir / kIndexFile;
  if (!fs::exists(index)) fail(dir, std::string("neither ") + kSingleFile + " nor " + kIndexFile + " exists");
  const std::map<std::string, std::string> shard_of = read_weight_map(index);
  std::set<std::string> shards;
  for (const auto& [name, shard] : shard_of) shards.insert(shard);
  TensorList tensors;
  for (const std::string& shard : shards) append_shard(dir / shard, shard_of, tensors);
  return tensors;
}

void write_safetensors(const fs::path& file, const TensorList& tensors,
                       const std::map<std::string, std::string>& metadata) {
  check_writable(file, tensors);
  const std::string header = build_header(tensors, metadata);
  AtomicFile out(file);
  out.write(little_endian(header.size()).data(), 8);
  out.write(header.data(), header.size());
  for (const NamedTensor& named : tensors) {
    // Converted one at a time, so a GPU model costs one extra tensor of host memory, not a second copy of itself.
    const at::Tensor bytes = named.tensor.to(at::kCPU).contiguous();
    out.write(bytes.data_ptr(), byte_size(bytes));
  }
  out.commit();
}

void write_safetensors_dir(const fs::path& dir, const TensorList& tensors, std::uint64_t max_shard_bytes,
                           const std::map<std::string, std::string>& metadata) {
  check_writable(dir, tensors);
  fs::create_directories(dir);
  std::uint64_t total_bytes = 0;
  for (const NamedTensor& named : tensors) total_bytes += byte_size(named.tensor);
  std::set<std::string> written;
  if (total_bytes <= max_shard_bytes) {
    write_safetensors(dir / kSingleFile, tensors, metadata);
    written.insert(kSingleFile);
  } else {
    written = write_shards(dir, tensors, max_shard_bytes, metadata, total_bytes);
  }
  remove_stale_checkpoint_files(dir, written);
}

void write_file_atomically(const fs::path& file, const std::string& bytes) {
  AtomicFile out(file);
  out.write(bytes.data(), bytes.size());
  out.commit();
}

}  // namespace sbp

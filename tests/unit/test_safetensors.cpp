#include "core/io/safetensors.h"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cstring>

#include "tests/support/test_support.h"

namespace fs = std::filesystem;
using sbp::FormatError;
using sbp::NamedTensor;
using sbp::TensorList;

namespace {

using sbp::test::read_bytes;
using sbp::test::write_bytes;

// Each test's scratch folder.
class TempDir : public sbp::test::TempDir {
 public:
  TempDir() : sbp::test::TempDir("sbp_test_safetensors_") {}
};

std::string little_endian_u64(std::uint64_t value) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(value >> (8 * i));
  return bytes;
}

// A file as the spec lays it out: length prefix, header text, data.
std::string safetensors_bytes(const std::string& header, const std::string& data) {
  return little_endian_u64(header.size()) + header + data;
}

std::string tensor_bytes(const at::Tensor& tensor) {
  const at::Tensor contiguous = tensor.contiguous();
  return std::string(static_cast<const char*>(contiguous.data_ptr()), contiguous.nbytes());
}

// The FormatError message of reading `file`; fails the test when there is none.
template <typename Read>
std::string error_of(Read read) {
  try {
    read();
  } catch (const FormatError& e) {
    return e.what();
  }
  FAIL("expected a FormatError");
  return {};
}

std::string read_error(const fs::path& file) {
  return error_of([&] { sbp::read_safetensors(file); });
}

std::string dir_error(const fs::path& dir) {
  return error_of([&] { sbp::read_safetensors_dir(dir); });
}

bool starts_with(const std::string& text, const std::string& prefix) { return text.rfind(prefix, 0) == 0; }

std::vector<std::string> leftover_temporaries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.find(".tmp") != std::string::npos) names.push_back(name);
  }
  return names;
}

TensorList every_dtype() {
  return {
      {"model.f64", at::randn({2, 3}, at::kDouble)},
      {"model.f32", at::randn({4}, at::kFloat)},
      {"model.f16", at::randn({3, 2}).to(at::kHalf)},
      {"model.bf16", at::randn({2, 2, 2}).to(at::kBFloat16)},
      {"model.i64", at::arange(-3, 3, at::kLong)},
      {"model.i32", at::arange(-5, 5, at::kInt).reshape({2, 5})},
      {"model.i16", at::arange(-4, 4, at::kShort)},
      {"model.i8", at::arange(-128, 128, at::kInt).to(at::kChar)},
      {"model.u8", at::arange(0, 256, at::kInt).to(at::kByte)},
      {"model.bool", at::rand({5}) > 0.5},
      {"a.scalar", at::scalar_tensor(3.5, at::kFloat)},
      {"a.empty", at::empty({0, 3}, at::kFloat)},
      {"a.transposed", at::arange(12, at::kFloat).reshape({3, 4}).t()},
  };
}

void require_same(const TensorList& actual, const TensorList& expected) {
  REQUIRE(actual.size() == expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    INFO("tensor " << i << ": " << expected[i].name);
    CHECK(actual[i].name == expected[i].name);
    CHECK(actual[i].tensor.scalar_type() == expected[i].tensor.scalar_type());
    CHECK(actual[i].tensor.sizes() == expected[i].tensor.sizes());
    CHECK(actual[i].tensor.device().is_cpu());
    CHECK(actual[i].tensor.is_contiguous());
    CHECK(tensor_bytes(actual[i].tensor) == tensor_bytes(expected[i].tensor));
  }
}

TensorList float_tensors(const std::vector<std::string>& names, std::int64_t elements_each) {
  TensorList tensors;
  for (const std::string& name : names) tensors.push_back({name, at::randn({elements_each})});
  return tensors;
}

const std::string kValidEntry = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
const std::string kEightBytes(8, '\x01');

}  // namespace

TEST_CASE("safetensors round trip keeps names, order, dtypes, shapes and bytes") {
  TempDir dir;
  const TensorList tensors = every_dtype();
  REQUIRE_FALSE(tensors.back().tensor.is_contiguous());
  sbp::write_safetensors(dir.path() / "all.safetensors", tensors);
  require_same(sbp::read_safetensors(dir.path() / "all.safetensors"), tensors);
}

TEST_CASE("safetensors writer produces the exact bytes of the spec") {
  TempDir dir;
  sbp::write_safetensors(dir.path() / "a.safetensors", {{"a", at::tensor({1.0F, 2.0F})}});
  std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  const std::string data("\x00\x00\x80\x3f\x00\x00\x00\x40", 8);  // 1.0f and 2.0f, little-endian
  CHECK(read_bytes(dir.path() / "a.safetensors") == safetensors_bytes(header, data));
}

TEST_CASE("safetensors header is padded with spaces to a multiple of 8") {
  TempDir dir;
  for (std::size_t name_length = 1; name_length <= 8; ++name_length) {
    INFO("name length " << name_length);
    const fs::path file = dir.path() / "padded.safetensors";
    const at::Tensor tensor = at::arange(3, at::kShort);
    sbp::write_safetensors(file, {{std::string(name_length, 'w'), tensor}});
    const std::string bytes = read_bytes(file);
    std::uint64_t header_length = 0;
    std::memcpy(&header_length, bytes.data(), 8);
    CHECK(header_length % 8 == 0);
    CHECK(bytes.size() == 8 + header_length + tensor.nbytes());
    const std::string header = bytes.substr(8, header_length);
    const std::size_t json_end = header.rfind('}') + 1;
    CHECK(header.find_first_not_of(' ', json_end) == std::string::npos);
    CHECK(nlohmann::json::parse(header.substr(0, json_end)).is_object());
  }
}

TEST_CASE("safetensors metadata round trips and is absent unless given") {
  TempDir dir;
  const std::map<std::string, std::string> metadata{{"format", "pt"}, {"step", "7"}, {"note", "ünïcode"}};
  sbp::write_safetensors(dir.path() / "with.safetensors", {{"w", at::ones({2})}}, metadata);
  CHECK(sbp::read_safetensors_metadata(dir.path() / "with.safetensors") == metadata);

  sbp::write_safetensors(dir.path() / "without.safetensors", {{"w", at::ones({2})}});
  CHECK(sbp::read_safetensors_metadata(dir.path() / "without.safetensors").empty());
  CHECK(read_bytes(dir.path() / "without.safetensors").find("__metadata__") == std::string::npos);
}

TEST_CASE("safetensors tensors come back in the order of their data, whatever the header order") {
  TempDir dir;
  const std::string header = R"({"second":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},)"
                             R"("first":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  write_bytes(dir.path() / "order.safetensors", safetensors_bytes(header, "\x07\x09"));
  const TensorList tensors = sbp::read_safetensors(dir.path() / "order.safetensors");
  REQUIRE(tensors.size() == 2);
  CHECK(tensors[0].name == "first");
  CHECK(tensors[0].tensor.item<std::uint8_t>() == 7);
  CHECK(tensors[1].name == "second");
  CHECK(tensors[1].tensor.item<std::uint8_t>() == 9);
}

TEST_CASE("sharded safetensors folder reads back the same tensors") {
  TempDir dir;
  // 100 bytes each; a 250-byte limit packs them 2 + 2 + 1.
  const TensorList tensors = float_tensors({"e", "d", "c", "b", "a"}, 25);
  const std::map<std::string, std::string> metadata{{"format", "pt"}};
  sbp::write_safetensors_dir(dir.path(), tensors, 250, metadata);

  const std::vector<std::string> shards{"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                        "model-00003-of-00003.safetensors"};
  for (const std::string& shard : shards) {
    CHECK(fs::exists(dir.path() / shard));
    CHECK(sbp::read_safetensors_metadata(dir.path() / shard) == metadata);
  }
  CHECK_FALSE(fs::exists(dir.path() / "model.safetensors"));
  const auto index = nlohmann::json::parse(read_bytes(dir.path() / "model.safetensors.index.json"));
  CHECK(index["metadata"]["total_size"] == 500);
  CHECK(index["weight_map"] == nlohmann::json({{"e", shards[0]}, {"d", shards[0]}, {"c", shards[1]},
                                                {"b", shards[1]}, {"a", shards[2]}}));
  CHECK(sbp::read_safetensors(dir.path() / shards[1]).size() == 2);
  require_same(sbp::read_safetensors_dir(dir.path()), tensors);
  CHECK(leftover_temporaries(dir.path()).empty());
}

TEST_CASE("safetensors folder within the shard limit is one model.safetensors") {
  TempDir dir;
  const TensorList tensors = every_dtype();
  sbp::write_safetensors_dir(dir.path(), tensors, 1 << 20);
  CHECK(fs::exists(dir.path() / "model.safetensors"));
  CHECK_FALSE(fs::exists(dir.path() / "model.safetensors.index.json"));
  require_same(sbp::read_safetensors_dir(dir.path()), tensors);
}

TEST_CASE("a tensor larger than the shard limit gets a shard of its own") {
  TempDir dir;
  const TensorList tensors = float_tensors({"small", "big", "tail"}, 1);
  const TensorList mixed{tensors[0], {"big", at::randn({100})}, tensors[2]};
  sbp::write_safetensors_dir(dir.path(), mixed, 16);
  CHECK(sbp::read_safetensors(dir.path() / "model-00001-of-00003.safetensors")[0].name == "small");
  CHECK(sbp::read_safetensors(dir.path() / "model-00002-of-00003.safetensors")[0].name == "big");
  require_same(sbp::read_safetensors_dir(dir.path()), mixed);
}

TEST_CASE("rewriting a safetensors folder in another layout leaves exactly one checkpoint") {
  TempDir dir;
  const TensorList tensors = float_tensors({"a", "b", "c", "d"}, 25);
  const fs::path other = dir.path() / "config.json";
  write_bytes(other, "{}");

  sbp::write_safetensors_dir(dir.path(), tensors, 100);  // four shards
  sbp::write_safetensors_dir(dir.path(), tensors, 200);  // two shards: the old four must go
  CHECK_FALSE(fs::exists(dir.path() / "model-00003-of-00004.safetensors"));
  CHECK(fs::exists(dir.path() / "model-00002-of-00002.safetensors"));

  sbp::write_safetensors_dir(dir.path(), tensors, 1000);  // one file: index and shards must go
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir.path())) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"config.json", "model.safetensors"});

  sbp::write_safetensors_dir(dir.path(), tensors, 200);  // back to shards: a stale model.safetensors would win
  CHECK_FALSE(fs::exists(dir.path() / "model.safetensors"));
  require_same(sbp::read_safetensors_dir(dir.path()), tensors);
}

TEST_CASE("malformed safetensors files are rejected naming the file and the tensor") {
  TempDir dir;
  struct Case {
    std::string label;
    std::string header;
    std::string data;
    std::string tensor;  // empty when no tensor is at fault
    std::string says;
  };
  const std::vector<Case> cases{
      {"not_json", R"({"w":)", "", "", "not valid JSON"},
      {"not_object", "[1,2]", "", "", "not a JSON object"},
      {"entry_not_object", R"({"w":[1]})", "", "w", "not an object"},
      {"missing_dtype", R"({"w":{"shape":[2],"data_offsets":[0,8]}})", kEightBytes, "w", "dtype"},
      {"missing_shape", R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", kEightBytes, "w", "shape"},
      {"missing_offsets", R"({"w":{"dtype":"F32","shape":[2]}})", kEightBytes, "w", "data_offsets"},
      {"dtype_not_string", R"({"w":{"dtype":5,"shape":[2],"data_offsets":[0,8]}})", kEightBytes, "w", "dtype"},
      {"shape_not_array", R"({"w":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", kEightBytes, "w", "shape"},
      {"shape_of_floats", R"({"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", kEightBytes, "w", "shape"},
      {"one_offset", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8]}})", kEightBytes, "w", "data_offsets"},
      {"negative_offset", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[-1,8]}})", kEightBytes, "w",
       "data_offsets"},
      {"unknown_dtype", R"({"w":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}})", kEightBytes, "w", "C64"},
      {"negative_shape", R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", kEightBytes, "w", "negative"},
      {"end_before_begin", R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", kEightBytes, "w",
       "end before begin"},
      {"end_beyond_data", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "\x01\x02\x03\x04", "w",
       "truncated"},
      {"shape_mismatch", R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", kEightBytes, "w",
       "shape mismatch"},
      {"overlap",
       "{\"w\":" + kValidEntry + R"(,"v":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       std::string(12, '\0'), "v", "overlaps tensor 'w'"},
      {"hole",
       "{\"w\":" + kValidEntry + R"(,"v":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
       std::string(20, '\0'), "v", "hole"},
      {"trailing_bytes", "{\"w\":" + kValidEntry + "}", std::string(12, '\0'), "", "belong to no tensor"},
      {"duplicate_name", "{\"w\":" + kValidEntry + ",\"w\":" + kValidEntry + "}", kEightBytes, "w", "twice"},
      {"metadata_not_strings", R"({"__metadata__":{"step":1},"w":)" + kValidEntry + "}", kEightBytes, "",
       "__metadata__"},
      // Found by fuzz_checkpoint (tests/fuzz/regressions): nlohmann's out_of_range for a number beyond double
      // escaped the reader without the file's name.
      {"number_beyond_double", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1e400}})", kEightBytes, "",
       "not valid JSON"},
  };
  for (const Case& bad : cases) {
    INFO(bad.label);
    const fs::path file = dir.path() / (bad.label + ".safetensors");
    write_bytes(file, safetensors_bytes(bad.header, bad.data));
    const std::string message = read_error(file);
    INFO(message);
    CHECK(starts_with(message, file.string() + ": "));
    CHECK(message.find(bad.says) != std::string::npos);
    if (!bad.tensor.empty()) CHECK(message.find("tensor '" + bad.tensor + "'") != std::string::npos);
    CHECK(error_of([&] { sbp::read_safetensors_metadata(file); }) == message);
  }
}

TEST_CASE("safetensors files too short for their lengths are rejected as such") {
  TempDir dir;
  const fs::path tiny = dir.path() / "tiny.safetensors";
  write_bytes(tiny, "\x10\x00\x00");
  CHECK(starts_with(read_error(tiny), tiny.string() + ": "));
  CHECK(read_error(tiny).find("shorter than the 8-byte header length") != std::string::npos);

  const fs::path cut = dir.path() / "cut.safetensors";
  write_bytes(cut, little_endian_u64(1000) + "{}");
  CHECK(starts_with(read_error(cut), cut.string() + ": "));
  CHECK(read_error(cut).find("truncated") != std::string::npos);

  const fs::path missing = dir.path() / "missing.safetensors";
  CHECK(starts_with(read_error(missing), missing.string() + ": "));
}

TEST_CASE("safetensors folders with a broken index or shards are rejected naming the file") {
  TempDir dir;
  const TensorList tensors = float_tensors({"a", "b", "c"}, 25);
  const std::string first = "model-00001-of-00002.safetensors";
  const std::string second = "model-00002-of-00002.safetensors";
  const fs::path index = dir.path() / "model.safetensors.index.json";

  SECTION("a folder without a checkpoint") {
    CHECK(starts_with(dir_error(dir.path()), dir.path().string() + ": "));
    CHECK(dir_error(dir.path()).find("neither") != std::string::npos);
  }
  SECTION("a missing shard") {
    sbp::write_safetensors_dir(dir.path(), tensors, 200);
    fs::remove(dir.path() / second);
    CHECK(starts_with(dir_error(dir.path()), (dir.path() / second).string() + ": "));
    CHECK(dir_error(dir.path()).find("missing") != std::string::npos);
  }
  SECTION("a tensor listed in the index but absent from its shard") {
    sbp::write_safetensors_dir(dir.path(), tensors, 200);
    auto json = nlohmann::json::parse(read_bytes(index));
    json["weight_map"]["ghost"] = second;
    write_bytes(index, json.dump());
    const std::string message = dir_error(dir.path());
    CHECK(starts_with(message, (dir.path() / second).string() + ": "));
    CHECK(message.find("tensor 'ghost'") != std::string::npos);
    CHECK(message.find("absent") != std::string::npos);
  }
  SECTION("a tensor stored in two shards") {
    sbp::write_safetensors(dir.path() / first, {tensors[0], tensors[1]});
    sbp::write_safetensors(dir.path() / second, {tensors[1], tensors[2]});
    write_bytes(index, nlohmann::json({{"weight_map", {{"a", first}, {"b", first}, {"c", second}}}}).dump());
    const std::string message = dir_error(dir.path());
    CHECK(starts_with(message, (dir.path() / second).string() + ": "));
    CHECK(message.find("tensor 'b'") != std::string::npos);
  }
  SECTION("a tensor in a shard but not in the index") {
    sbp::write_safetensors(dir.path() / first, tensors);
    write_bytes(index, nlohmann::json({{"weight_map", {{"a", first}, {"b", first}}}}).dump());
    CHECK(dir_error(dir.path()).find("tensor 'c'") != std::string::npos);
  }
  SECTION("a shard named by a path, not a file name in the folder (a fuzz finding: the error named the path alone)") {
    sbp::write_safetensors_dir(dir.path(), tensors, 200);
    for (const std::string& shard : std::vector<std::string>{"/" + second, "../" + second, "sub/" + second, "", ".."}) {
      write_bytes(index, nlohmann::json({{"weight_map", {{"a", first}, {"b", shard}, {"c", second}}}}).dump());
      const std::string message = dir_error(dir.path());
      INFO(shard << ": " << message);
      CHECK(starts_with(message, index.string() + ": "));
      CHECK(message.find("tensor 'b'") != std::string::npos);
      CHECK(message.find("not a file name") != std::string::npos);
    }
  }
  SECTION("an index that is not JSON or has no weight map") {
    write_bytes(index, "{\"weight_map\": ");
    CHECK(starts_with(dir_error(dir.path()), index.string() + ": "));
    write_bytes(index, R"({"metadata": {}})");
    CHECK(starts_with(dir_error(dir.path()), index.string() + ": "));
    CHECK(dir_error(dir.path()).find("weight_map") != std::string::npos);
  }
}

TEST_CASE("safetensors writer rejects what the format cannot hold and writes nothing") {
  TempDir dir;
  const fs::path file = dir.path() / "bad.safetensors";
  const auto write_error = [&](const TensorList& tensors) {
    return error_of([&] { sbp::write_safetensors(file, tensors); });
  };
  CHECK(write_error({{"c", at::ones({2}, at::kComplexFloat)}}).find("tensor 'c'") != std::string::npos);
  CHECK(write_error({{"w", at::ones({2})}, {"w", at::ones({2})}}).find("tensor 'w'") != std::string::npos);
  CHECK(write_error({{"__metadata__", at::ones({2})}}).find("reserved") != std::string::npos);
  CHECK(error_of([&] { sbp::write_safetensors_dir(dir.path() / "ckpt", {{"w", at::Tensor()}}, 100); })
            .find("tensor 'w'") != std::string::npos);
  CHECK(fs::is_empty(dir.path()));
}

TEST_CASE("write_file_atomically writes the content and leaves no temporary file") {
  TempDir dir;
  const fs::path file = dir.path() / "config.json";
  sbp::write_file_atomically(file, "first");
  CHECK(read_bytes(file) == "first");
  sbp::write_file_atomically(file, std::string("sec\0nd", 6));
  CHECK(read_bytes(file) == std::string("sec\0nd", 6));
  sbp::write_safetensors(dir.path() / "w.safetensors", {{"w", at::ones({3})}});
  CHECK(leftover_temporaries(dir.path()).empty());
}

TEST_CASE("write_file_atomically into a missing folder throws and creates nothing") {
  TempDir dir;
  CHECK_THROWS_AS(sbp::write_file_atomically(dir.path() / "no" / "such.json", "x"), std::system_error);
  CHECK(fs::is_empty(dir.path()));
}

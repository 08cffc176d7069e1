// HF checkpoint folders (ARCHITECTURE.md §3): a saved model loads back bit for bit and trains identically; config.json
// round-trips; malformed configs, files and tensors are rejected with a message naming the file and what is wrong.
#include <catch2/catch.hpp>

#include <filesystem>
#include <functional>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "core/model/checkpoint_io.h"
#include "core/model/config.h"
#include "core/model/model.h"
#include "tests/support/test_support.h"

namespace fs = std::filesystem;
using sbp::ModelConfig;
using sbp::test::describe;
using sbp::test::run_step;
using sbp::test::TempDir;

namespace {

// The message of the exception `action` throws; fails the test when it throws none.
std::string checkpoint_error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const std::exception& e) {
    return e.what();
  }
  FAIL("expected an exception");
  return {};
}

void check_same_config(const ModelConfig& a, const ModelConfig& b) {
  CHECK(describe(a) == describe(b));  // sizes and flags
  CHECK(a.max_position_embeddings == b.max_position_embeddings);
  CHECK(a.rms_norm_eps == b.rms_norm_eps);
  CHECK(a.rope_theta == b.rope_theta);
  CHECK(a.num_parameters() == b.num_parameters());
}

std::vector<std::string> safetensors_files(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().extension() == ".safetensors") names.push_back(entry.path().filename().string());
  return names;
}

}  // namespace

TEST_CASE("a saved model loads back bitwise identical and gives identical loss and gradients", "[checkpoint-io]") {
  struct Case {
    c10::ScalarType dtype;
    bool tied;
    std::uint64_t max_shard_bytes;
  };
  const std::uint64_t one_file = std::uint64_t(5) << 30;
  // 16 KiB is smaller than the embedding, so the checkpoint is split into many shards plus an index.
  const std::uint64_t small_shards = 16 << 10;
  for (const Case k : {Case{at::kDouble, true, one_file}, Case{at::kDouble, false, small_shards},
                       Case{at::kFloat, true, small_shards}, Case{at::kFloat, false, one_file}}) {
    ModelConfig config = sbp::test::tiny_config();
    config.tie_word_embeddings = k.tied;
    INFO(c10::toString(k.dtype) << " tied=" << k.tied << " max_shard_bytes=" << k.max_shard_bytes);
    TempDir dir("sbp_test_checkpoint_");
    sbp::Model model(config, k.dtype, 61);
    sbp::save_model_dir(model, dir.path(), k.max_shard_bytes);

    const bool sharded = k.max_shard_bytes == small_shards;
    CHECK(fs::exists(dir.path() / "model.safetensors.index.json") == sharded);
    CHECK(fs::exists(dir.path() / "model.safetensors") == !sharded);
    if (sharded) CHECK(safetensors_files(dir.path()).size() > 2);

    const auto loaded = sbp::load_model_dir(dir.path(), k.dtype);
    check_same_config(loaded->config(), config);
    CHECK(loaded->dtype() == k.dtype);
    const auto& expected = model.parameters();
    const auto& actual = loaded->parameters();
    REQUIRE(actual.size() == expected.size());
    for (std::size_t i = 0; i < expected.size(); ++i) {
      INFO(expected[i].name);
      CHECK(actual[i].name == expected[i].name);
      CHECK(at::equal(actual[i].tensor, expected[i].tensor));
    }

    const auto batch = sbp::random_sft_batch(config, {2, 21, 0.2, 0.1, 62});
    const auto before = run_step(model, "standard", batch);
    const auto after = run_step(*loaded, "standard", batch);
    CHECK(after.loss == before.loss);
    REQUIRE(after.gradients.size() == before.gradients.size());
    for (std::size_t i = 0; i < before.gradients.size(); ++i) {
      INFO(before.gradients[i].name);
      CHECK(at::equal(after.gradients[i].tensor, before.gradients[i].tensor));
    }
  }
}

TEST_CASE("config.json round-trips every model flag", "[checkpoint-io][config]") {
  ModelConfig qwen3 = sbp::test::tiny_config();
  qwen3.rms_norm_eps = 1e-5;
  qwen3.rope_theta = 10000;
  qwen3.max_position_embeddings = 2048;
  ModelConfig qwen2 = qwen3;  // q/k/v bias without o_proj bias and without qk_norm: written as model_type qwen2
  qwen2.qk_norm = false;
  qwen2.attention_bias = true;
  qwen2.tie_word_embeddings = false;
  ModelConfig llama = qwen3;
  llama.qk_norm = false;
  llama.num_key_value_heads = 4;
  ModelConfig everything = qwen3;  // no HF model_type has all three: the explicit keys must carry them
  everything.attention_bias = everything.o_proj_bias = true;
  ModelConfig o_bias_only = llama;
  o_bias_only.o_proj_bias = true;
  for (const auto& config : {qwen3, qwen2, llama, everything, o_bias_only}) {
    INFO(describe(config));
    TempDir dir("sbp_test_config_");
    sbp::test::write_bytes(dir.path() / "config.json", sbp::config_to_json(config, "float32"));
    check_same_config(sbp::read_config_json(dir.path() / "config.json"), config);
  }
}

namespace {

// The tiny preset's config.json as JSON, for the malformed-config tests to break one field at a time.
nlohmann::json valid_config_json() {
  return nlohmann::json::parse(sbp::config_to_json(sbp::test::tiny_config(), "float32"));
}

// read_config_json's error for `config` written to `file`.
std::string config_error(const nlohmann::json& config, const fs::path& file) {
  sbp::test::write_bytes(file, config.dump(2));
  return checkpoint_error_of([&] { sbp::read_config_json(file); });
}

}  // namespace

TEST_CASE("a malformed config.json is rejected naming the file and the field", "[checkpoint-io][config]") {
  TempDir dir("sbp_test_bad_config_");
  const fs::path file = dir.path() / "config.json";
  SECTION("missing required field") {
    auto j = valid_config_json();
    j.erase("hidden_size");
    const auto message = config_error(j, file);
    CHECK_THAT(message, Catch::Contains(file.string()) && Catch::Contains("hidden_size"));
  }
  SECTION("field of the wrong type") {
    auto j = valid_config_json();
    j["num_hidden_layers"] = "two";
    const auto message = config_error(j, file);
    CHECK_THAT(message, Catch::Contains(file.string()) && Catch::Contains("num_hidden_layers"));
  }
  SECTION("attention heads not a multiple of the KV heads") {
    auto j = valid_config_json();
    j["num_key_value_heads"] = 3;
    const auto message = config_error(j, file);
    CHECK_THAT(message, Catch::Contains(file.string()) && Catch::Contains("num_key_value_heads") &&
                            Catch::Contains("num_attention_heads"));
  }
  SECTION("unsupported model_type") {
    auto j = valid_config_json();
    j["model_type"] = "gpt2";
    const auto message = config_error(j, file);
    CHECK_THAT(message, Catch::Contains(file.string()) && Catch::Contains("model_type") && Catch::Contains("gpt2"));
  }
  // Found by fuzz_checkpoint (tests/fuzz/regressions/checkpoint): a float in an integer field was converted
  // (undefined behaviour beyond int64), a non-boolean use_sliding_window escaped as nlohmann's type_error without
  // the file's name, and sizes whose parameter count overflows int64 passed.
  SECTION("a number where an integer belongs") {
    for (const double value : {1e300, 64.5}) {
      auto j = valid_config_json();
      j["hidden_size"] = value;
      CHECK_THAT(config_error(j, file), Catch::Contains(file.string()) && Catch::Contains("hidden_size") &&
                                            Catch::Contains("wrong type"));
    }
  }
  SECTION("use_sliding_window that is not a boolean") {
    auto j = valid_config_json();
    j["use_sliding_window"] = "no";
    CHECK_THAT(config_error(j, file), Catch::Contains(file.string()) && Catch::Contains("use_sliding_window"));
  }
  SECTION("sizes beyond 2^62 parameters") {
    auto j = valid_config_json();
    j["vocab_size"] = std::int64_t{1} << 62;
    j["hidden_size"] = std::int64_t{1} << 62;
    CHECK_THAT(config_error(j, file), Catch::Contains(file.string()) && Catch::Contains("2^62 parameters"));
  }
  SECTION("not JSON") {
    sbp::test::write_bytes(file, "{\"hidden_size\": 64,");
    CHECK_THAT(checkpoint_error_of([&] { sbp::read_config_json(file); }), Catch::Contains(file.string()));
  }
}

namespace {

// A saved tiny checkpoint (fp32, untied, one file) whose files a test may then damage.
struct SavedCheckpoint {
  TempDir dir{"sbp_test_damaged_"};
  ModelConfig config;
  SavedCheckpoint() {
    config = sbp::test::tiny_config();
    config.tie_word_embeddings = false;
    sbp::Model model(config, at::kFloat, 71);
    sbp::save_model_dir(model, dir.path());
  }
  fs::path weights() const { return dir.path() / "model.safetensors"; }
  std::string load_error() const { return checkpoint_error_of([&] { sbp::load_model_dir(dir.path(), at::kFloat); }); }
};

}  // namespace

TEST_CASE("a truncated or corrupted model.safetensors is rejected naming the file", "[checkpoint-io]") {
  SavedCheckpoint checkpoint;
  const std::string bytes = sbp::test::read_bytes(checkpoint.weights());
  SECTION("truncated in the data") {
    sbp::test::write_bytes(checkpoint.weights(), bytes.substr(0, bytes.size() / 2));
    CHECK_THAT(checkpoint.load_error(), Catch::Contains(checkpoint.weights().string()));
  }
  SECTION("truncated in the header") {
    sbp::test::write_bytes(checkpoint.weights(), bytes.substr(0, 20));
    CHECK_THAT(checkpoint.load_error(), Catch::Contains(checkpoint.weights().string()));
  }
  SECTION("header bytes overwritten") {
    std::string corrupted = bytes;
    corrupted.replace(8, 16, std::string(16, '#'));
    sbp::test::write_bytes(checkpoint.weights(), corrupted);
    CHECK_THAT(checkpoint.load_error(), Catch::Contains(checkpoint.weights().string()));
  }
  SECTION("empty file") {
    sbp::test::write_bytes(checkpoint.weights(), "");
    CHECK_THAT(checkpoint.load_error(), Catch::Contains(checkpoint.weights().string()));
  }
}

TEST_CASE("a checkpoint with a missing, misshapen or unexpected tensor is rejected naming the tensor",
          "[checkpoint-io]") {
  SavedCheckpoint checkpoint;
  sbp::TensorList tensors = sbp::read_safetensors(checkpoint.weights());
  auto find = [&](const std::string& name) {
    for (auto& t : tensors)
      if (t.name == name) return &t;
    FAIL("no tensor " << name);
    return &tensors.front();
  };
  std::string named;
  SECTION("missing") {
    named = "model.layers.1.mlp.up_proj.weight";
    tensors.erase(tensors.begin() + (find(named) - tensors.data()));
  }
  SECTION("wrong shape") {
    named = "model.layers.0.mlp.gate_proj.weight";  // [I, d] = [128, 64] stored as [64, 128]
    find(named)->tensor = find(named)->tensor.t().contiguous();
  }
  SECTION("unexpected") {
    named = "model.layers.2.self_attn.q_proj.weight";  // the config has two layers
    tensors.push_back({named, at::zeros({64, 64})});
  }
  sbp::write_safetensors(checkpoint.weights(), tensors, {{"format", "pt"}});
  const auto message = checkpoint.load_error();
  CHECK_THAT(message, Catch::Contains(checkpoint.dir.path().string()) && Catch::Contains("'" + named + "'"));
}

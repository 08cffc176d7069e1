#include "tests/fuzz/fuzz_support.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "core/model/config.h"

namespace sbp::fuzz {

namespace fs = std::filesystem;

ModelConfig micro_config() {
  ModelConfig c;
  c.name = "micro";
  c.vocab_size = 64, c.hidden_size = 16, c.intermediate_size = 24, c.num_hidden_layers = 2;
  c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 4;
  c.tie_word_embeddings = false;
  return c;
}

std::vector<std::string_view> split_parts(const std::uint8_t* data, std::size_t size) {
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  std::vector<std::string_view> parts;
  std::size_t begin = 0;
  for (std::size_t at; (at = all.find(kPartSeparator, begin)) != std::string_view::npos;
       begin = at + kPartSeparator.size())
    parts.push_back(all.substr(begin, at - begin));
  parts.push_back(all.substr(begin));
  return parts;
}

std::string join_parts(const std::vector<std::string>& parts) {
  std::string out;
  for (std::size_t i = 0; i < parts.size(); ++i) out += (i ? std::string(kPartSeparator) : "") + parts[i];
  return out;
}

namespace {

void remove_scratch() {
  std::error_code ignored;
  fs::remove_all(scratch(), ignored);
}

}  // namespace

const fs::path& scratch() {
  static const fs::path dir = [] {
    const fs::path base = fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    fs::path d = base / ("streambp-fuzz-" + std::to_string(getpid()));
    fs::create_directories(d);
    std::atexit(remove_scratch);
    return d;
  }();
  return dir;
}

void clear_scratch() {
  for (const auto& entry : fs::directory_iterator(scratch())) fs::remove_all(entry.path());
}

fs::path put(const std::string& name, std::string_view bytes) {
  const fs::path file = scratch() / name;
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) finding("cannot write the scratch file " + file.string());
  return file;
}

fs::path put_folder(const std::string& folder, const std::vector<std::string_view>& parts,
                    const std::vector<std::string>& names) {
  clear_scratch();
  fs::create_directory(scratch() / folder);
  for (std::size_t i = 0; i < parts.size() && i < names.size(); ++i) put(folder + "/" + names[i], parts[i]);
  return scratch() / folder;
}

void finding(const std::string& message) {
  std::fprintf(stderr, "\nFUZZ FINDING: %s\n", message.c_str());
  std::abort();
}

bool refuses_cleanly(const std::string& what, const std::string& must_name, const std::function<void()>& body) {
  try {
    body();
    return true;
  } catch (const std::exception& e) {
    const std::string message = e.what();
    if (message.find(must_name) == std::string::npos)
      finding(what + " refused without naming '" + must_name + "': " + message);
    return false;
  } catch (...) {
    finding(what + " threw something that is not a std::exception");
  }
}

}  // namespace sbp::fuzz

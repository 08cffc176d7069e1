// What the fuzz targets share (issue #22): an input becomes files in a private scratch folder, and a reader's
// refusal is judged by one rule.
//
// The rule: a reader handed garbage either succeeds or throws a std::exception whose message names the file (or, for
// text, the flag or spec) at fault, as every refusal of the harness must. Anything else is a finding and aborts, so
// that libFuzzer keeps the input: a crash or a sanitizer report, an exception of another kind (e.g. nlohmann's
// "type must be string" or a bare "stoull" escaping a reader) or a message that does not say which file is broken.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace sbp {
struct ModelConfig;
}

namespace sbp::fuzz {

// The model of the inputs that need one (adapters, batches) and of the seed corpora: two small layers, grouped-query
// attention, so that every check of a shape has two different numbers to compare.
ModelConfig micro_config();

// A multi-file input (an index and its shards, a config and its weights, a CSV and its sidecar) is one byte string
// with its files joined by this line; a single-file target takes the input whole.
inline constexpr std::string_view kPartSeparator = "\n--streambp-fuzz-part--\n";
std::vector<std::string_view> split_parts(const std::uint8_t* data, std::size_t size);
std::string join_parts(const std::vector<std::string>& parts);

// This process's scratch folder (under /dev/shm when there is one: a file per input is the fuzzers' main cost),
// emptied by clear_scratch() and removed at exit.
const std::filesystem::path& scratch();
void clear_scratch();
// Writes `bytes` to scratch()/name and returns the path.
std::filesystem::path put(const std::string& name, std::string_view bytes);
// Empties the scratch folder and writes a multi-file input's parts as the files `names` of scratch()/folder (part i
// under names[i]; a name without a part is left absent, a part without a name ignored). Returns the folder.
std::filesystem::path put_folder(const std::string& folder, const std::vector<std::string_view>& parts,
                                 const std::vector<std::string>& names);

// Runs `body` under the rule above: returns true when it finished, false when it refused with a message containing
// `must_name`; aborts (a finding, printed with `what` and the message) otherwise.
bool refuses_cleanly(const std::string& what, const std::string& must_name, const std::function<void()>& body);

// Aborts with a message: a property of a successful read does not hold (e.g. a round trip changed a tensor).
[[noreturn]] void finding(const std::string& message);

}  // namespace sbp::fuzz

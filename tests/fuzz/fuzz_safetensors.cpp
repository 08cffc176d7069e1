// libFuzzer target: one .safetensors file through read_safetensors_metadata and read_safetensors. Beyond the refusal
// rule (fuzz_support.h): both readers validate the same header, so they accept the same files; and a file that reads
// survives a round trip (written back, read again: the same names, dtypes, shapes, bytes and metadata).
#include <ATen/ATen.h>

#include <cstring>

#include "core/io/safetensors.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  const auto bytes = static_cast<std::size_t>(a.numel()) * a.element_size();
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         (bytes == 0 || std::memcmp(a.data_ptr(), b.data_ptr(), bytes) == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace sbp::fuzz;
  clear_scratch();
  const auto file = put("in.safetensors", {reinterpret_cast<const char*>(data), size});
  std::map<std::string, std::string> metadata;
  sbp::TensorList tensors;
  const bool header_ok = refuses_cleanly("read_safetensors_metadata", file.string(),
                                         [&] { metadata = sbp::read_safetensors_metadata(file); });
  const bool tensors_ok =
      refuses_cleanly("read_safetensors", file.string(), [&] { tensors = sbp::read_safetensors(file); });
  if (header_ok != tensors_ok) finding("read_safetensors_metadata and read_safetensors disagree on a file");
  if (!tensors_ok) return 0;

  const auto copy = scratch() / "copy.safetensors";
  sbp::write_safetensors(copy, tensors, metadata);
  const auto again = sbp::read_safetensors(copy);
  if (sbp::read_safetensors_metadata(copy) != metadata) finding("the round trip changed the metadata");
  if (again.size() != tensors.size()) finding("the round trip changed the number of tensors");
  for (std::size_t i = 0; i < tensors.size(); ++i)
    if (again[i].name != tensors[i].name || !same_bytes(again[i].tensor, tensors[i].tensor))
      finding("the round trip changed tensor '" + tensors[i].name + "'");
  return 0;
}

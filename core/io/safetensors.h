// safetensors checkpoint I/O (ARCHITECTURE.md §3): single files, HF checkpoint folders (plain or sharded with an index), and
// the atomic file write the rest of the project uses for anything it saves.
//
// File format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N, N bytes of JSON
// (name -> {"dtype", "shape", "data_offsets": [begin, end]} plus an optional "__metadata__" string map; offsets are
// relative to the start of the data section), then the data: little-endian, C order, no gaps.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/io/input_error.h"

namespace sbp {

struct NamedTensor {
  std::string name;
  at::Tensor tensor;
};
// A list rather than a map: keeps file order on reading and caller order on writing.
using TensorList = std::vector<NamedTensor>;

// A file or folder that is not a valid safetensors checkpoint. The message starts with the path at fault and names
// the tensor (as `tensor '<name>'`) when one is.
class FormatError : public InputError {
  using InputError::InputError;
};

// One .safetensors file -> contiguous CPU tensors that own their memory, in the order of their data in the file.
TensorList read_safetensors(const std::filesystem::path& file);

// The "__metadata__" string map of a file (empty when it has none). Validates the whole header.
std::map<std::string, std::string> read_safetensors_metadata(const std::filesystem::path& file);

// An HF checkpoint folder: model.safetensors if present (HF prefers it too), else model.safetensors.index.json
// ("weight_map": name -> shard file) plus its shards, returned shard by shard (shards in file-name order). Index and
// shards must agree exactly: a shard that is missing, a tensor listed but absent, or a tensor found in a shard the
// index does not assign it to (including a second copy) is a FormatError naming the folder or file.
TensorList read_safetensors_dir(const std::filesystem::path& dir);

// Writes atomically (temporary file in the same folder, then rename): never a half-written file at `file`.
// Tensors are laid out in the given order; non-contiguous or non-CPU tensors are copied one at a time while writing.
// An unsupported dtype, a duplicate name or the reserved name "__metadata__" is a FormatError, and nothing is written.
// Note: HF transformers refuses files whose metadata is present but lacks "format": "pt".
void write_safetensors(const std::filesystem::path& file, const TensorList& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes model.safetensors when the tensor bytes fit in max_shard_bytes, else model-00001-of-0000N.safetensors ...
// (filled greedily in order; a tensor larger than the limit gets a shard of its own) plus
// model.safetensors.index.json ({"metadata": {"total_size": N}, "weight_map": {...}}), each file atomically. The
// index is written after its shards, and the entry point of the other layout is removed last, so a reader of the
// folder sees either the old or the new checkpoint. `metadata` goes into every file. Creates `dir` if needed.
void write_safetensors_dir(const std::filesystem::path& dir, const TensorList& tensors, std::uint64_t max_shard_bytes,
                           const std::map<std::string, std::string>& metadata = {});

// Writes `bytes` to a temporary file next to `file`, flushes it to disk, then renames it over `file`. Throws
// std::system_error / std::filesystem::filesystem_error naming the file on failure, leaving `file` untouched.
void write_file_atomically(const std::filesystem::path& file, const std::string& bytes);

}  // namespace sbp

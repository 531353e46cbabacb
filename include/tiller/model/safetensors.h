// safetensors files and Hugging Face checkpoint directories.
//
// Reading memory-maps the file (copy-on-write: writing into a returned tensor never touches the
// file) and validates the whole header before any tensor is handed out: header length inside
// the file, JSON well formed, every dtype known, shapes non-negative, every tensor's byte range
// exactly numel x element size, inside the data area, and no two ranges overlapping. A truncated
// or corrupt file fails with IoError naming the file and the tensor; it never yields garbage.
//
// Tensors returned by a reader are CPU views of the mapping; the mapping lives as long as any of
// them (or the reader) does. Not thread-safe for concurrent opening; the tensors are ordinary
// tensors afterwards.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace tiller::model {

using NamedTensors = std::map<std::string, at::Tensor>;

struct TensorEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets inside the data area
  uint64_t end = 0;
};

class SafetensorsFile {
 public:
  // Maps and validates `path`; throws IoError.
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;

  const std::string& path() const;
  const std::vector<TensorEntry>& entries() const;  // in file order
  const std::map<std::string, std::string>& metadata() const;
  bool contains(const std::string& name) const;
  // A CPU tensor viewing the mapping (copied only if the data is misaligned for its dtype).
  at::Tensor tensor(const std::string& name) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A Hugging Face checkpoint directory: model.safetensors, or shards listed in
// model.safetensors.index.json (every listed file must exist and hold the tensors the index says).
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& dir);
  ~CheckpointReader();

  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  const TensorEntry& entry(const std::string& name) const;
  at::Tensor tensor(const std::string& name) const;
  // Every tensor, as views of the mappings.
  NamedTensors all() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Writes one safetensors file: tensors in name order, header padded to 8 bytes, metadata
// {"format": "pt"} plus `metadata`. Written to a temporary name, fsync'ed and renamed, so a crash
// never leaves a half-written file under `path`. Tensors may live on any device and be
// non-contiguous.
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes a checkpoint directory the way transformers does: model.safetensors when everything
// fits in `max_shard_bytes`, else model-0000i-of-0000n.safetensors plus
// model.safetensors.index.json. Stale files of an earlier save (other shard counts) are removed.
void write_checkpoint(const std::string& dir, const NamedTensors& tensors, uint64_t max_shard_bytes = 5ull << 30);

// "F32" <-> at::kFloat etc.; throws IoError for an unknown name.
at::ScalarType dtype_from_safetensors(const std::string& name);
const char* dtype_to_safetensors(at::ScalarType t);

}  // namespace tiller::model

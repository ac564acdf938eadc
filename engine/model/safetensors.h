// Reader of Hugging Face safetensors checkpoints: each file is mapped read-only and its
// JSON header validated and indexed by tensor name (dtype, shape, byte range); a
// Checkpoint gathers a folder's files through model.safetensors.index.json or by scanning.
// The files are untrusted input: every range is checked before anything reads it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace latentd::engine::model {

// Every dtype the safetensors format names. Sub-byte types (F4, F6_*) pack their values;
// a tensor of them must fill whole bytes.
enum class TensorDType {
  kBool, kU8, kI8, kF8E4M3, kF8E5M2, kF8E8M0, kI16, kU16, kF16, kBF16,
  kI32, kU32, kF32, kI64, kU64, kF64, kF4, kF6E2M3, kF6E3M2,
};

// The header's spelling ("BF16", "F8_E4M3", ...).
const char* TensorDTypeName(TensorDType dtype);
int TensorDTypeBits(TensorDType dtype);
std::optional<TensorDType> ParseTensorDType(absl::string_view name);

struct TensorInfo {
  std::string name;
  TensorDType dtype = TensorDType::kF32;
  std::vector<int64_t> shape;
  // Byte range [begin, end) relative to the start of the data section.
  uint64_t begin = 0;
  uint64_t end = 0;

  int64_t num_elements() const;
  uint64_t num_bytes() const { return end - begin; }
};

// "[96, 136]"
std::string ShapeString(absl::Span<const int64_t> shape);

// A parsed and validated header.
struct SafetensorsHeader {
  uint64_t data_offset = 0;  // 8 + header length: where the data section starts
  std::vector<TensorInfo> tensors;  // in ascending order of begin
  std::map<std::string, std::string> metadata;  // __metadata__'s string values
};

// Header limit of the reference implementation: anything larger is not a checkpoint.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// Parses and validates a whole file's bytes; `file` names it in errors (DATA_LOSS for a
// truncated file, INVALID_ARGUMENT otherwise). Checks: the 8-byte little-endian header
// length fits the file (and the limit); the header is a JSON object without duplicate
// keys; every tensor has a known dtype, a shape of non-negative integers and
// data_offsets [begin, end] inside the data section with end - begin = the product of
// the shape x the dtype's size; no two tensors' bytes overlap.
absl::StatusOr<SafetensorsHeader> ParseSafetensors(const uint8_t* data, size_t size,
                                                   const std::string& file);

// One mapped *.safetensors file.
class SafetensorsFile {
 public:
  // Maps `path` read-only and parses its header.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  const TensorInfo* Find(absl::string_view name) const;
  // The tensor's bytes (validated to lie inside the mapping).
  absl::Span<const uint8_t> Data(const TensorInfo& t) const;

 private:
  SafetensorsFile() = default;

  std::string path_;
  const uint8_t* map_ = nullptr;
  size_t size_ = 0;
  SafetensorsHeader header_;
  absl::flat_hash_map<std::string, size_t> by_name_;
};

// The tensors of a checkpoint folder.
class Checkpoint {
 public:
  struct Entry {
    const SafetensorsFile* file;
    const TensorInfo* info;
  };

  // With DIR/model.safetensors.index.json: opens every file its weight_map names, and
  // each mapped tensor must be in its file. Without: opens every DIR/*.safetensors, and a
  // tensor name may occur in one file only. NOT_FOUND when the folder has neither.
  static absl::StatusOr<Checkpoint> Open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  // The index file when there is one, else the folder: what errors about a tensor
  // that is not there name.
  const std::string& source() const { return source_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  std::optional<Entry> Find(absl::string_view name) const;
  size_t num_tensors() const { return entries_.size(); }

 private:
  std::string dir_;
  std::string source_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  absl::flat_hash_map<std::string, Entry> entries_;
};

}  // namespace latentd::engine::model

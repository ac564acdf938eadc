// safetensors header validation (nlohmann-json), file mapping and folder indexing.
#include "engine/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/model/json.h"
#include "nlohmann/json.hpp"

namespace latentd::engine::model {
namespace {

using Json = nlohmann::json;

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors stores little-endian values; this reader assumes a little-endian host");

struct DTypeRow {
  TensorDType dtype;
  const char* name;
  int bits;
};

constexpr DTypeRow kDTypes[] = {
    {TensorDType::kBool, "BOOL", 8},       {TensorDType::kU8, "U8", 8},
    {TensorDType::kI8, "I8", 8},           {TensorDType::kF8E4M3, "F8_E4M3", 8},
    {TensorDType::kF8E5M2, "F8_E5M2", 8},  {TensorDType::kF8E8M0, "F8_E8M0", 8},
    {TensorDType::kI16, "I16", 16},        {TensorDType::kU16, "U16", 16},
    {TensorDType::kF16, "F16", 16},        {TensorDType::kBF16, "BF16", 16},
    {TensorDType::kI32, "I32", 32},        {TensorDType::kU32, "U32", 32},
    {TensorDType::kF32, "F32", 32},        {TensorDType::kI64, "I64", 64},
    {TensorDType::kU64, "U64", 64},        {TensorDType::kF64, "F64", 64},
    {TensorDType::kF4, "F4", 4},           {TensorDType::kF6E2M3, "F6_E2M3", 6},
    {TensorDType::kF6E3M2, "F6_E3M2", 6},
};

const DTypeRow& Row(TensorDType d) {
  for (const DTypeRow& r : kDTypes) {
    if (r.dtype == d) return r;
  }
  return kDTypes[0];
}

std::string KnownDTypes() {
  std::vector<std::string> names;
  for (const DTypeRow& r : kDTypes) names.push_back(r.name);
  return absl::StrJoin(names, ", ");
}

std::string Shown(const Json& v) { return ShownJson(v); }

// Shown(name) as JSON writes it, so a hostile name prints without control bytes.
std::string Quoted(const std::string& name) { return Shown(Json(name)); }

absl::Status Invalid(const std::string& file, absl::string_view tensor, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": tensor ", tensor, ": ", what));
}

// Parses one tensor entry of the header.
absl::Status ParseTensor(const std::string& file, const std::string& name, const Json& v,
                         uint64_t data_bytes, TensorInfo& t) {
  const std::string q = Quoted(name);
  if (!v.is_object()) return Invalid(file, q, absl::StrCat("expected an object {dtype, shape, data_offsets}, got ", Shown(v)));
  t.name = name;
  auto dt = v.find("dtype");
  if (dt == v.end() || !dt->is_string()) {
    return Invalid(file, q, absl::StrCat("dtype: expected a string, got ", dt == v.end() ? "nothing" : Shown(*dt)));
  }
  std::optional<TensorDType> d = ParseTensorDType(dt->get<std::string>());
  if (!d.has_value()) {
    return Invalid(file, q, absl::StrCat("unknown dtype ", Shown(*dt), "; expected one of ", KnownDTypes()));
  }
  t.dtype = *d;
  auto sh = v.find("shape");
  if (sh == v.end() || !sh->is_array()) {
    return Invalid(file, q, absl::StrCat("shape: expected an array of non-negative integers, got ",
                                         sh == v.end() ? "nothing" : Shown(*sh)));
  }
  // The element count in bits, overflow-checked as it grows.
  uint64_t bits = static_cast<uint64_t>(TensorDTypeBits(t.dtype));
  for (const Json& e : *sh) {
    if (!e.is_number_unsigned()) {
      return Invalid(file, q, absl::StrCat("shape: expected an array of non-negative integers, got ", Shown(*sh)));
    }
    const uint64_t n = e.get<uint64_t>();
    if (n > static_cast<uint64_t>(INT64_MAX) || __builtin_mul_overflow(bits, n, &bits)) {
      return Invalid(file, q, absl::StrCat("shape ", Shown(*sh), " is too large"));
    }
    t.shape.push_back(static_cast<int64_t>(n));
  }
  if (bits % 8 != 0) {
    return Invalid(file, q, absl::StrCat("shape ", Shown(*sh), " of ", TensorDTypeName(t.dtype),
                                         " does not fill whole bytes"));
  }
  const uint64_t expected_bytes = bits / 8;
  auto off = v.find("data_offsets");
  if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
      !(*off)[1].is_number_unsigned()) {
    return Invalid(file, q, absl::StrCat("data_offsets: expected [begin, end], two non-negative integers, got ",
                                         off == v.end() ? "nothing" : Shown(*off)));
  }
  t.begin = (*off)[0].get<uint64_t>();
  t.end = (*off)[1].get<uint64_t>();
  if (t.begin > t.end) {
    return Invalid(file, q, absl::StrCat("data_offsets [", t.begin, ", ", t.end, "]: begin is past end"));
  }
  if (t.end > data_bytes) {
    return Invalid(file, q, absl::StrCat("data_offsets [", t.begin, ", ", t.end, "] run past the ", data_bytes,
                                         "-byte data section (a truncated file?)"));
  }
  if (t.end - t.begin != expected_bytes) {
    return Invalid(file, q, absl::StrCat("data_offsets [", t.begin, ", ", t.end, "] hold ", t.end - t.begin,
                                         " bytes; shape ", ShapeString(t.shape), " of ", TensorDTypeName(t.dtype),
                                         " needs ", expected_bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  return text.str();
}

bool EndsWith(const std::string& s, absl::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix.data()) == 0;
}

}  // namespace

const char* TensorDTypeName(TensorDType dtype) { return Row(dtype).name; }
int TensorDTypeBits(TensorDType dtype) { return Row(dtype).bits; }

std::optional<TensorDType> ParseTensorDType(absl::string_view name) {
  for (const DTypeRow& r : kDTypes) {
    if (name == r.name) return r.dtype;
  }
  return std::nullopt;
}

int64_t TensorInfo::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // bounded: the header check proved bits fit in 64 bits
  return n;
}

std::string ShapeString(absl::Span<const int64_t> shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

absl::StatusOr<SafetensorsHeader> ParseSafetensors(const uint8_t* data, size_t size, const std::string& file) {
  if (size < 8) {
    return absl::DataLossError(
        absl::StrCat(file, ": ", size, " bytes, shorter than the 8-byte header length (a truncated file?)"));
  }
  uint64_t header_len;
  std::memcpy(&header_len, data, 8);
  if (header_len > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": header length ", header_len, " is over the limit of ",
                                                   kMaxSafetensorsHeaderBytes, " bytes (not a safetensors file?)"));
  }
  if (header_len > size - 8) {
    return absl::DataLossError(absl::StrCat(file, ": header length ", header_len, " exceeds the ", size - 8,
                                            " bytes after it (a truncated file?)"));
  }
  // A real header nests three levels: {name: {shape: [...]}}.
  absl::StatusOr<Json> parsed = ParseJson(
      absl::string_view(reinterpret_cast<const char*>(data + 8), header_len), file + ": header", 8);
  if (!parsed.ok()) return parsed.status();
  const Json& j = *parsed;
  if (!j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": header: expected a JSON object, got ", Shown(j)));
  }
  SafetensorsHeader h;
  h.data_offset = 8 + header_len;
  const uint64_t data_bytes = size - h.data_offset;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat(file, ": __metadata__: expected an object of strings, got ", Shown(*it)));
      }
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (m->is_string()) h.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    TensorInfo t;
    if (absl::Status s = ParseTensor(file, it.key(), *it, data_bytes, t); !s.ok()) return s;
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  // Sorted by begin, two non-empty ranges overlap exactly when one starts before the end
  // of the furthest-reaching range before it.
  const TensorInfo* reach = nullptr;
  for (const TensorInfo& t : h.tensors) {
    if (t.begin == t.end) continue;
    if (reach != nullptr && t.begin < reach->end) {
      return Invalid(file, Quoted(t.name),
                     absl::StrCat("data_offsets [", t.begin, ", ", t.end, "] overlap those of ", Quoted(reach->name),
                                  " [", reach->begin, ", ", reach->end, "]"));
    }
    if (reach == nullptr || t.end > reach->end) reach = &t;
  }
  return h;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->size_ = static_cast<size_t>(st.st_size);
  if (f->size_ > 0) {
    void* m = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat(path, ": mmap failed: ", std::strerror(err)));
    }
    f->map_ = static_cast<const uint8_t*>(m);
  }
  ::close(fd);  // the mapping keeps the file
  absl::StatusOr<SafetensorsHeader> h = ParseSafetensors(f->map_, f->size_, path);
  if (!h.ok()) return h.status();
  f->header_ = *std::move(h);
  for (size_t i = 0; i < f->header_.tensors.size(); ++i) f->by_name_[f->header_.tensors[i].name] = i;
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), size_);
}

const TensorInfo* SafetensorsFile::Find(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &header_.tensors[it->second];
}

absl::Span<const uint8_t> SafetensorsFile::Data(const TensorInfo& t) const {
  return absl::Span<const uint8_t>(map_ + header_.data_offset + t.begin, t.num_bytes());
}

absl::StatusOr<Checkpoint> Checkpoint::Open(const std::string& dir) {
  namespace fs = std::filesystem;
  Checkpoint c;
  c.dir_ = dir;
  const std::string index_path = absl::StrCat(dir, "/model.safetensors.index.json");
  std::error_code ec;
  if (fs::exists(index_path, ec)) {
    c.source_ = index_path;
    absl::StatusOr<std::string> text = ReadSmallFile(index_path);
    if (!text.ok()) return text.status();
    absl::StatusOr<Json> parsed = ParseJson(*text, index_path, 8);
    if (!parsed.ok()) return parsed.status();
    const Json& j = *parsed;
    const Json* map = nullptr;
    if (j.is_object()) {
      auto it = j.find("weight_map");
      if (it != j.end()) map = &*it;
    }
    if (map == nullptr || !map->is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": weight_map: expected an object {tensor name: file name}"));
    }
    absl::flat_hash_map<std::string, const SafetensorsFile*> opened;
    for (auto it = map->begin(); it != map->end(); ++it) {
      const std::string tensor = Quoted(it.key());
      if (!it->is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": weight_map: tensor ", tensor, ": expected a file name, got ", Shown(*it)));
      }
      const std::string name = it->get<std::string>();
      // The index is untrusted too: it may name files of this folder only.
      if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
        return absl::InvalidArgumentError(absl::StrCat(index_path, ": weight_map: tensor ", tensor, ": ",
                                                       Quoted(name), " is not a file name in the folder"));
      }
      auto f = opened.find(name);
      if (f == opened.end()) {
        absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(absl::StrCat(dir, "/", name));
        if (!file.ok()) {
          return absl::Status(file.status().code(),
                              absl::StrCat(file.status().message(), " (named by ", index_path, ")"));
        }
        c.files_.push_back(*std::move(file));
        f = opened.emplace(name, c.files_.back().get()).first;
      }
      const TensorInfo* info = f->second->Find(it.key());
      if (info == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(f->second->path(), ": tensor ", tensor, ": missing, though ",
                                                       index_path, " maps it to this file"));
      }
      c.entries_[it.key()] = Entry{f->second, info};
    }
    return c;
  }
  c.source_ = dir;
  std::vector<std::string> paths;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string p = it->path().string();
    if (EndsWith(p, ".safetensors") && it->is_regular_file(ec)) paths.push_back(p);
  }
  if (ec) return absl::NotFoundError(absl::StrCat(dir, ": cannot list the folder: ", ec.message()));
  if (paths.empty()) {
    return absl::NotFoundError(
        absl::StrCat(dir, ": no *.safetensors files and no model.safetensors.index.json"));
  }
  std::sort(paths.begin(), paths.end());
  for (const std::string& p : paths) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(p);
    if (!file.ok()) return file.status();
    c.files_.push_back(*std::move(file));
    const SafetensorsFile* f = c.files_.back().get();
    for (const TensorInfo& t : f->tensors()) {
      auto [it, inserted] = c.entries_.emplace(t.name, Entry{f, &t});
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat(p, ": tensor ", Quoted(t.name), ": also in ",
                                                       it->second.file->path(), " (which copy is meant?)"));
      }
    }
  }
  return c;
}

std::optional<Checkpoint::Entry> Checkpoint::Find(absl::string_view name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) return std::nullopt;
  return it->second;
}

}  // namespace latentd::engine::model

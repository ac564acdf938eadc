// The shared region of the same-host data plane: a sealed memory file the daemon makes
// and maps for one Decode stream, which the stream's client maps too, so a step's
// tensors travel through shared memory instead of gRPC messages.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace latentd::server::dataplane {

// A sealed memory file of a fixed size (it can neither shrink, which would make the
// daemon's reads fault, nor grow), mapped read-write here. Move-only; unmapped and
// closed when destroyed.
class SharedFile {
 public:
  // RESOURCE_EXHAUSTED with the errno's text on failure, with nothing left open.
  static absl::StatusOr<SharedFile> Make(const char* name, uint64_t bytes);

  SharedFile() = default;
  SharedFile(SharedFile&& other) noexcept;
  SharedFile& operator=(SharedFile&& other) noexcept;
  SharedFile(const SharedFile&) = delete;
  SharedFile& operator=(const SharedFile&) = delete;
  ~SharedFile();

  bool empty() const { return map_ == nullptr; }
  char* data() const { return map_; }
  uint64_t bytes() const { return bytes_; }
  int fd() const { return fd_; }
  // The path a process on this host opens the file by (while fd() is open).
  std::string ProcPath() const;
  // Closes the descriptor, keeping the mapping: once the file was handed to its client,
  // the daemon holds no way of giving it to anyone else.
  void CloseFd();

 private:
  SharedFile(int fd, char* map, uint64_t bytes) : fd_(fd), map_(map), bytes_(bytes) {}
  void Reset();

  int fd_ = -1;
  char* map_ = nullptr;
  uint64_t bytes_ = 0;
};

}  // namespace latentd::server::dataplane

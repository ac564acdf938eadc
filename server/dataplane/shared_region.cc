// Making, sealing and mapping a stream's shared memory file (shared_region.h).
#include "server/dataplane/shared_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace latentd::server::dataplane {

absl::StatusOr<SharedFile> SharedFile::Make(const char* name, uint64_t bytes) {
  const int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  void* map = MAP_FAILED;
  if (fd >= 0 && ftruncate(fd, static_cast<off_t>(bytes)) == 0 &&
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0) {
    map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  if (map == MAP_FAILED) {
    const int err = errno;
    if (fd >= 0) close(fd);
    return absl::ResourceExhaustedError(strerror(err));
  }
  return SharedFile(fd, static_cast<char*>(map), bytes);
}

SharedFile::SharedFile(SharedFile&& other) noexcept : fd_(other.fd_), map_(other.map_), bytes_(other.bytes_) {
  other.fd_ = -1;
  other.map_ = nullptr;
  other.bytes_ = 0;
}

SharedFile& SharedFile::operator=(SharedFile&& other) noexcept {
  if (this != &other) {
    Reset();
    fd_ = other.fd_;
    map_ = other.map_;
    bytes_ = other.bytes_;
    other.fd_ = -1;
    other.map_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

SharedFile::~SharedFile() { Reset(); }

void SharedFile::Reset() {
  if (map_ != nullptr) munmap(map_, bytes_);
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  map_ = nullptr;
  bytes_ = 0;
}

void SharedFile::CloseFd() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

std::string SharedFile::ProcPath() const { return absl::StrCat("/proc/", getpid(), "/fd/", fd_); }

}  // namespace latentd::server::dataplane

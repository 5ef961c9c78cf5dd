#include "csrc/core/disk/state_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace hipferry::disk {
namespace {

[[noreturn]] void fail(const std::string& what, const std::string& path, int error) {
  throw IoFailure(what + " '" + path + "': " + std::strerror(error), path, 0, error);
}

void require_open(const FileRef& file, const char* function) {
  if (file.fd < 0) {
    throw std::invalid_argument(std::string(function) + ": file '" + file.path + "' is not open (fd " +
                                std::to_string(file.fd) + ")");
  }
}

}  // namespace

OpenedFile open_state_file(const std::string& path, bool create, bool allow_direct) {
  if (path.empty()) throw std::invalid_argument("open_state_file: path must not be empty");
  // 0600: optimizer state is the user's own scratch data.
  const int flags = O_RDWR | O_CLOEXEC | (create ? O_CREAT : 0);
  OpenedFile opened;
  opened.file.path = path;
  int fd = -1;
  if (allow_direct) {
    fd = ::open(path.c_str(), flags | O_DIRECT, 0600);
    if (fd >= 0) {
      opened.direct = true;
    } else if (errno == EINVAL) {
      // tmpfs (and some FUSE and network file systems) take no O_DIRECT:
      // buffered I/O still works, through the page cache.
      fd = ::open(path.c_str(), flags, 0600);
      opened.note = "O_DIRECT refused by the file system (EINVAL): buffered I/O";
    }
  } else {
    fd = ::open(path.c_str(), flags, 0600);
    opened.note = "O_DIRECT turned off: buffered I/O";
  }
  if (fd < 0) fail(create ? "cannot open or create" : "cannot open", path, errno);
  opened.file.fd = fd;
  return opened;
}

void reserve(const FileRef& file, std::uint64_t bytes) {
  require_open(file, "reserve");
  if (bytes == 0) return;  // (posix_fallocate calls a length of 0 EINVAL)
  if (bytes > static_cast<std::uint64_t>(std::numeric_limits<off_t>::max())) {
    fail("cannot reserve " + std::to_string(bytes) + " bytes for", file.path, EFBIG);
  }
  int error;
  // posix_fallocate returns the error; it leaves errno alone.
  do {
    error = ::posix_fallocate(file.fd, 0, static_cast<off_t>(bytes));
  } while (error == EINTR);
  if (error != 0) fail("cannot reserve " + std::to_string(bytes) + " bytes for", file.path, error);
}

void sync_data(const FileRef& file) {
  require_open(file, "sync_data");
  int ret;
  do {
    ret = ::fdatasync(file.fd);
  } while (ret != 0 && errno == EINTR);
  if (ret != 0) fail("fdatasync failed for", file.path, errno);
}

void close_file(FileRef* file) {
  if (file == nullptr || file->fd < 0) return;
  // Linux frees the descriptor even when close reports an error, so there
  // is nothing to retry; durability was sync_data's job.
  ::close(file->fd);
  file->fd = -1;
}

}  // namespace hipferry::disk

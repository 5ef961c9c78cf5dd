// Test helpers for the disk store's real-file tests: a temporary folder
// (removed with everything in it) and page-aligned buffers for O_DIRECT.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>

namespace hipferry::disk::testing {

// A fresh folder under `parent` (default /tmp: the machine's real disk, so
// O_DIRECT applies; tmpfs would refuse it).
class TempDir {
 public:
  explicit TempDir(const std::string& parent = "/tmp") {
    std::string pattern = parent + "/hipferry-disk-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      ADD_FAILURE() << "mkdtemp in " << parent << ": " << std::strerror(errno);
    } else {
      path_ = pattern;
    }
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBytes = std::unique_ptr<unsigned char[], FreeDeleter>;

// `bytes` at a 4096-byte boundary (O_DIRECT's buffer alignment).
inline AlignedBytes aligned_bytes(std::size_t bytes) {
  void* p = nullptr;
  if (::posix_memalign(&p, 4096, bytes == 0 ? 4096 : bytes) != 0) return AlignedBytes(nullptr);
  return AlignedBytes(static_cast<unsigned char*>(p));
}

}  // namespace hipferry::disk::testing

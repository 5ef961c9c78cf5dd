// Opening the disk store's files: O_DIRECT where the file system takes it
// (ext4, xfs, btrfs), buffered I/O where it refuses (tmpfs: EINVAL), with the
// reason kept for doctor and a one-time warning. Sizes are reserved up front
// with fallocate, so "no space" shows at creation, never in a step.
#pragma once

#include <cstdint>
#include <string>

#include "csrc/core/disk/io_queue.h"

namespace hipferry::disk {

// What O_DIRECT needs of offsets, sizes and buffer addresses here (the
// common logical block size of NVMe drives and the page size).
constexpr std::size_t kDirectAlignment = 4096;

struct OpenedFile {
  FileRef file;
  bool direct = false;  // opened with O_DIRECT
  std::string note;     // why not O_DIRECT ("" when direct)
};

// Opens `path` read-write (creating it when `create`), O_DIRECT unless
// `allow_direct` is false or the file system refuses it. Throws IoFailure
// (naming the path) on any other error.
OpenedFile open_state_file(const std::string& path, bool create, bool allow_direct);

// Reserves `bytes` for the file (posix_fallocate): throws IoFailure with
// ENOSPC (or the error) naming the path when the disk is full.
void reserve(const FileRef& file, std::uint64_t bytes);

// fdatasync: the bytes written so far survive a power cut. Throws IoFailure.
void sync_data(const FileRef& file);

// Closes the descriptor (idempotent).
void close_file(FileRef* file);

}  // namespace hipferry::disk

// Opening, reserving, syncing and closing the disk store's files: O_DIRECT on
// the real disk, the buffered fallback on tmpfs with its note, and errors
// that name the path.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "csrc/core/disk/state_file.h"
#include "tests/cpp/disk_temp_files.h"

namespace hipferry::disk {
namespace {

using testing::aligned_bytes;
using testing::TempDir;

bool on_tmpfs(const std::string& path) {
  struct statfs s {};
  return ::statfs(path.c_str(), &s) == 0 && s.f_type == TMPFS_MAGIC;
}

std::uint64_t size_of(const FileRef& f) {
  struct stat st {};
  EXPECT_EQ(::fstat(f.fd, &st), 0) << std::strerror(errno);
  return static_cast<std::uint64_t>(st.st_size);
}

// The message names the path and the cause, and the exception carries the errno.
void expect_failure_names(const IoFailure& e, const std::string& path, int error) {
  const std::string what = e.what();
  EXPECT_NE(what.find(path), std::string::npos) << what;
  EXPECT_NE(what.find(std::strerror(error)), std::string::npos) << what;
  EXPECT_EQ(e.path, path);
  EXPECT_EQ(e.error, error) << what;
}

TEST(StateFile, DirectOnTheDiskAndAReservedSize) {
  TempDir dir;
  if (on_tmpfs(dir.path())) GTEST_SKIP() << dir.path() << " is tmpfs here";
  OpenedFile f = open_state_file(dir.file("a.bin"), true, true);
  EXPECT_GE(f.file.fd, 0);
  EXPECT_EQ(f.file.path, dir.file("a.bin"));
  // ext4, xfs and btrfs take O_DIRECT; anything else must say why not.
  if (f.direct)
    EXPECT_EQ(f.note, "");
  else
    EXPECT_NE(f.note, "");
  EXPECT_EQ(::fcntl(f.file.fd, F_GETFL) & O_DIRECT, f.direct ? O_DIRECT : 0);
  reserve(f.file, 3 << 20);
  EXPECT_EQ(size_of(f.file), 3u << 20);
  reserve(f.file, 0);  // nothing to do, no error
  EXPECT_EQ(size_of(f.file), 3u << 20);
  // The reserved bytes take an O_DIRECT write and read back, and survive a sync.
  auto buf = aligned_bytes(4096);
  std::memset(buf.get(), 0x3C, 4096);
  ASSERT_EQ(::pwrite(f.file.fd, buf.get(), 4096, 1 << 20), 4096) << std::strerror(errno);
  sync_data(f.file);
  std::memset(buf.get(), 0, 4096);
  ASSERT_EQ(::pread(f.file.fd, buf.get(), 4096, 1 << 20), 4096);
  EXPECT_EQ(buf[0], 0x3C);
  EXPECT_EQ(buf[4095], 0x3C);
  close_file(&f.file);
  EXPECT_EQ(f.file.fd, -1);
  close_file(&f.file);  // idempotent
  close_file(nullptr);
}

// Whether the file system under `folder` takes O_DIRECT: a raw probe.
bool takes_direct(const std::string& folder) {
  const std::string probe = folder + "/direct-probe";
  const int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  const bool ok = fd >= 0;
  if (ok) ::close(fd);
  ::unlink(probe.c_str());
  return ok;
}

constexpr const char* kRefusedNote = "O_DIRECT refused by the file system (EINVAL): buffered I/O";

// procfs refuses O_DIRECT with EINVAL on every kernel; /proc/self/comm opens
// read-write without create: the fallback path, whatever tmpfs does here.
TEST(StateFile, BufferedWhereTheFileSystemRefusesDirect) {
  if (::access("/proc/self/comm", W_OK) != 0) GTEST_SKIP() << "no writable /proc/self/comm";
  OpenedFile f = open_state_file("/proc/self/comm", false, true);
  EXPECT_FALSE(f.direct);
  EXPECT_EQ(f.note, kRefusedNote);
  EXPECT_EQ(::fcntl(f.file.fd, F_GETFL) & O_DIRECT, 0);
  char name[64] = {};
  EXPECT_GT(::pread(f.file.fd, name, sizeof name - 1, 0), 0) << std::strerror(errno);  // it reads, buffered
  close_file(&f.file);
}

// tmpfs refused O_DIRECT before Linux 6.6 and takes it since: either way the
// outcome matches what the kernel does, and the file works.
TEST(StateFile, TmpfsDirectOrBufferedAsTheKernelAllows) {
  if (::access("/dev/shm", W_OK) != 0) GTEST_SKIP() << "no writable /dev/shm";
  TempDir dir("/dev/shm");
  if (!on_tmpfs(dir.path())) GTEST_SKIP() << "/dev/shm is not tmpfs here";
  const bool direct = takes_direct(dir.path());
  OpenedFile f = open_state_file(dir.file("b.bin"), true, true);
  EXPECT_EQ(f.direct, direct);
  EXPECT_EQ(f.note, direct ? "" : kRefusedNote);
  EXPECT_EQ(::fcntl(f.file.fd, F_GETFL) & O_DIRECT, direct ? O_DIRECT : 0);
  reserve(f.file, 64 << 10);
  EXPECT_EQ(size_of(f.file), 64u << 10);
  auto buf = aligned_bytes(4096);
  std::memset(buf.get(), 0x42, 4096);
  ASSERT_EQ(::pwrite(f.file.fd, buf.get(), 4096, 8192), 4096) << std::strerror(errno);
  sync_data(f.file);
  close_file(&f.file);
}

TEST(StateFile, BufferedWhenDirectIsNotAllowed) {
  TempDir dir;
  OpenedFile f = open_state_file(dir.file("c.bin"), true, false);
  EXPECT_FALSE(f.direct);
  EXPECT_NE(f.note, "");
  EXPECT_EQ(::fcntl(f.file.fd, F_GETFL) & O_DIRECT, 0);
  close_file(&f.file);
  // Reopening an existing file without create works and keeps its contents' size.
  OpenedFile again = open_state_file(dir.file("c.bin"), false, false);
  EXPECT_EQ(size_of(again.file), 0u);
  close_file(&again.file);
}

TEST(StateFile, OpenErrorsNameThePath) {
  TempDir dir;
  const std::string in_missing_folder = dir.file("no/such/folder/state.bin");
  try {
    open_state_file(in_missing_folder, true, true);
    ADD_FAILURE() << "no exception";
  } catch (const IoFailure& e) {
    expect_failure_names(e, in_missing_folder, ENOENT);
  }
  const std::string missing = dir.file("missing.bin");
  try {
    open_state_file(missing, false, false);
    ADD_FAILURE() << "no exception";
  } catch (const IoFailure& e) {
    expect_failure_names(e, missing, ENOENT);
  }
  try {
    open_state_file(dir.path(), false, false);  // a folder opens read-write nowhere
    ADD_FAILURE() << "no exception";
  } catch (const IoFailure& e) {
    expect_failure_names(e, dir.path(), EISDIR);
  }
  EXPECT_THROW(open_state_file("", true, true), std::invalid_argument);
}

TEST(StateFile, ReserveBeyondWhatTheFileSystemHoldsNamesThePath) {
  TempDir dir;
  OpenedFile f = open_state_file(dir.file("huge.bin"), true, true);
  try {
    reserve(f.file, std::uint64_t{1} << 62);  // 4 EiB: past any file system's size limit
    ADD_FAILURE() << "no exception";
  } catch (const IoFailure& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(f.file.path), std::string::npos) << what;
    EXPECT_TRUE(e.error == EFBIG || e.error == ENOSPC) << what;
    EXPECT_NE(what.find(std::strerror(e.error)), std::string::npos) << what;
  }
  EXPECT_EQ(size_of(f.file), 0u);  // nothing was reserved
  close_file(&f.file);
  EXPECT_THROW(reserve(f.file, 4096), std::invalid_argument);  // closed
  EXPECT_THROW(sync_data(f.file), std::invalid_argument);
}

}  // namespace
}  // namespace hipferry::disk

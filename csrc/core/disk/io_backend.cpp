// Picking the I/O backend: io_uring where the kernel allows it, the threads
// backend where it refuses, or whichever was asked for. HIPFERRY_IO_BACKEND
// (auto | io_uring | threads) stands in for "auto", so users and tests can
// force the threads backend without changing code.
#include "csrc/core/disk/io_backend.h"

#include <cstdlib>
#include <stdexcept>

namespace hipferry::disk {
namespace {

bool is_known(const std::string& name) { return name == "auto" || name == "io_uring" || name == "threads"; }

}  // namespace

std::unique_ptr<IoBackend> make_backend(const std::string& wanted, std::size_t depth, std::string* note) {
  if (!is_known(wanted)) {
    throw std::invalid_argument("make_backend: wanted must be 'auto', 'io_uring' or 'threads', got '" + wanted + "'");
  }
  if (depth == 0) throw std::invalid_argument("make_backend: depth must be at least 1, got 0");
  std::string choice = wanted;
  std::string why = wanted == "auto" ? "" : " (asked for)";
  if (wanted == "auto") {
    const char* env = std::getenv("HIPFERRY_IO_BACKEND");
    if (env != nullptr && *env != '\0') {
      if (!is_known(env)) {
        throw std::invalid_argument(std::string("HIPFERRY_IO_BACKEND must be auto, io_uring or threads, got '") + env +
                                    "'");
      }
      choice = env;
      why = std::string(" (HIPFERRY_IO_BACKEND=") + env + ")";
    }
  }
  std::string text;
  std::unique_ptr<IoBackend> backend;
  if (choice == "threads") {
    backend = make_thread_backend(depth);
    text = "threads" + why;
  } else {
    std::string refused;
    backend = make_uring_backend(depth, &refused);
    if (backend) {
      text = "io_uring" + why;
    } else if (choice == "io_uring") {
      throw std::runtime_error("io_uring" + why + " is refused here: " + refused);
    } else {
      backend = make_thread_backend(depth);
      text = "io_uring refused: " + refused + "; threads take over";
    }
  }
  if (note) *note = text;
  return backend;
}

}  // namespace hipferry::disk

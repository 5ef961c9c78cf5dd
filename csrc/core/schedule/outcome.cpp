#include "csrc/core/schedule/outcome.h"

namespace hipferry::schedule {

void Outcome::fail(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failed_) return;
  failed_ = true;
  error_ = why.empty() ? "unknown error" : why;
}

bool Outcome::failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failed_;
}

std::string Outcome::error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

}  // namespace hipferry::schedule

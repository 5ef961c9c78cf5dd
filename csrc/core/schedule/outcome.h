// The first error of a job whose parts run on other threads or streams
// (see Note [copy scheduler] in stream.h): every waiter reads the same error
// (SerialWorker::wait hands a task's exception to its first waiter only).
#pragma once

#include <mutex>
#include <string>

namespace hipferry::schedule {

class Outcome {
 public:
  void fail(const std::string& why);  // keeps the first error
  bool failed() const;
  std::string error() const;  // "" while nothing failed
  // Runs f; an exception it throws becomes this outcome's error, prefixed by `what`.
  template <class F>
  void run(const char* what, F&& f) noexcept;

 private:
  mutable std::mutex mutex_;  // guards the two below
  bool failed_ = false;
  std::string error_;
};

template <class F>
void Outcome::run(const char* what, F&& f) noexcept {
  try {
    f();
  } catch (const std::exception& e) {
    fail(std::string(what) + ": " + e.what());
  } catch (...) {
    fail(std::string(what) + ": unknown error");
  }
}

}  // namespace hipferry::schedule

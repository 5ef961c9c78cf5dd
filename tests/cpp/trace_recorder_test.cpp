// The trace recorder and its Chrome trace-event JSON.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "csrc/core/trace/trace_recorder.h"

namespace hipferry::trace {
namespace {

std::size_t count(const std::string& s, const std::string& part) {
  std::size_t n = 0;
  for (auto at = s.find(part); at != std::string::npos; at = s.find(part, at + 1)) ++n;
  return n;
}

TEST(TraceRecorder, WritesOneCompleteEventPerRecordOnNamedTracks) {
  TraceRecorder r;
  r.add({"h2d copy", "copy", "cuda:0 h2d", 5'000, 9'000, 4'000});
  r.add({"adamw", "kernel", "cuda:0 compute", 6'000, 12'000, 0});
  r.add({"step", "user", "user", 1'000, 13'000, 0});
  const std::string j = r.chrome_json();
  EXPECT_EQ(count(j, "\"ph\": \"X\""), 3u);
  EXPECT_EQ(count(j, "\"name\": \"thread_name\""), 3u);  // one per track
  // Times in microseconds from the earliest start (the user region at 1 us).
  EXPECT_NE(j.find("\"name\": \"h2d copy\", \"cat\": \"copy\", \"ts\": 4.000, \"dur\": 4.000"), std::string::npos) << j;
  EXPECT_NE(j.find("\"bytes\": 4000, \"GBps\": 1.000"), std::string::npos) << j;
  EXPECT_NE(j.find("\"ts\": 0.000, \"dur\": 12.000"), std::string::npos) << j;
  EXPECT_EQ(j.front(), '{');
  EXPECT_EQ(j.substr(j.size() - 3), "]}\n");
}

TEST(TraceRecorder, EscapesNamesAndRejectsNegativeDurations) {
  EXPECT_EQ(json_string("a\"b\\c\n\x01"), "\"a\\\"b\\\\c\\n\\u0001\"");
  TraceRecorder r;
  EXPECT_THROW(r.add({"bad", "copy", "t", 10, 9, 0}), std::invalid_argument);
  EXPECT_TRUE(r.events().empty());
  r.add({"x\"y", "copy", "t", 0, 0, 0});
  EXPECT_NE(r.chrome_json().find("\"x\\\"y\""), std::string::npos);
  r.clear();
  EXPECT_EQ(count(r.chrome_json(), "\"ph\": \"X\""), 0u);
}

TEST(TraceRecorder, ThreadsRecordConcurrently) {
  TraceRecorder r;
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&r, t] {
      for (int i = 0; i < 500; ++i) r.add({"e", "copy", "track" + std::to_string(t), i, i + 1, 1});
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(r.events().size(), 2000u);
  EXPECT_EQ(count(r.chrome_json(), "\"name\": \"thread_name\""), 4u);
}

}  // namespace
}  // namespace hipferry::trace

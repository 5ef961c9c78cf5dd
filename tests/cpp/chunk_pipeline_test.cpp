// ChunkPipeline (csrc/core/disk/chunk_pipeline.h, Note [chunk window])
// against adversarial fake backends. Each chunk is two extents (an "m" and a
// "v" file, like AdamW's moments) read into one buffer, changed in place by
// compute (+1 per byte, so every byte changes) and written back.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <stdexcept>
#include <vector>

#include "csrc/core/disk/chunk_pipeline.h"
#include "tests/cpp/fake_io_backend.h"
#include "tests/cpp/seeds.h"

namespace hipferry::disk {
namespace {

using fake::FakeIoBackend;
using fake::FakeIoConfig;
using Bytes = std::vector<unsigned char>;

struct Store {
  FileRef m{5, "/fake/m"};
  FileRef v{6, "/fake/v"};
  std::vector<std::size_t> size, offset;  // per chunk, the same in both files
  std::size_t max_chunk = 1;
  Bytes m0, v0;  // the files before the pass

  Store(FakeIoBackend& fake, std::size_t count, std::mt19937_64& rng) {
    std::size_t at = 0;
    for (std::size_t c = 0; c < count; ++c) {
      size.push_back(1 + rng() % 3000);
      offset.push_back(at);
      at += size.back();
      max_chunk = std::max(max_chunk, size.back());
    }
    for (std::size_t i = 0; i < at; ++i) {
      m0.push_back(static_cast<unsigned char>(rng()));
      v0.push_back(static_cast<unsigned char>(rng()));
    }
    fake.files[m.fd] = m0;
    fake.files[v.fd] = v0;
  }

  std::size_t buffer_bytes() const { return 2 * max_chunk; }

  ChunkIo plan(std::size_t c) const {
    ChunkIo io;
    io.reads = {{&m, offset[c], 0, size[c]}, {&v, offset[c], size[c], size[c]}};
    io.writes = io.reads;
    return io;
  }

  // Whether chunk c of the files holds its original bytes, its new bytes, or
  // (-1) neither: a chunk whose writes only partly landed.
  int state(FakeIoBackend& fake, std::size_t c) const {
    bool original = true, updated = true;
    for (std::size_t i = offset[c]; i < offset[c] + size[c]; ++i) {
      for (const auto& [fd, before] : {std::pair{m.fd, &m0}, std::pair{v.fd, &v0}}) {
        const unsigned char now = fake.files[fd][i];
        original = original && now == (*before)[i];
        updated = updated && now == static_cast<unsigned char>((*before)[i] + 1);
      }
    }
    return original ? 0 : updated ? 1 : -1;
  }
};

// Runs a pass; checks, as it goes, the window and what compute sees.
struct Harness {
  FakeIoBackend& fake;
  Store& store;
  std::vector<Bytes> storage;
  IoQueue queue;
  ChunkPipeline pipe;
  std::vector<std::size_t> computed;  // compute's chunk, in call order
  std::size_t throw_at = ~std::size_t{0};
  std::size_t submitted_at_throw = 0;

  Harness(FakeIoBackend& fake, Store& store, std::size_t window, std::size_t request_bytes)
      : fake(fake),
        store(store),
        storage(window, Bytes(store.buffer_bytes())),
        queue(fake, request_bytes),
        pipe(queue, pointers(storage)) {}

  static std::vector<void*> pointers(std::vector<Bytes>& s) {
    std::vector<void*> p;
    for (auto& b : s) p.push_back(b.data());
    return p;
  }

  void run(std::size_t count) {
    pipe.run(
        count, [&](std::size_t c) { return plan(c); }, [&](std::size_t c, void* b) { compute(c, b); });
  }

  ChunkIo plan(std::size_t c) {
    // Chunk c - window's writes finished: at most `window` chunks hold a buffer.
    EXPECT_GT(pipe.written() + pipe.window(), c) << "chunk " << c << " started too early";
    return store.plan(c);
  }

  void compute(std::size_t c, void* buffer) {
    auto* b = static_cast<unsigned char*>(buffer);
    EXPECT_EQ(b, storage[c % pipe.window()].data());
    EXPECT_EQ(fake.in_flight_touching(b, store.buffer_bytes()), 0u) << "I/O on chunk " << c << "'s buffer";
    const std::size_t n = store.size[c], at = store.offset[c];
    EXPECT_TRUE(std::equal(b, b + n, store.m0.begin() + at)) << "chunk " << c << " m";
    EXPECT_TRUE(std::equal(b + n, b + 2 * n, store.v0.begin() + at)) << "chunk " << c << " v";
    if (c == throw_at) {
      submitted_at_throw = fake.records().size();
      throw std::runtime_error("compute failed");
    }
    computed.push_back(c);
    for (std::size_t i = 0; i < 2 * n; ++i) ++b[i];
  }
};

FakeIoConfig random_config(std::uint64_t seed, std::mt19937_64& rng) {
  FakeIoConfig c = fake::random_config(seed, rng, 0.6);
  c.short_fraction = (rng() % 2) ? 0.3 : 0;
  return c;
}

std::size_t random_request_bytes(std::mt19937_64& rng) {
  const std::size_t sizes[] = {7, 64, 512, 4096};
  return sizes[rng() % 4];
}

TEST(ChunkPipeline, EveryChunkComputedInOrderAndWritten) {
  for_each_seed(300, [&](std::uint64_t seed, std::mt19937_64& rng) {
    FakeIoBackend fake(random_config(seed, rng));
    const std::size_t count = rng() % 13, window = 1 + rng() % 4;
    Store store(fake, count, rng);
    Harness h(fake, store, window, random_request_bytes(rng));
    h.run(count);
    std::vector<std::size_t> order(count);
    for (std::size_t c = 0; c < count; ++c) order[c] = c;
    EXPECT_EQ(h.computed, order);
    EXPECT_EQ(h.pipe.computed(), count);
    EXPECT_EQ(h.pipe.written(), count);
    for (std::size_t c = 0; c < count; ++c) EXPECT_EQ(store.state(fake, c), 1) << "chunk " << c;
    EXPECT_EQ(fake.in_flight(), 0u);
    EXPECT_EQ(h.queue.pending(), 0u);
  });
}

// With a backend that keeps up, compute(i) runs while the reads of every
// chunk the window allows (up to i + window - 1) have been submitted.
TEST(ChunkPipeline, ReadsAheadAsFarAsTheWindowAllows) {
  for (std::size_t window : {3, 4}) {
    FakeIoConfig config;
    config.depth = 64;
    FakeIoBackend fake(config);
    std::mt19937_64 rng(window);
    const std::size_t count = 10;
    Store store(fake, count, rng);
    Harness h(fake, store, window, 1024);
    std::vector<std::size_t> ahead;  // per compute: the furthest chunk with a read submitted
    h.pipe.run(
        count, [&](std::size_t c) { return h.plan(c); },
        [&](std::size_t c, void* b) {
          std::size_t furthest = 0;
          for (const auto& rec : fake.records()) {
            if (rec.request.op != IoOp::kRead || rec.request.fd != store.m.fd) continue;
            for (std::size_t k = 0; k < count; ++k) {
              if (rec.request.offset == store.offset[k]) furthest = std::max(furthest, k);
            }
          }
          ahead.push_back(furthest);
          h.compute(c, b);
        });
    ASSERT_EQ(ahead.size(), count);
    for (std::size_t c = 0; c < count; ++c) EXPECT_EQ(ahead[c], std::min(count - 1, c + window - 1)) << c;
    EXPECT_EQ(h.pipe.written(), count);
  }
}

// The k-th request fails with EIO: the error comes back with nothing in
// flight and nothing submitted after it; chunks below written() are in the
// files, chunk written() is not (whole), chunks from computed() on are untouched.
TEST(ChunkPipeline, AnIoFailureMidwayLeavesExactlyTheWrittenChunks) {
  int failures = 0;
  for_each_seed(300, [&](std::uint64_t seed, std::mt19937_64& rng) {
    const FakeIoConfig config = fake::failing_one_request(random_config(seed, rng), rng, 40);
    FakeIoBackend fake(config);
    const std::size_t count = 1 + rng() % 12, window = 1 + rng() % 4;
    Store store(fake, count, rng);
    Harness h(fake, store, window, random_request_bytes(rng));
    try {
      h.run(count);
      EXPECT_LE(fake.records().size(), static_cast<std::size_t>(config.fail_request));
      return;
    } catch (const IoFailure& e) {
      ++failures;
      EXPECT_EQ(fake.in_flight(), 0u);
      EXPECT_TRUE(e.path == store.m.path || e.path == store.v.path) << e.path;
      EXPECT_NE(std::string(e.what()).find(e.path + " at offset " + std::to_string(e.offset)), std::string::npos);
    }
    EXPECT_EQ(fake.submits_after_failure(), 0u);
    EXPECT_EQ(h.pipe.computed(), h.computed.size());
    EXPECT_LE(h.pipe.written(), h.pipe.computed());
    for (std::size_t c = 0; c < count; ++c) {
      const int state = store.state(fake, c);
      if (c < h.pipe.written())
        EXPECT_EQ(state, 1) << "chunk " << c;
      else if (c == h.pipe.written())
        EXPECT_NE(state, 1) << "chunk " << c;
      if (c >= h.pipe.computed()) EXPECT_EQ(state, 0) << "chunk " << c;
    }
  });
  EXPECT_GT(failures, 100);
}

// compute(k) throws: nothing new is submitted, the requests in flight finish,
// the same exception comes back, and the queue serves the next pass.
TEST(ChunkPipeline, AComputeThatThrowsDrainsAndRethrows) {
  for_each_seed(200, [&](std::uint64_t seed, std::mt19937_64& rng) {
    FakeIoBackend fake(random_config(seed, rng));
    const std::size_t count = 1 + rng() % 12, window = 1 + rng() % 4;
    Store store(fake, count, rng);
    Harness h(fake, store, window, random_request_bytes(rng));
    h.throw_at = rng() % count;
    try {
      h.run(count);
      FAIL() << "compute's exception was lost";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "compute failed");
      EXPECT_EQ(fake.in_flight(), 0u);
    }
    EXPECT_EQ(fake.records().size(), h.submitted_at_throw) << "I/O submitted after compute threw";
    EXPECT_EQ(h.pipe.computed(), h.throw_at);
    EXPECT_LE(h.pipe.written(), h.throw_at);
    for (std::size_t c = 0; c < count; ++c) {
      if (c < h.pipe.written()) EXPECT_EQ(store.state(fake, c), 1) << "chunk " << c;
      if (c >= h.throw_at) EXPECT_EQ(store.state(fake, c), 0) << "chunk " << c;
    }
    EXPECT_EQ(h.queue.pending(), 0u);
    // The queue is not dead: a read-only pass over the files runs.
    std::size_t seen = 0;
    h.pipe.run(
        count,
        [&](std::size_t c) {
          return ChunkIo{store.plan(c).reads, {}};
        },
        [&](std::size_t, void*) { ++seen; });
    EXPECT_EQ(seen, count);
    EXPECT_EQ(h.pipe.written(), count);
  });
}

TEST(ChunkPipeline, AWriteOnlyPassFillsTheFiles) {
  FakeIoConfig config;
  config.short_fraction = 0.5;
  FakeIoBackend fake(config);
  FileRef out{7, "/fake/out"};
  fake.files[out.fd] = Bytes();
  std::vector<Bytes> storage(2, Bytes(100));
  IoQueue queue(fake, 16);
  ChunkPipeline pipe(queue, Harness::pointers(storage));
  pipe.run(
      5,
      [&](std::size_t c) {
        return ChunkIo{{}, {{&out, c * 100, 0, 100}}};
      },
      [&](std::size_t c, void* b) { std::fill_n(static_cast<unsigned char*>(b), 100, c + 1); });
  ASSERT_EQ(fake.files[out.fd].size(), 500u);
  for (std::size_t i = 0; i < 500; ++i) EXPECT_EQ(fake.files[out.fd][i], i / 100 + 1);
  EXPECT_EQ(pipe.written(), 5u);
}

TEST(ChunkPipeline, RejectsBadInputBeforeAnyIo) {
  FakeIoBackend fake(FakeIoConfig{});
  IoQueue queue(fake);
  EXPECT_THROW(ChunkPipeline(queue, {}), std::invalid_argument);
  EXPECT_THROW(ChunkPipeline(queue, {nullptr}), std::invalid_argument);
  FileRef f{3, "/fake/f"};
  fake.files[f.fd] = Bytes(10);
  Bytes b(10), buffer(10);
  queue.read(f, 0, b.data(), b.size(), 1);
  ChunkPipeline pipe(queue, {buffer.data()});
  int planned = 0;
  EXPECT_THROW(pipe.run(
                   1,
                   [&](std::size_t) {
                     ++planned;
                     return ChunkIo{};
                   },
                   [](std::size_t, void*) {}),
               std::invalid_argument);
  EXPECT_EQ(planned, 0);
  EXPECT_TRUE(fake.records().empty());
  std::vector<std::uint64_t> done;
  queue.poll(true, &done);
  EXPECT_THROW(pipe.run(
                   1,
                   [&](std::size_t) {
                     return ChunkIo{{{nullptr, 0, 0, 1}}, {}};
                   },
                   [](std::size_t, void*) {}),
               std::invalid_argument);
}

}  // namespace
}  // namespace hipferry::disk

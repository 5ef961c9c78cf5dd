// Test helper: the seed loop of the randomized tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <random>

namespace hipferry {

// body(seed, rng) for each seed in [0, count), under SCOPED_TRACE(seed), with rng seeded by it.
// A fatal failure (ASSERT_*) ends the loop, as it ends a test; returning from body goes on to the next seed.
template <class Body>
void for_each_seed(std::uint64_t count, Body body) {
  for (std::uint64_t seed = 0; seed < count; ++seed) {
    SCOPED_TRACE(seed);
    std::mt19937_64 rng(seed);
    body(seed, rng);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

}  // namespace hipferry

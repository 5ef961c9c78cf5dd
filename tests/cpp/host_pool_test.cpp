#include <gtest/gtest.h>
#include "host_pool/host_pool.h"
TEST(HostPool, Smoke) {
  hipferry::pool::HostPool p(std::make_unique<hipferry::pool::AlignedHostMemoryProvider>(),
                             std::make_unique<hipferry::pool::CompletedEventSource>());
  auto a = p.allocate(1000);
  p.deallocate(a.host);
  p.check_invariants();
}

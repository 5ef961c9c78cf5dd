// Stage 1 of starting a transfer (transfer_start.cpp): every argument of a
// TransferRequest checked before anything is allocated or queued.
#pragma once

#include <memory>
#include <vector>

#include "csrc/core/host_pool/host_pool.h"
#include "csrc/torch/stable.h"
#include "csrc/torch/transfer_engine.h"

namespace hipferry {

// What check_transfer established about a request.
struct CheckedTransfer {
  bool prefetch = true;
  const char* api = "";           // the Python entry point, for messages
  Device where{DeviceType::CPU};  // the device of the copy: the GPU (normalized to cuda:N), or the host
  int device = -1;                // that GPU's index; -1: the host path
  std::vector<ScalarType> types;  // each source's dtype
  std::shared_ptr<pool::HostPool> pool;
  bool gpu() const { return device >= 0; }
};

// Every argument checked, in this order (the messages are pinned by tests); nothing is
// allocated or queued before all are. Throws ValueError (or RuntimeError: a closed pool).
CheckedTransfer check_transfer(const TransferRequest& r);

}  // namespace hipferry

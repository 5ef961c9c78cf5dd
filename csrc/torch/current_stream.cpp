#include "csrc/torch/current_stream.h"

#include <torch/csrc/stable/accelerator.h>

namespace hipferry {

int current_torch_device() { return torch::stable::accelerator::getCurrentDeviceIndex(); }

rt::StreamHandle current_torch_stream(int device) {
  const auto stream =
      torch::stable::accelerator::getCurrentStream(static_cast<torch::stable::accelerator::DeviceIndex>(device));
  return static_cast<rt::StreamHandle>(stream.nativeHandle());
}

}  // namespace hipferry

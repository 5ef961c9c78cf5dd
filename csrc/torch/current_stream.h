// The current torch GPU stream and device WITHOUT torch's GPU headers (design
// principle 3): through c10's device-generic guard interface. ROCm builds of
// torch call their device "cuda" too, so DeviceType::CUDA is right for both.
#pragma once

#include <ATen/core/Tensor.h>

#include "hip/runtime.h"

namespace hipferry {

int current_torch_device();                           // torch.cuda.current_device()
rt::StreamHandle current_torch_stream(int device);   // torch.cuda.current_stream(device)
// t.record_stream(torch.cuda.current_stream(device)) for a device tensor: torch's
// allocator then reuses its memory only after the current stream's work so far.
void record_on_current_stream(const at::Tensor& t, int device);

}  // namespace hipferry

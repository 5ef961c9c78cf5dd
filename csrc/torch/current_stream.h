// The current torch GPU stream and device WITHOUT torch's GPU headers (design
// principle 3): through the stable ABI's device-generic accelerator accessors.
// ROCm builds of torch call their device "cuda" too, so one code serves both.
#pragma once

#include "hip/runtime.h"

namespace hipferry {

int current_torch_device();                         // torch.cuda.current_device()
rt::StreamHandle current_torch_stream(int device);  // torch.cuda.current_stream(device)

}  // namespace hipferry

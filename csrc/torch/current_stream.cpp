#include "csrc/torch/current_stream.h"

#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace hipferry {

int current_torch_device() {
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  return impl.getDevice().index();
}

rt::StreamHandle current_torch_stream(int device) {
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  const c10::Stream stream =
      impl.getStream(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  return stream.native_handle();
}

void record_on_current_stream(const at::Tensor& t, int device) {
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  const c10::Stream stream =
      impl.getStream(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  impl.recordDataPtrOnStream(t.storage().data_ptr(), stream);
}

}  // namespace hipferry

// Stage 1 of starting a transfer: the checks of a TransferRequest, with the
// names of layouts, dtypes and devices their messages need.
#include "csrc/torch/transfer_checks.h"

#include <exception>
#include <optional>
#include <string>

#include "csrc/core/errors.h"
#include "csrc/torch/current_stream.h"
#include "csrc/torch/pinned_pool.h"
#include "hip/runtime.h"

namespace hipferry {
namespace {

using Layout = torch::headeronly::Layout;

// "Sparse", as c10 prints a layout (the stable headers have no operator<<).
const char* layout_name(Layout l) {
  switch (l) {
    case Layout::Strided: return "Strided";
    case Layout::Sparse: return "Sparse";
    case Layout::SparseCsr: return "SparseCsr";
    case Layout::SparseCsc: return "SparseCsc";
    case Layout::SparseBsr: return "SparseBsr";
    case Layout::SparseBsc: return "SparseBsc";
    case Layout::Mkldnn: return "Mkldnn";
    case Layout::Jagged: return "Jagged";
    default: return "(unknown)";
  }
}

// The dtype of `t` where the stable ABI names it. It names no quantized
// dtype (nor a few exotic ones): then nullopt, with libtorch's code for the
// dtype in `code` (c10's ScalarType numbering, for the message only).
std::optional<ScalarType> plain_dtype(const Tensor& t, std::int32_t& code) {
  code = -1;
  try {
    return t.scalar_type();
  } catch (const std::exception&) {
    if (aoti_torch_get_dtype(t.get(), &code) != AOTI_TORCH_SUCCESS) code = -1;
    return std::nullopt;
  }
}

// "torch.qint8" for a code `plain_dtype` gave, when it is a quantized one.
std::string quantized_name(std::int32_t code) {
  const auto type = static_cast<ScalarType>(code);
  return code >= 0 && code == static_cast<std::int32_t>(type) && is_quantized(type) ? dtype_name(type) : "";
}

// "cuda:0", or what to say of a device the stable ABI does not name.
std::string device_of(const Tensor& t) {
  try {
    return device_name(t.device());
  } catch (const std::exception&) {
    return "a device hipferry cannot name through torch's stable ABI";
  }
}

// The dtype of r.sources[i] once it is checked. Offload: `where` is the device
// of tensors[0], which every later tensor must share.
// What errors call source i: the caller's name for it (TransferRequest::source_name), else tensors[i].
std::string source_name(const TransferRequest& r, std::size_t i) {
  return r.source_name ? r.source_name(i) : "tensors[" + std::to_string(i) + "]";
}

ScalarType check_source(const TransferRequest& r, const char* api, std::size_t i, Device& where) {
  const auto name = [&r](std::size_t k) { return source_name(r, k); };
  const bool prefetch = r.kind == TransferKind::kPrefetch;
  const Tensor& t = r.sources[i];
  HF_CHECK_VALUE(t.defined(), api, ": ", name(i), " is an undefined tensor; expected a tensor");
  const Layout layout = t.layout();
  HF_CHECK_VALUE(layout == Layout::Strided, api, ": ", name(i), " has layout ", layout_name(layout),
                 "; expected strided (dense) tensors");
  std::int32_t code = -1;
  const std::optional<ScalarType> type = plain_dtype(t, code);
  if (!type) {
    const std::string quantized = quantized_name(code);
    HF_CHECK_VALUE(quantized.empty(), api, ": ", name(i), " is quantized (", quantized,
                   "); expected a plain dtype (move t.int_repr() and the quantization parameters instead)");
    HF_CHECK_VALUE(false, api, ": ", name(i), " has a dtype (code ", code,
                   ") that hipferry cannot name through torch's stable ABI; expected a plain dtype");
  }
  if (prefetch) {
    HF_CHECK_VALUE(t.is_cpu(), api, ": ", name(i), " is on ", device_of(t), "; expected host (CPU) tensors to move to ",
                   device_name(r.device));
  } else {
    HF_CHECK_VALUE(t.is_cpu() || t.is_cuda(), api, ": ", name(i), " is on ", device_of(t),
                   "; expected tensors on a GPU (or the CPU)");
    const Device on = t.device();
    if (i == 0) where = on;
    HF_CHECK_VALUE(on == where, api, ": ", name(i), " is on ", device_name(on), " but ", name(0), " is on ",
                   device_name(where), "; expected every tensor on one device");
  }
  if (r.dtype && *r.dtype != *type) {
    HF_CHECK_VALUE(is_float_convertible(*type) && is_float_convertible(*r.dtype), api, ": dtype ", dtype_name(*r.dtype),
                   " cannot be produced from ", name(i), " of dtype ", dtype_name(*type),
                   "; expected conversions among float32, float16 and bfloat16 (or dtype=None)");
  }
  return *type;
}

// The index of the GPU `where` names, once checked (the current one for a bare
// 'cuda'); -1 for the host.
int check_device(const char* api, const Device& where) {
  HF_CHECK_VALUE(where.is_cpu() || where.is_cuda(), api, ": device ", device_name(where),
                 " is not supported; expected 'cpu' or a GPU ('cuda', 'cuda:N')");
  if (!where.is_cuda()) return -1;
  const int count = rt::device_count();
  HF_CHECK_VALUE(rt::build_info().platform != "cpu", api, ": device ", device_name(where),
                 " needs a GPU build of hipferry, but this one is CPU-only; expected device='cpu'");
  HF_CHECK_VALUE(count > 0, api, ": device ", device_name(where),
                 " does not exist: hipferry sees no GPU here; expected device='cpu'");
  const int device = where.has_index() ? where.index() : current_torch_device();
  HF_CHECK_VALUE(device >= 0 && device < count, api, ": device cuda:", device, " does not exist; hipferry sees ", count,
                 " GPU(s)");
  return device;
}

}  // namespace

CheckedTransfer check_transfer(const TransferRequest& r) {
  CheckedTransfer c;
  c.prefetch = r.kind == TransferKind::kPrefetch;
  c.api = c.prefetch ? "hipferry.prefetch" : "hipferry.offload";
  c.where = c.prefetch ? r.device : Device(DeviceType::CPU);
  c.types.reserve(r.sources.size());
  for (std::size_t i = 0; i < r.sources.size(); ++i) c.types.push_back(check_source(r, c.api, i, c.where));
  c.device = check_device(c.api, c.where);
  if (c.gpu()) c.where = cuda_device(c.device);
  c.pool = pinned_pool(r.pool_id);
  HF_CHECK(!c.pool->closed(), c.api, ": the pool is closed; expected an open PinnedPool");
  return c;
}

}  // namespace hipferry

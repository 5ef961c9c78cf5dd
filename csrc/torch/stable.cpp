#include "csrc/torch/stable.h"

#include <sstream>
#include <stdexcept>

#include "csrc/core/errors.h"

namespace hipferry {

std::string shape_str(const Shape& s) {
  std::ostringstream out;
  out << '[';
  for (std::size_t i = 0; i < s.size(); ++i) out << (i ? ", " : "") << s[i];
  out << ']';
  return out.str();
}

namespace {

struct DtypeName {
  ScalarType type;
  const char* name;
  std::size_t bytes;
};
constexpr DtypeName kDtypeNames[] = {
    {ScalarType::Float, "float32", 4},
    {ScalarType::Double, "float64", 8},
    {ScalarType::Half, "float16", 2},
    {ScalarType::BFloat16, "bfloat16", 2},
    {ScalarType::Byte, "uint8", 1},
    {ScalarType::Char, "int8", 1},
    {ScalarType::Short, "int16", 2},
    {ScalarType::Int, "int32", 4},
    {ScalarType::Long, "int64", 8},
    {ScalarType::Bool, "bool", 1},
    {ScalarType::ComplexHalf, "complex32", 4},
    {ScalarType::ComplexFloat, "complex64", 8},
    {ScalarType::ComplexDouble, "complex128", 16},
    {ScalarType::QInt8, "qint8", 1},
    {ScalarType::QUInt8, "quint8", 1},
    {ScalarType::QInt32, "qint32", 4},
    {ScalarType::QUInt4x2, "quint4x2", 1},
    {ScalarType::QUInt2x4, "quint2x4", 1},
    {ScalarType::Float8_e5m2, "float8_e5m2", 1},
    {ScalarType::Float8_e4m3fn, "float8_e4m3fn", 1},
    {ScalarType::Float8_e5m2fnuz, "float8_e5m2fnuz", 1},
    {ScalarType::Float8_e4m3fnuz, "float8_e4m3fnuz", 1},
    {ScalarType::UInt16, "uint16", 2},
    {ScalarType::UInt32, "uint32", 4},
    {ScalarType::UInt64, "uint64", 8},
};

}  // namespace

std::string dtype_name(ScalarType t) {
  for (const auto& d : kDtypeNames) {
    if (d.type == t) return std::string("torch.") + d.name;
  }
  return std::string("torch.") + torch::headeronly::toString(t);
}

ScalarType parse_dtype(const std::string& text, const char* what) {
  const std::string name = text.rfind("torch.", 0) == 0 ? text.substr(6) : text;
  for (const auto& d : kDtypeNames) {
    if (name == d.name) return d.type;
  }
  if (name == "float") return ScalarType::Float;
  if (name == "half") return ScalarType::Half;
  HF_CHECK_VALUE(false, what, " ", text, " is not a dtype hipferry knows; expected a torch.dtype");
}

void check_shim(AOTITorchError code, const char* call) {
  if (code == AOTI_TORCH_SUCCESS) return;
  const char* what = torch_exception_get_what_without_backtrace();
  throw std::runtime_error(what != nullptr && *what != '\0' ? std::string(what)
                                                            : std::string(call) + " failed in libtorch");
}

std::vector<ScalarType> known_dtypes() {
  std::vector<ScalarType> all;
  for (const auto& d : kDtypeNames) all.push_back(d.type);
  return all;
}

std::size_t element_size_of(ScalarType t) {
  for (const auto& d : kDtypeNames) {
    if (d.type == t) return d.bytes;
  }
  HF_CHECK_VALUE(false, "hipferry: dtype ", dtype_name(t), " has no element size hipferry knows");
}

std::string device_name(const Device& d) {
  if (d.type() == DeviceType::CPU) return "cpu";
  std::string name;
  switch (d.type()) {
    case DeviceType::CUDA: name = "cuda"; break;
    case DeviceType::HIP: name = "hip"; break;
    case DeviceType::Meta: name = "meta"; break;
    case DeviceType::MPS: name = "mps"; break;
    case DeviceType::XPU: name = "xpu"; break;
    case DeviceType::MTIA: name = "mtia"; break;
    case DeviceType::PrivateUse1: name = "privateuseone"; break;
    default: name = "device type " + std::to_string(static_cast<int>(d.type()));
  }
  if (d.index() >= 0) name += ":" + std::to_string(static_cast<int>(d.index()));
  return name;
}

Device parse_device(const std::string& text, const char* what) {
  if (text == "cpu") return Device(DeviceType::CPU);
  if (text == "cuda") return Device(DeviceType::CUDA);
  if (text.rfind("cuda:", 0) == 0 && text.size() > 5 && text.size() < 10 &&
      text.find_first_not_of("0123456789", 5) == std::string::npos) {
    return cuda_device(std::stoi(text.substr(5)));
  }
  HF_CHECK_VALUE(false, what, " ", text, " is not supported; expected 'cpu' or a GPU ('cuda', 'cuda:N')");
}

ElementType element_type_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case ScalarType::Float: return ElementType::kFloat32;
    case ScalarType::Half: return ElementType::kFloat16;
    case ScalarType::BFloat16: return ElementType::kBFloat16;
    default: HF_CHECK(false, "hipferry: internal error, no element type for ", dtype_name(t.scalar_type()));
  }
}

}  // namespace hipferry

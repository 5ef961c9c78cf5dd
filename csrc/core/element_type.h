// The floating-point element types the conversion kernels understand.
// Torch-free so that the core, the kernels and GoogleTest share one list.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hipferry {

enum class ElementType : std::uint8_t { kFloat32, kFloat16, kBFloat16 };

constexpr std::size_t element_size(ElementType t) { return t == ElementType::kFloat32 ? 4 : 2; }

constexpr const char* element_type_name(ElementType t) {
  return t == ElementType::kFloat32 ? "float32" : t == ElementType::kFloat16 ? "float16" : "bfloat16";
}

}  // namespace hipferry

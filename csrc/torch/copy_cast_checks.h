// Argument checks shared by every copy_cast_ backend. They run before any byte
// of dst is written, so a rejected call leaves dst untouched.
#pragma once

#include <ATen/core/Tensor.h>

#include "csrc/core/element_type.h"

namespace hipferry {

// Checks layout, shapes, dtypes, contiguity and overlap (not devices).
void check_copy_cast_args(const at::Tensor& dst, const at::Tensor& src);

// True when dst and src are the same memory with the same dtype: nothing to do.
bool copy_cast_is_noop(const at::Tensor& dst, const at::Tensor& src);

// Device-visible address of a tensor's data for a copy on `device`: device
// tensors as they are; host tensors must be page-locked and mapped (the
// address is always asked of the runtime, never assumed). `name` is the
// argument's name in the error.
void* copy_cast_device_address(const at::Tensor& t, const char* name, int device);

// The core's name for a float dtype. Only call after check_copy_cast_args.
ElementType element_type_of(const at::Tensor& t);

}  // namespace hipferry

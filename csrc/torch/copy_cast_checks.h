// Argument checks shared by every copy_cast_ backend. They run before any byte
// of dst is written, so a rejected call leaves dst untouched.
#pragma once

#include "csrc/torch/stable.h"

namespace hipferry {

// Throws std::runtime_error (RuntimeError, as torch's own copy checks). Checks layout, shapes, dtypes, contiguity and
// overlap (not devices).
void check_copy_cast_args(const Tensor& dst, const Tensor& src);

// True when dst and src are the same memory with the same dtype: nothing to do.
bool copy_cast_is_noop(const Tensor& dst, const Tensor& src);

// Device-visible address of a tensor's data for a copy on `device`: device
// tensors as they are; host tensors must be page-locked and mapped (the
// address is always asked of the runtime, never assumed). `name` is the
// argument's name in the error.
void* copy_cast_device_address(const Tensor& t, const char* name, int device);

}  // namespace hipferry

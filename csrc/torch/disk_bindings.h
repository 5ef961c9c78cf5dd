// The seam the test hooks use to inject I/O faults into DiskIo
// (csrc/testing/disk_faults.cpp): every DiskIo made while a wrapper is set runs
// its backend through it. Production builds never set one.
#pragma once

#include <memory>

#include "csrc/core/disk/io_backend.h"

namespace hipferry {

using DiskBackendWrapper = std::unique_ptr<disk::IoBackend> (*)(std::unique_ptr<disk::IoBackend>);
void set_disk_backend_wrapper(DiskBackendWrapper wrapper);

}  // namespace hipferry

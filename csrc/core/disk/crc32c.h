// CRC-32C (Castagnoli, iSCSI; RFC 3720), the checksum of each chunk the disk
// store writes. The SSE4.2 instruction where the CPU has it, else a table;
// both give the same value (tested, and against the `crc32c` package).
#pragma once

#include <cstddef>
#include <cstdint>

namespace hipferry::disk {

// The CRC-32C of `bytes` bytes at `data`, continuing from `crc` (0 to start):
// crc32c(b, crc32c(a)) == crc32c(a followed by b).
std::uint32_t crc32c(const void* data, std::size_t bytes, std::uint32_t crc = 0);

// The same with the table only (tests compare the two).
std::uint32_t crc32c_portable(const void* data, std::size_t bytes, std::uint32_t crc = 0);

// Whether crc32c() runs the SSE4.2 instruction on this CPU.
bool crc32c_hardware();

}  // namespace hipferry::disk

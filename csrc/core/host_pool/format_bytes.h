// Sizes as the pool's messages print them.
#pragma once

#include <cstddef>
#include <string>

namespace hipferry::pool {

// "3221225472 bytes (3.00 GiB)", "1048576 bytes (1.00 MiB)", "4096 bytes".
std::string format_bytes(std::size_t bytes);

}  // namespace hipferry::pool

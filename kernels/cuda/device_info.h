// device_info.h: host-side queries of the CUDA runtime (no CUDA types).
#pragma once

namespace colibri::cuda {
// Number of usable GPUs; 0 when there is none or no driver.
int device_count();
}  // namespace colibri::cuda

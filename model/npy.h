// npy.h: writes float32 NumPy .npy arrays (format version 1.0).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace colibri {

// Writes `data` (C order, shape `shape`) to `path`. Throws Error(Io).
void write_npy_f32(const std::string& path, const std::vector<int64_t>& shape, const float* data);

}  // namespace colibri

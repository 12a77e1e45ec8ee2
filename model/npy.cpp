// npy.cpp: minimal .npy writer (little-endian float32, C order).
#include "model/npy.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "model/error.h"
#include "model/file_io.h"

namespace colibri {

void write_npy_f32(const std::string& path, const std::vector<int64_t>& shape, const float* data) {
  std::string dims;
  size_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    dims += std::to_string(shape[i]) + (shape.size() == 1 ? "," : (i + 1 < shape.size() ? ", " : ""));
    n *= static_cast<size_t>(shape[i]);
  }
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  // NOTE: magic(6) + version(2) + len(2) + header + '\n' is padded to 64 bytes.
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  // Written to a temporary beside PATH and renamed: PATH never holds a half-written array.
  AtomicOutput out(path);
  const char magic[8] = {'\x93', 'N', 'U', 'M', 'P', 'Y', 1, 0};
  uint16_t hl = static_cast<uint16_t>(header.size());
  out.write(magic, 8);
  out.write(&hl, 2);
  out.write(header);
  out.write(data, n * sizeof(float));
  out.commit();
}

}  // namespace colibri

// npy.cpp: minimal .npy writer (little-endian float32, C order).
#include "model/npy.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "model/error.h"

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
  // Written to PATH.tmp and renamed: PATH never holds a half-written array.
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw Error(Status::Io, "cannot create '" + tmp + "': " + std::strerror(errno));
  const char magic[8] = {'\x93', 'N', 'U', 'M', 'P', 'Y', 1, 0};
  uint16_t hl = static_cast<uint16_t>(header.size());
  bool ok = std::fwrite(magic, 1, 8, f) == 8 && std::fwrite(&hl, 2, 1, f) == 1 &&
            std::fwrite(header.data(), 1, header.size(), f) == header.size() &&
            (n == 0 || std::fwrite(data, sizeof(float), n, f) == n);
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw Error(Status::Io, "write to '" + path + "' failed");
  }
}

}  // namespace colibri

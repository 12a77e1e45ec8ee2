// dtype.cpp: element type names, sizes and bulk conversion.
#include "model/dtype.h"

#include "model/error.h"

namespace colibri {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
  }
  throw Error(Status::Internal, "dtype_size: invalid dtype " + std::to_string(static_cast<uint32_t>(t)));
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
  }
  return "invalid";
}

std::optional<DType> dtype_from_name(std::string_view s) {
  if (s == "f32" || s == "F32" || s == "float32") return DType::F32;
  if (s == "f16" || s == "F16" || s == "float16") return DType::F16;
  if (s == "bf16" || s == "BF16" || s == "bfloat16") return DType::BF16;
  return std::nullopt;
}

bool dtype_valid(uint32_t raw) { return raw <= static_cast<uint32_t>(DType::BF16); }

const char* status_name(Status s) { return colibri_status_string(static_cast<colibri_status>(s)); }

}  // namespace colibri

// The C API's status names live here, with the typed errors, so every binary
// that links the model code (the library, the fuzzers) has exactly one copy.
extern "C" const char* colibri_status_string(colibri_status status) {
  switch (status) {
    case COLIBRI_OK: return "ok";
    case COLIBRI_ERR_INVALID_ARGUMENT: return "invalid argument";
    case COLIBRI_ERR_IO: return "i/o error";
    case COLIBRI_ERR_FORMAT: return "malformed model file";
    case COLIBRI_ERR_CHECKSUM: return "checksum mismatch";
    case COLIBRI_ERR_UNSUPPORTED: return "unsupported";
    case COLIBRI_ERR_OUT_OF_MEMORY: return "out of memory";
    case COLIBRI_ERR_COMM: return "communication error";
    case COLIBRI_ERR_CANCELLED: return "cancelled";
    case COLIBRI_ERR_INTERNAL: return "internal error";
    case COLIBRI_ERR_NUMERICAL: return "numerical failure";
    case COLIBRI_ERR_FILE_CHANGED: return "model file changed while in use";
  }
  return "unknown status";
}

namespace colibri {

static float load_f32(const void* src, DType t, size_t i) {
  switch (t) {
    case DType::F32: { float f; std::memcpy(&f, static_cast<const char*>(src) + 4 * i, 4); return f; }
    case DType::F16: { uint16_t h; std::memcpy(&h, static_cast<const char*>(src) + 2 * i, 2); return f16_to_f32(h); }
    case DType::BF16: { uint16_t h; std::memcpy(&h, static_cast<const char*>(src) + 2 * i, 2); return bf16_to_f32(h); }
  }
  return 0.f;
}

void convert_elements(const void* src, DType from, void* dst, DType to, size_t n) {
  if (from == to) {
    std::memcpy(dst, src, n * dtype_size(from));
    return;
  }
  char* d = static_cast<char*>(dst);
  for (size_t i = 0; i < n; ++i) {
    float f = load_f32(src, from, i);
    switch (to) {
      case DType::F32: std::memcpy(d + 4 * i, &f, 4); break;
      case DType::F16: { uint16_t h = f32_to_f16(f); std::memcpy(d + 2 * i, &h, 2); break; }
      case DType::BF16: { uint16_t h = f32_to_bf16(f); std::memcpy(d + 2 * i, &h, 2); break; }
    }
  }
}

int64_t find_non_finite(const void* data, DType t, size_t n) {
  // NOTE: an all-ones exponent is Inf or NaN in each of the three formats.
  switch (t) {
    case DType::F32: {
      const auto* u = static_cast<const uint32_t*>(data);
      for (size_t i = 0; i < n; ++i)
        if ((u[i] & 0x7f800000u) == 0x7f800000u) return static_cast<int64_t>(i);
      return -1;
    }
    case DType::BF16:
    case DType::F16: {
      const uint16_t mask = t == DType::BF16 ? 0x7f80 : 0x7c00;
      const auto* u = static_cast<const uint16_t*>(data);
      for (size_t i = 0; i < n; ++i)
        if ((u[i] & mask) == mask) return static_cast<int64_t>(i);
      return -1;
    }
  }
  return -1;
}

}  // namespace colibri

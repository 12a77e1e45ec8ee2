// quant.h: quantised storage of the routed experts' matrices (config
// "expert_quant", docs/quantization.md and docs/format.md): symmetric integer
// codes per group of `group` consecutive input elements of each output row,
// with one f16 scale per group.
//
//   int8: q in [-127, 127], d = f16(max|w| / 127); a code byte is q (two's complement).
//   int4: q in [-8, 7], d = f16(m / -8) with m the group's element of largest
//         magnitude (signed, so m itself maps to -8 exactly; d may be negative);
//         stored as the nibble q + 8. Within each packing unit of P = min(group, 32)
//         elements (P/2 bytes), byte j holds element j in its low nibble and
//         element j + P/2 in its high nibble.
//   q = clamp(round_half_even(w / d), lo, hi); the weight is q * d.
//
// A matrix [rows, cols] is its codes, row-major (cols bytes per row for int8,
// cols / 2 for int4), and separately its scales [rows, cols / group] as f16.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace colibri {

enum class QuantType : uint32_t { None = 0, Int8 = 1, Int4 = 2 };

// ExpertRecord.dtype of a quantised expert block. NOTE: part of the file format;
// never used as a DType value (those stay 0..15).
inline constexpr uint32_t kExpertStorageInt8 = 16;
inline constexpr uint32_t kExpertStorageInt4 = 17;

// Group sizes the converter accepts (each must divide the matrices' input width).
inline constexpr int kQuantGroupSizes[] = {16, 32, 64, 128};
inline constexpr int kQuantDefaultGroup = 32;

const char* quant_type_name(QuantType t);                  // "none", "int8", "int4"
bool quant_type_from_name(std::string_view s, QuantType* out);  // false when unknown
bool quant_group_supported(int64_t g);
uint32_t quant_storage_code(QuantType t);                  // kExpertStorageInt8/Int4 (0 for None)

// Packing unit (elements): min(group, 32). The activations are quantised in
// blocks of the same size (kernels/cpu/qkernels.h).
inline int64_t quant_unit(int64_t group) { return group < 32 ? group : 32; }
// Bytes of the codes of one row of `cols` elements.
inline uint64_t quant_row_bytes(QuantType t, int64_t cols) {
  return t == QuantType::Int4 ? static_cast<uint64_t>(cols) / 2 : static_cast<uint64_t>(cols);
}

// Quantises one row of `cols` f32 weights (cols a multiple of `group`) into
// quant_row_bytes codes and cols / group f16 scales. Returns false (writing
// nothing meaningful) when a weight is not finite or a scale overflows f16.
bool quantize_row(QuantType t, int64_t group, const float* w, int64_t cols, uint8_t* codes, uint16_t* scales);
// The weights a quantised row stands for: q * d, in f32.
void dequantize_row(QuantType t, int64_t group, const uint8_t* codes, const uint16_t* scales, int64_t cols, float* out);
// Code of element i of a row, as a signed integer.
int quant_code(QuantType t, int64_t group, const uint8_t* codes, int64_t i);

}  // namespace colibri

// ffn_pack.h: host weights of an FFN (as stored in a .colibri file) into the
// GPU's packed bf16 layout (kernels/cuda/ffn.h). Host code, no CUDA.
#pragma once
#include "kernels/cuda/ffn.h"
#include "model/ffn.h"

namespace colibri::cuda {

// Converts an FFN's weights (f32, f16 or bf16 as stored) into `layout` at `dst`
// (host memory of layout.bytes, e.g. a pinned staging buffer). Biases are written
// when the layout has them (zeros where the FFN has none). Throws
// Error(Unsupported) for quantised weights, Error(InvalidArgument) for a missing
// matrix or biases the layout has no room for.
void pack_ffn(const FfnWeights& w, const FfnShape& s, const PackedFfnLayout& layout, void* dst);

}  // namespace colibri::cuda

// ffn_pack.cpp: packing host FFN weights for the GPU (see ffn_pack.h).
#include "kernels/cuda/ffn_pack.h"

#include "model/dtype.h"
#include "model/error.h"

namespace colibri::cuda {

void pack_ffn(const FfnWeights& w, const FfnShape& s, const PackedFfnLayout& l, void* dst) {
  if (w.quant != QuantType::None)
    throw Error(Status::Unsupported, "the CUDA expert FFN takes f32, f16 or bf16 weights, not quantised ones");
  if (!w.gate || !w.up || !w.down) throw Error(Status::InvalidArgument, "pack_ffn: a weight matrix is missing");
  if ((w.gate_bias || w.up_bias || w.down_bias) && !l.biases)
    throw Error(Status::InvalidArgument, "pack_ffn: the FFN has biases but the layout has no room for them");
  const size_t H = static_cast<size_t>(s.hidden), I = static_cast<size_t>(s.inter);
  char* base = static_cast<char*>(dst);
  uint16_t* gu = reinterpret_cast<uint16_t*>(base + l.gate_up);
  convert_elements(w.gate, w.dtype, gu, DType::BF16, I * H);
  convert_elements(w.up, w.dtype, gu + I * H, DType::BF16, I * H);
  convert_elements(w.down, w.dtype, base + l.down, DType::BF16, H * I);
  if (l.biases) {
    auto put = [&](size_t off, const float* b, size_t n) {
      float* d = reinterpret_cast<float*>(base + off);
      for (size_t i = 0; i < n; ++i) d[i] = b ? b[i] : 0.0f;
    };
    put(l.gate_bias, w.gate_bias, I);
    put(l.up_bias, w.up_bias, I);
    put(l.down_bias, w.down_bias, H);
  }
}

}  // namespace colibri::cuda

// converter.h: Hugging Face checkpoint directory -> .colibri file.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "model/dtype.h"
#include "model/quant.h"

namespace colibri {

struct ConvertOptions {
  // Storage of matrices (dense and experts); norms stay f32. Unset: the
  // checkpoint's own dtype (that of its embedding table).
  std::optional<DType> dtype;
  // Routed experts' gate/up/down stored quantised (int8 or int4, symmetric per
  // `group_size` inputs, f16 scales; docs/quantization.md); None: in `dtype`.
  // Dense matrices stay in `dtype`, expert biases f32.
  QuantType expert_quant = QuantType::None;
  // The dense matrices of the coordinator's products (attention, dense and
  // shared FFNs, LM head: TensorSpec::quantizable) stored the same way; the
  // embedding table, routers and norms keep their storage.
  QuantType dense_quant = QuantType::None;
  int64_t group_size = kQuantDefaultGroup;  // for both
  // Embed the checkpoint's tokenizer (tokenizer.json, else tokenizer.model, with
  // tokenizer_config.json and generation_config.json) when it has one.
  bool tokenizer = true;
  // Convert weights that are NaN or infinite (or overflow the storage dtype)
  // instead of refusing them with Error(Numerical) naming the tensor.
  bool allow_non_finite = false;
  // Called after each tensor or expert block: (bytes written, total bytes, name).
  std::function<void(uint64_t, uint64_t, const std::string&)> progress;
  // Polled between tensors: non-zero (a signal number) stops the conversion
  // with Error(Cancelled); OUT is not created and its temporary is removed.
  const std::atomic<int>* interrupt = nullptr;
};

struct ConvertResult {
  uint64_t bytes = 0;
  int tensors = 0;
  int experts = 0;
  DType dtype = DType::F32;  // the matrices' storage
  QuantType expert_quant = QuantType::None;
  QuantType dense_quant = QuantType::None;
  int64_t group_size = 0;
  int dense_quantised = 0;  // dense tensors stored quantised
  std::string tokenizer_kind;    // "" when none was embedded
  int64_t tokenizer_vocab = 0;
  uint64_t tokenizer_bytes = 0;
};

// The Hugging Face tensors a checkpoint of this config holds (all that the
// converter reads), in the layout save_pretrained writes: per-expert
// gate/up/down matrices, or for gpt-oss the fused [E, H, 2I] / [E, I, H]
// experts with their biases. Used by `colibri synth` for every family.
struct HfTensor {
  enum Kind { Matrix, Norm, Bias, Embedding };
  std::string name;
  std::vector<int64_t> shape;
  Kind kind = Matrix;
};
struct ModelConfig;
std::vector<HfTensor> hf_checkpoint_plan(const ModelConfig& cfg);

// Streams tensor by tensor into a temporary beside OUT (OUT.tmp.XXXXXX) and
// renames it to OUT when complete; on any error OUT is untouched and the
// temporary removed. Refuses first an OUT that is one of the checkpoint's files
// or an existing non-regular file (Error(InvalidArgument)), and non-finite
// weights unless allowed (Error(Numerical)). Throws Error.
ConvertResult convert_checkpoint(const std::string& hf_dir, const std::string& out_path, const ConvertOptions& opts);

}  // namespace colibri

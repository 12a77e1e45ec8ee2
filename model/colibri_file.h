// colibri_file.h: the .colibri model file (see docs/format.md): a mmapped,
// validated reader and a streaming writer.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.h"
#include "model/dtype.h"
#include "model/mapped_file.h"
#include "model/quant.h"

namespace colibri {

inline constexpr char kColibriMagic[8] = {'C', 'O', 'L', 'I', 'B', 'R', 'I', '\0'};
inline constexpr uint32_t kColibriVersion = 1;
inline constexpr uint32_t kHeaderSize = 128;
inline constexpr uint64_t kBlockAlign = 4096;   // every data block starts on a page
inline constexpr uint64_t kMatrixAlign = 64;    // matrices inside an expert block
inline constexpr size_t kTensorRecordSize = 160;
inline constexpr size_t kExpertRecordSize = 64;
inline constexpr size_t kMaxTensorName = 95;    // plus a terminating NUL
inline constexpr int kMaxDims = 4;
// Tensor-directory dtype code of a block of raw bytes (shape [nbytes]): the
// embedded tokenizer file (record kTokenizerRecord). 16 and 17 are the
// quantised storage codes (model/quant.h).
inline constexpr uint32_t kRawBytesDType = 18;
inline constexpr char kTokenizerRecord[] = "tokenizer";
inline constexpr uint64_t kMaxTokenizerBytes = uint64_t(1) << 30;

// The fixed header at offset 0; all integers little-endian.
struct FileHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_size;
  uint64_t file_size;
  uint64_t config_offset;
  uint64_t config_size;
  uint64_t tensor_dir_offset;
  uint64_t tensor_count;
  uint64_t expert_index_offset;
  uint64_t expert_count;
  uint64_t data_offset;
  uint64_t meta_checksum;  // XXH3-64 of bytes [config_offset, data_offset)
  uint32_t alignment;
  uint32_t reserved0;
  uint8_t reserved[32];
};
static_assert(sizeof(FileHeader) == kHeaderSize);

struct TensorRecord {
  char name[96];
  uint32_t dtype;
  uint32_t ndim;
  int64_t shape[kMaxDims];
  uint64_t offset;
  uint64_t size;
  uint64_t checksum;  // XXH3-64 of the tensor's bytes
};
static_assert(sizeof(TensorRecord) == kTensorRecordSize);

struct ExpertRecord {
  uint32_t layer;  // the MoE layer's index among the MoE layers (ModelConfig::moe_index)
  uint32_t expert;
  uint64_t offset;
  uint64_t size;
  uint64_t checksum;  // XXH3-64 of the whole block
  uint32_t dtype;  // a DType, or kExpertStorageInt8/Int4 for quantised blocks (model/quant.h)
  uint32_t reserved;
  uint64_t gate_offset;  // relative to the block: gate [intermediate, hidden]
  uint64_t up_offset;    // up   [intermediate, hidden]
  uint64_t down_offset;  // down [hidden, intermediate]
};
static_assert(sizeof(ExpertRecord) == kExpertRecordSize);

struct TensorView {
  std::string name;
  DType dtype = DType::F32;  // NOTE: meaningless (F32) when `quant` is not None
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  uint64_t offset = 0, size = 0, checksum = 0;
  // A quantised matrix (ModelConfig::dense_quant): `data` holds its codes and
  // `scales` its f16 scales [rows, cols / quant_group] (quant_matrix_layout).
  QuantType quant = QuantType::None;
  int quant_group = 0;
  const uint16_t* scales = nullptr;
  int64_t numel() const;
};

// A quantised [rows, cols] dense matrix as stored: codes [rows][quant_row_bytes],
// then, 64-byte aligned, f16 scales [rows][cols / group].
struct QuantMatrixLayout {
  uint64_t scales_offset = 0, size = 0;
};
QuantMatrixLayout quant_matrix_layout(QuantType t, int64_t rows, int64_t cols, int64_t group);

// One expert's weights: three row-major matrices inside one contiguous block.
struct ExpertView {
  int layer = 0, expert = 0;
  DType dtype = DType::F32;  // NOTE: meaningless (F32) when `quant` is not None
  const uint8_t* block = nullptr;
  const void* gate = nullptr;  // [intermediate, hidden]
  const void* up = nullptr;    // [intermediate, hidden]
  const void* down = nullptr;  // [hidden, intermediate]
  // Quantised matrices (ModelConfig::expert_quant): gate, up and down hold the
  // codes and these their f16 scales [rows, cols / quant_group] (model/quant.h).
  QuantType quant = QuantType::None;
  int quant_group = 0;
  const uint16_t* gate_scales = nullptr;
  const uint16_t* up_scales = nullptr;
  const uint16_t* down_scales = nullptr;
  // f32 biases (ModelConfig::expert_bias), null otherwise.
  const float* gate_bias = nullptr;  // [intermediate]
  const float* up_bias = nullptr;    // [intermediate]
  const float* down_bias = nullptr;  // [hidden]
  uint64_t offset = 0, size = 0, checksum = 0;
};

// The same expert's view with its block at `block` instead (a cache slot).
ExpertView rebase(const ExpertView& e, const uint8_t* block);

uint64_t checksum64(const void* data, size_t n);

// Canonical tensor names inside a .colibri file.
namespace tname {
std::string token_embd();
std::string output_norm();
std::string output();
std::string layer(int l, const char* what);  // "blk.{l}.{what}"
}  // namespace tname

// Byte layout of one expert block for a config and dtype: gate, up, down in
// the expert dtype, then (with expert_bias) f32 gate, up and down biases, each
// part 64-byte aligned. With the config's expert_quant (dtype then ignored):
// gate codes, gate scales, up codes, up scales, down codes, down scales, biases.
struct ExpertLayout {
  uint64_t gate_offset, up_offset, down_offset, size;
  bool has_bias = false;
  uint64_t gate_bias_offset = 0, up_bias_offset = 0, down_bias_offset = 0;
  QuantType quant = QuantType::None;
  int quant_group = 0;
  uint64_t gate_scale_offset = 0, up_scale_offset = 0, down_scale_offset = 0;
};
ExpertLayout expert_layout(const ModelConfig& c, DType dtype);

// The dense tensors (name, shape) a config needs, in file order.
struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  bool is_norm = false;  // norms, biases, sinks and score biases are always stored f32
  // Stored quantised under the config's dense_quant: the matrices of the
  // coordinator's products (attention projections, dense and shared FFNs, the
  // LM head) whose inputs are whole groups (an FFN's three matrices only
  // together); never the embedding table (rows are gathered), the routers
  // (their scores decide the routing) or MLA's per-head attn_k_b / attn_v_b.
  bool quantizable = false;
};
std::vector<TensorSpec> dense_tensor_specs(const ModelConfig& c);
// How a dense tensor of this spec is stored under the config: its dense_quant
// type for a quantizable matrix, else None (stored in a DType).
QuantType dense_storage(const ModelConfig& c, const TensorSpec& s);

class ColibriFile {
 public:
  struct Options {
    bool verify_dense = true;  // check dense tensors' checksums at open
  };
  // Maps the file and validates header, config, directory and expert index
  // against the file length and the config. Throws Error(Io|Format|Checksum).
  static std::shared_ptr<ColibriFile> open(const std::string& path, Options opts);
  static std::shared_ptr<ColibriFile> open(const std::string& path) { return open(path, Options{}); }

  const ModelConfig& config() const { return config_; }
  const FileHeader& header() const { return header_; }
  const std::string& path() const { return file_.path(); }
  size_t file_size() const { return file_.size(); }
  const std::vector<TensorView>& tensors() const { return tensors_; }
  const TensorView* find(const std::string& name) const;
  const TensorView& tensor(const std::string& name) const;  // throws Error(Format)
  // Unverified view of an expert block (the worker's store verifies it).
  // `layer` is the MoE layer index (ModelConfig::moe_index), not the layer number.
  const ExpertView& expert(int layer, int expert) const;
  const std::vector<ExpertView>& experts() const { return experts_; }
  DType expert_dtype() const { return experts_.front().dtype; }
  // Checks an expert block's checksum; throws Error(Checksum) naming it, or
  // Error(FileChanged) when the file changed since it was opened (the cause).
  void verify_expert(const ExpertView& e) const;
  void verify_tensor(const TensorView& t) const;
  void prefetch(uint64_t offset, uint64_t size) const { file_.prefetch(offset, size); }
  // Throws Error(FileChanged) if the file was truncated or rewritten in place
  // since it was opened (mapped_file.h); one fstat.
  void check_unchanged() const { file_.check_unchanged(); }

  // The embedded tokenizer file (the "tokenizer" record, kind and options in
  // config().tokenizer), or null when the file has none. Not in tensors().
  const TensorView* tokenizer_block() const { return tokenizer_.data ? &tokenizer_ : nullptr; }
  bool has_tokenizer() const { return tokenizer_.data != nullptr; }
  // The checkpoint's chat template (config().tokenizer.chat_template; render it
  // with model/chat_template.h), "" when the file has none.
  const std::string& chat_template() const { return config_.tokenizer.chat_template; }
  // The tokenizer file's bytes after checking their checksum (Error(Checksum));
  // throws Error(InvalidArgument) when the file has no tokenizer.
  std::string_view tokenizer_bytes() const;

 private:
  ColibriFile() = default;
  MappedFile file_;
  FileHeader header_{};
  ModelConfig config_;
  std::vector<TensorView> tensors_;
  std::vector<ExpertView> experts_;  // [layer * num_experts + expert]
  TensorView tokenizer_;             // data null: none
};

// Streaming writer: offsets are planned up front, tensors and experts are
// written with pwrite as they come (peak memory about one tensor), the
// directory and header last, into PATH.tmp.XXXXXX, renamed to PATH by finish().
// Destroyed unfinished, it removes that temporary.
class ColibriWriter {
 public:
  struct DenseTensor {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    // Quantised (`dtype` then unused): codes and scales as quant_matrix_layout says.
    QuantType quant = QuantType::None;
    int64_t group = 0;
    // Raw bytes (`dtype` unused; shape [nbytes]): the embedded tokenizer file.
    bool raw = false;
    uint64_t bytes() const;  // stored size
  };
  ColibriWriter(const std::string& path, const ModelConfig& config, const std::vector<DenseTensor>& dense,
                DType expert_dtype);
  ~ColibriWriter();
  ColibriWriter(const ColibriWriter&) = delete;
  ColibriWriter& operator=(const ColibriWriter&) = delete;

  size_t num_dense() const;
  const DenseTensor& dense(size_t i) const;
  const ExpertLayout& layout() const;
  // `data` holds the tensor in its declared dtype.
  void write_dense(size_t i, const void* data, size_t nbytes);
  // `block` is ExpertLayout::size bytes laid out as layout() says.
  void write_expert(int layer, int expert, const void* block, size_t nbytes);
  uint64_t total_bytes() const;
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace colibri

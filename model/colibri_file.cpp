// colibri_file.cpp: .colibri reader (validation of every offset, size, shape and
// dtype before use) and streaming writer.
#include "model/colibri_file.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "model/error.h"
#include "model/file_io.h"
#include "model/printable.h"

namespace colibri {

static_assert(std::endian::native == std::endian::little, "the .colibri format is little-endian");

uint64_t checksum64(const void* data, size_t n) { return XXH3_64bits(data, n); }

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

namespace tname {
std::string token_embd() { return "token_embd"; }
std::string output_norm() { return "output_norm"; }
std::string output() { return "output"; }
std::string layer(int l, const char* what) { return "blk." + std::to_string(l) + "." + what; }
}  // namespace tname

static uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

ExpertLayout expert_layout(const ModelConfig& c, DType dtype) {
  const uint64_t H = static_cast<uint64_t>(c.hidden_size), I = static_cast<uint64_t>(c.intermediate_size);
  ExpertLayout l{};
  l.gate_offset = 0;
  QuantType qt = QuantType::None;
  if (!quant_type_from_name(c.expert_quant.type, &qt))
    throw Error(Status::Format, "invalid model config: expert_quant.type '" + printable(c.expert_quant.type) + "' is not supported");
  if (qt == QuantType::None) {
    const uint64_t mat = I * H * dtype_size(dtype);
    l.up_offset = align_up(mat, kMatrixAlign);
    l.down_offset = l.up_offset + align_up(mat, kMatrixAlign);
    l.size = l.down_offset + mat;
  } else {
    // codes then f16 scales, per matrix; gate/up are [I, H], down [H, I].
    const uint64_t G = static_cast<uint64_t>(c.expert_quant.group_size);
    const uint64_t codes = I * quant_row_bytes(qt, c.hidden_size);  // == H * quant_row_bytes(qt, I)
    const uint64_t sc_in_h = I * (H / G) * 2, sc_in_i = H * (I / G) * 2;
    l.quant = qt;
    l.quant_group = static_cast<int>(G);
    l.gate_scale_offset = align_up(codes, kMatrixAlign);
    l.up_offset = l.gate_scale_offset + align_up(sc_in_h, kMatrixAlign);
    l.up_scale_offset = l.up_offset + align_up(codes, kMatrixAlign);
    l.down_offset = l.up_scale_offset + align_up(sc_in_h, kMatrixAlign);
    l.down_scale_offset = l.down_offset + align_up(codes, kMatrixAlign);
    l.size = l.down_scale_offset + sc_in_i;
  }
  if (c.expert_bias) {
    const uint64_t ib = I * sizeof(float);
    l.has_bias = true;
    l.gate_bias_offset = align_up(l.size, kMatrixAlign);
    l.up_bias_offset = l.gate_bias_offset + align_up(ib, kMatrixAlign);
    l.down_bias_offset = l.up_bias_offset + align_up(ib, kMatrixAlign);
    l.size = l.down_bias_offset + H * sizeof(float);
  }
  return l;
}

ExpertView rebase(const ExpertView& e, const uint8_t* block) {
  ExpertView v = e;
  auto move = [&](const void* p) -> const uint8_t* {
    return p ? block + (static_cast<const uint8_t*>(p) - e.block) : nullptr;
  };
  v.block = block;
  v.gate = move(e.gate);
  v.up = move(e.up);
  v.down = move(e.down);
  v.gate_bias = reinterpret_cast<const float*>(move(e.gate_bias));
  v.up_bias = reinterpret_cast<const float*>(move(e.up_bias));
  v.down_bias = reinterpret_cast<const float*>(move(e.down_bias));
  v.gate_scales = reinterpret_cast<const uint16_t*>(move(e.gate_scales));
  v.up_scales = reinterpret_cast<const uint16_t*>(move(e.up_scales));
  v.down_scales = reinterpret_cast<const uint16_t*>(move(e.down_scales));
  return v;
}

QuantMatrixLayout quant_matrix_layout(QuantType t, int64_t rows, int64_t cols, int64_t group) {
  QuantMatrixLayout l;
  l.scales_offset = align_up(static_cast<uint64_t>(rows) * quant_row_bytes(t, cols), kMatrixAlign);
  l.size = l.scales_offset + static_cast<uint64_t>(rows) * static_cast<uint64_t>(cols / group) * 2;
  return l;
}

QuantType dense_storage(const ModelConfig& c, const TensorSpec& s) {
  QuantType t = QuantType::None;
  if (s.quantizable && quant_type_from_name(c.dense_quant.type, &t)) return t;
  return QuantType::None;
}

uint64_t ColibriWriter::DenseTensor::bytes() const {
  if (raw) return static_cast<uint64_t>(shape.at(0));
  if (quant != QuantType::None) return quant_matrix_layout(quant, shape.at(0), shape.at(1), group).size;
  uint64_t n = dtype_size(dtype);
  for (auto d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

std::vector<TensorSpec> dense_tensor_specs(const ModelConfig& c) {
  const int64_t H = c.hidden_size, nh = c.num_heads, hd = c.head_dim;
  const int64_t q = nh * hd, kv = c.num_kv_heads * hd;
  std::vector<TensorSpec> v;
  // Under dense_quant a matrix is quantised when its inputs are whole groups;
  // an FFN's three matrices only together (both widths), as they run as one.
  const int64_t G = c.dense_quant.type != "none" ? c.dense_quant.group_size : 0;
  auto whole = [&](int64_t in) { return G == 0 || in % G == 0; };
  auto mat = [&](int l, const char* w, std::vector<int64_t> shape, bool quantizable = true) {
    const bool q = quantizable && whole(shape[1]);
    v.push_back({tname::layer(l, w), std::move(shape), false, q});
  };
  auto ffn = [&](int l, const char* g, const char* u, const char* d, int64_t I) {
    const bool q = whole(H) && whole(I);
    mat(l, g, {I, H}, q);
    mat(l, u, {I, H}, q);
    mat(l, d, {H, I}, q);
  };
  auto f32 = [&](int l, const char* w, int64_t n) { v.push_back({tname::layer(l, w), {n}, true}); };
  v.push_back({tname::token_embd(), {c.vocab_size, H}});
  for (int l = 0; l < c.num_layers; ++l) {
    f32(l, "attn_norm", H);
    if (c.attention == "mla") {
      const int64_t R = c.kv_lora_rank;
      if (c.q_lora_rank > 0) {
        mat(l, "attn_q_a", {c.q_lora_rank, H});
        f32(l, "attn_q_a_norm", c.q_lora_rank);
        mat(l, "attn_q_b", {q, c.q_lora_rank});
      } else {
        mat(l, "attn_q", {q, H});
      }
      mat(l, "attn_kv_a", {R + c.qk_rope_head_dim, H});
      f32(l, "attn_kv_a_norm", R);
      // kv_b_proj split per head: K's part transposed ([R, nope] per head, to
      // absorb it into the query) and V's part ([v, R] per head).
      mat(l, "attn_k_b", {nh * R, c.qk_nope_head_dim}, false);
      mat(l, "attn_v_b", {nh * c.v_head_dim, R}, false);
      mat(l, "attn_output", {H, nh * c.v_head_dim});
    } else {
      mat(l, "attn_q", {q, H});
      mat(l, "attn_k", {kv, H});
      mat(l, "attn_v", {kv, H});
      if (c.qkv_bias) {
        f32(l, "attn_q_bias", q);
        f32(l, "attn_k_bias", kv);
        f32(l, "attn_v_bias", kv);
      }
      if (c.qk_norm == "head") {
        f32(l, "attn_q_norm", hd);
        f32(l, "attn_k_norm", hd);
      } else if (c.qk_norm == "full") {
        f32(l, "attn_q_norm", q);
        f32(l, "attn_k_norm", kv);
      }
      if (c.attn_sinks) f32(l, "attn_sinks", nh);
      mat(l, "attn_output", {H, q});
      if (c.o_bias) f32(l, "attn_output_bias", H);
    }
    f32(l, "ffn_norm", H);
    if (c.moe_index(l) < 0) {
      ffn(l, "ffn_gate", "ffn_up", "ffn_down", c.dense_intermediate_size);
      continue;
    }
    mat(l, "ffn_gate_inp", {c.num_experts, H}, false);
    if (c.routing.router_bias) f32(l, "ffn_gate_inp_bias", c.num_experts);
    if (c.routing.score_bias) f32(l, "exp_probs_b", c.num_experts);
    if (c.shared_intermediate_size > 0) {
      ffn(l, "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", c.shared_intermediate_size);
      if (c.shared_expert_gate) f32(l, "ffn_gate_inp_shexp", H);
    }
  }
  v.push_back({tname::output_norm(), {H}, true});
  if (!c.tie_word_embeddings) v.push_back({tname::output(), {c.vocab_size, H}, false, whole(H)});
  return v;
}

// ---------------------------------------------------------------------------
// Reader

namespace {

[[noreturn]] void bad(const std::string& path, const std::string& msg) {
  throw Error(Status::Format, path + ": " + msg);
}

// a + b <= limit without overflow
bool fits(uint64_t a, uint64_t b, uint64_t limit) { return a <= limit && b <= limit - a; }

}  // namespace

const TensorView* ColibriFile::find(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

const TensorView& ColibriFile::tensor(const std::string& name) const {
  const TensorView* t = find(name);
  if (!t) throw Error(Status::Format, path() + ": missing tensor '" + name + "'");
  return *t;
}

const ExpertView& ColibriFile::expert(int layer, int expert) const {
  if (layer < 0 || layer >= config_.num_moe_layers() || expert < 0 || expert >= config_.num_experts)
    throw Error(Status::InvalidArgument, "expert (" + std::to_string(layer) + ", " + std::to_string(expert) + ") out of range");
  return experts_[static_cast<size_t>(layer) * config_.num_experts + expert];
}

void ColibriFile::verify_expert(const ExpertView& e) const {
  uint64_t got = checksum64(e.block, e.size);
  if (got != e.checksum) {
    check_unchanged();  // NOTE: a file changed in use explains the mismatch: say so (Error(FileChanged))
    char buf[64];
    std::snprintf(buf, sizeof buf, "%016llx, expected %016llx", (unsigned long long)got, (unsigned long long)e.checksum);
    throw Error(Status::Checksum, path() + ": checksum mismatch in expert " + std::to_string(e.expert) + " of layer " +
                                      std::to_string(e.layer) + " (offset " + std::to_string(e.offset) + "): got " + buf);
  }
}

std::string_view ColibriFile::tokenizer_bytes() const {
  if (!tokenizer_.data)
    throw Error(Status::InvalidArgument, path() + " has no embedded tokenizer (convert the checkpoint again with its "
                                                  "tokenizer.json or tokenizer.model next to config.json)");
  verify_tensor(tokenizer_);
  return {reinterpret_cast<const char*>(tokenizer_.data), static_cast<size_t>(tokenizer_.size)};
}

void ColibriFile::verify_tensor(const TensorView& t) const {
  uint64_t got = checksum64(t.data, t.size);
  if (got != t.checksum) check_unchanged();
  if (got != t.checksum)
    throw Error(Status::Checksum, path() + ": checksum mismatch in tensor '" + printable(t.name) + "' (offset " +
                                      std::to_string(t.offset) + ")");
}

std::shared_ptr<ColibriFile> ColibriFile::open(const std::string& path, Options opts) {
  std::shared_ptr<ColibriFile> f(new ColibriFile());
  f->file_ = MappedFile(path);
  const uint64_t fsize = f->file_.size();
  const uint8_t* base = f->file_.data();
  if (fsize < kHeaderSize) bad(path, "file is " + std::to_string(fsize) + " bytes, shorter than the 128-byte header");
  FileHeader& h = f->header_;
  std::memcpy(&h, base, sizeof h);
  if (std::memcmp(h.magic, kColibriMagic, 8) != 0) bad(path, "not a .colibri file (bad magic)");
  if (h.version != kColibriVersion)
    throw Error(Status::Unsupported, path + ": format version " + std::to_string(h.version) +
                                         " is not supported (this build reads version " + std::to_string(kColibriVersion) + ")");
  if (h.header_size != kHeaderSize) bad(path, "header size " + std::to_string(h.header_size) + " != 128");
  if (h.alignment != kBlockAlign) bad(path, "alignment " + std::to_string(h.alignment) + " != 4096");
  if (h.file_size != fsize)
    bad(path, "file is " + std::to_string(fsize) + " bytes but its header says " + std::to_string(h.file_size) +
                  " (truncated or appended to)");
  if (h.config_offset != kHeaderSize) bad(path, "config offset " + std::to_string(h.config_offset) + " != 128");
  if (h.config_size == 0 || h.config_size > (16u << 20) || !fits(h.config_offset, h.config_size, fsize))
    bad(path, "config size " + std::to_string(h.config_size) + " is out of range");
  if (h.tensor_count > 1000000 || h.expert_count > 100000000) bad(path, "absurd tensor or expert count");
  const uint64_t dir_bytes = h.tensor_count * kTensorRecordSize, idx_bytes = h.expert_count * kExpertRecordSize;
  if (h.tensor_dir_offset < h.config_offset + h.config_size || !fits(h.tensor_dir_offset, dir_bytes, fsize))
    bad(path, "tensor directory [" + std::to_string(h.tensor_dir_offset) + ", +" + std::to_string(dir_bytes) +
                  ") is outside the file or overlaps the config");
  if (h.expert_index_offset < h.tensor_dir_offset + dir_bytes || !fits(h.expert_index_offset, idx_bytes, fsize))
    bad(path, "expert index is outside the file or overlaps the tensor directory");
  if (h.data_offset < h.expert_index_offset + idx_bytes || h.data_offset > fsize || h.data_offset % kBlockAlign)
    bad(path, "data offset " + std::to_string(h.data_offset) + " is misplaced or not 4096-aligned");
  if (checksum64(base + h.config_offset, h.data_offset - h.config_offset) != h.meta_checksum)
    throw Error(Status::Checksum, path + ": checksum mismatch in the config, tensor directory or expert index");

  try {
    std::string text(reinterpret_cast<const char*>(base + h.config_offset), h.config_size);
    f->config_ = ModelConfig::from_json(nlohmann::json::parse(text));
  } catch (const nlohmann::json::exception& e) {
    bad(path, std::string("embedded config is not valid JSON (") + terminal_safe(e.what()) + ")");
  } catch (const Error& e) {
    bad(path, terminal_safe(e.what()));  // NOTE: it may quote the config's strings
  }
  const ModelConfig& c = f->config_;

  struct Range { uint64_t b, e; std::string what; };
  std::vector<Range> ranges;
  auto check_block = [&](uint64_t off, uint64_t size, const std::string& what) {
    if (off % kBlockAlign) bad(path, what + " offset " + std::to_string(off) + " is not 4096-aligned");
    if (off < h.data_offset || !fits(off, size, fsize))
      bad(path, what + " [" + std::to_string(off) + ", +" + std::to_string(size) + ") lies outside the data region");
    ranges.push_back({off, off + size, what});
  };

  std::set<std::string> names;
  for (uint64_t i = 0; i < h.tensor_count; ++i) {
    TensorRecord r;
    std::memcpy(&r, base + h.tensor_dir_offset + i * kTensorRecordSize, sizeof r);
    if (std::memchr(r.name, 0, sizeof r.name) == nullptr || r.name[0] == 0)
      bad(path, "tensor record " + std::to_string(i) + " has an empty or unterminated name");
    TensorView t;
    t.name = r.name;
    std::string what = "tensor '" + printable(t.name) + "'";  // NOTE: the name's bytes come from the file
    if (!names.insert(t.name).second) bad(path, what + " appears twice");
    if (r.dtype == kRawBytesDType || t.name == kTokenizerRecord) {
      // The embedded tokenizer file: raw bytes [nbytes], named by the config.
      if (t.name != kTokenizerRecord)
        bad(path, what + " has dtype 18 (raw bytes); only the 'tokenizer' record may");
      if (r.dtype != kRawBytesDType)
        bad(path, "the 'tokenizer' record has dtype " + std::to_string(r.dtype) + ", expected 18 (raw bytes)");
      if (!c.tokenizer.present()) bad(path, "the file has a 'tokenizer' record but its config has no 'tokenizer' object");
      if (r.ndim != 1 || r.shape[0] < 1 || static_cast<uint64_t>(r.shape[0]) > kMaxTokenizerBytes)
        bad(path, "the 'tokenizer' record must have shape [nbytes] with 1 <= nbytes <= 2^30");
      if (r.size != static_cast<uint64_t>(r.shape[0]))
        bad(path, "the 'tokenizer' record's size " + std::to_string(r.size) + " does not match its shape [" +
                      std::to_string(r.shape[0]) + "]");
      check_block(r.offset, r.size, "the tokenizer block");
      t.dtype = DType::F32;  // NOTE: meaningless for raw bytes
      t.shape = {r.shape[0]};
      t.offset = r.offset;
      t.size = r.size;
      t.checksum = r.checksum;
      t.data = base + r.offset;
      f->tokenizer_ = std::move(t);
      continue;
    }
    const bool quantised = r.dtype == kExpertStorageInt8 || r.dtype == kExpertStorageInt4;
    if (!quantised && !dtype_valid(r.dtype)) bad(path, what + " has invalid dtype " + std::to_string(r.dtype));
    t.dtype = quantised ? DType::F32 : static_cast<DType>(r.dtype);
    if (r.ndim < 1 || r.ndim > kMaxDims) bad(path, what + " has " + std::to_string(r.ndim) + " dimensions");
    uint64_t numel = 1;
    for (uint32_t d = 0; d < r.ndim; ++d) {
      if (r.shape[d] < 1 || r.shape[d] > (int64_t(1) << 32)) bad(path, what + " has dimension " + std::to_string(r.shape[d]));
      // NOTE: checked before multiplying, so the count never wraps (at most 2^40).
      if (numel > (uint64_t(1) << 40) / static_cast<uint64_t>(r.shape[d])) bad(path, what + " is absurdly large");
      numel *= static_cast<uint64_t>(r.shape[d]);
      t.shape.push_back(r.shape[d]);
    }
    uint64_t want_size = numel * dtype_size(t.dtype);
    QuantMatrixLayout ql;
    if (quantised) {
      // Which tensors must be quantised is checked against the specs below.
      QuantType dq = QuantType::None;
      quant_type_from_name(c.dense_quant.type, &dq);  // validated with the config
      if (dq == QuantType::None || r.dtype != quant_storage_code(dq))
        bad(path, what + " is stored quantised (dtype " + std::to_string(r.dtype) + ") but the config's dense_quant is " +
                      c.dense_quant.type);
      if (r.ndim != 2 || t.shape[1] % c.dense_quant.group_size != 0)
        bad(path, what + " is quantised but is not a matrix whose width is a multiple of the group size " +
                      std::to_string(c.dense_quant.group_size));
      t.quant = dq;
      t.quant_group = static_cast<int>(c.dense_quant.group_size);
      ql = quant_matrix_layout(dq, t.shape[0], t.shape[1], t.quant_group);
      want_size = ql.size;
    }
    if (r.size != want_size)
      bad(path, what + " size " + std::to_string(r.size) + " does not match its shape and dtype (" +
                    std::to_string(want_size) + " bytes)");
    check_block(r.offset, r.size, what);
    t.offset = r.offset;
    t.size = r.size;
    t.checksum = r.checksum;
    t.data = base + r.offset;
    if (quantised) t.scales = reinterpret_cast<const uint16_t*>(t.data + ql.scales_offset);
    f->tensors_.push_back(std::move(t));
  }

  const uint64_t want_experts = static_cast<uint64_t>(c.num_moe_layers()) * c.num_experts;
  if (h.expert_count != want_experts)
    bad(path, "expert index has " + std::to_string(h.expert_count) + " entries; the config needs " +
                  std::to_string(want_experts) + " (" + std::to_string(c.num_moe_layers()) + " MoE layers x " +
                  std::to_string(c.num_experts) + " experts)");
  f->experts_.resize(want_experts);
  std::vector<bool> seen(want_experts, false);
  QuantType want_quant = QuantType::None;
  quant_type_from_name(c.expert_quant.type, &want_quant);  // validated with the config
  const uint32_t want_code = quant_storage_code(want_quant);
  for (uint64_t i = 0; i < h.expert_count; ++i) {
    ExpertRecord r;
    std::memcpy(&r, base + h.expert_index_offset + i * kExpertRecordSize, sizeof r);
    if (r.layer >= c.num_moe_layers() || r.expert >= c.num_experts)
      bad(path, "expert record " + std::to_string(i) + " names (layer " + std::to_string(r.layer) + ", expert " +
                    std::to_string(r.expert) + "), outside the config");
    const uint64_t slot = static_cast<uint64_t>(r.layer) * c.num_experts + r.expert;
    std::string what = "expert " + std::to_string(r.expert) + " of layer " + std::to_string(r.layer);
    if (seen[slot]) bad(path, what + " appears twice in the expert index");
    seen[slot] = true;
    // Quantised files (config expert_quant) store every expert as its storage code.
    DType dt = DType::F32;
    if (want_code != 0) {
      if (r.dtype != want_code)
        bad(path, what + " has dtype " + std::to_string(r.dtype) + " but the config's expert_quant is " +
                      c.expert_quant.type + " (" + std::to_string(want_code) + ")");
    } else {
      if (r.dtype == kExpertStorageInt8 || r.dtype == kExpertStorageInt4)
        bad(path, what + " is stored quantised (dtype " + std::to_string(r.dtype) + ") but the config has no expert_quant");
      if (!dtype_valid(r.dtype)) bad(path, what + " has invalid dtype " + std::to_string(r.dtype));
      dt = static_cast<DType>(r.dtype);
    }
    ExpertLayout lay = expert_layout(c, dt);
    if (r.size != lay.size || r.gate_offset != lay.gate_offset || r.up_offset != lay.up_offset ||
        r.down_offset != lay.down_offset)
      bad(path, what + " block layout (size " + std::to_string(r.size) + ") does not match the config (size " +
                    std::to_string(lay.size) + ")");
    check_block(r.offset, r.size, what);
    ExpertView& e = f->experts_[slot];
    e.layer = static_cast<int>(r.layer);
    e.expert = static_cast<int>(r.expert);
    e.dtype = dt;
    e.block = base + r.offset;
    e.gate = e.block + r.gate_offset;
    e.up = e.block + r.up_offset;
    e.down = e.block + r.down_offset;
    if (lay.has_bias) {
      e.gate_bias = reinterpret_cast<const float*>(e.block + lay.gate_bias_offset);
      e.up_bias = reinterpret_cast<const float*>(e.block + lay.up_bias_offset);
      e.down_bias = reinterpret_cast<const float*>(e.block + lay.down_bias_offset);
    }
    if (lay.quant != QuantType::None) {
      e.quant = lay.quant;
      e.quant_group = lay.quant_group;
      e.gate_scales = reinterpret_cast<const uint16_t*>(e.block + lay.gate_scale_offset);
      e.up_scales = reinterpret_cast<const uint16_t*>(e.block + lay.up_scale_offset);
      e.down_scales = reinterpret_cast<const uint16_t*>(e.block + lay.down_scale_offset);
    }
    e.offset = r.offset;
    e.size = r.size;
    e.checksum = r.checksum;
  }
  for (const auto& e : f->experts_)
    if (e.dtype != f->experts_.front().dtype) bad(path, "experts are stored in more than one dtype");

  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.b < b.b; });
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].b < ranges[i - 1].e) bad(path, ranges[i - 1].what + " and " + ranges[i].what + " overlap");

  const auto specs = dense_tensor_specs(c);
  for (const auto& spec : specs) {
    const TensorView* t = f->find(spec.name);
    if (!t) bad(path, "missing tensor '" + spec.name + "' required by the config");
    if (t->shape != spec.shape) {
      std::string s;
      for (auto d : spec.shape) s += (s.empty() ? "" : ", ") + std::to_string(d);
      bad(path, "tensor '" + spec.name + "' has the wrong shape for the config (expected [" + s + "])");
    }
    const QuantType want = dense_storage(c, spec);
    if (t->quant != want)
      bad(path, "tensor '" + spec.name + "' is stored " +
                    (t->quant == QuantType::None ? std::string(dtype_name(t->dtype)) : quant_type_name(t->quant)) +
                    " but the config's dense_quant says " + (want == QuantType::None ? "unquantised" : quant_type_name(want)));
  }
  for (const auto& t : f->tensors_)
    if (t.quant != QuantType::None &&
        std::none_of(specs.begin(), specs.end(), [&](const TensorSpec& s) { return s.name == t.name; }))
      bad(path, "tensor '" + printable(t.name) + "' is stored quantised but the config does not use it");
  if (c.tokenizer.present() && !f->tokenizer_.data)
    bad(path, "the config names a tokenizer (kind " + printable(c.tokenizer.kind) +
                  ") but the tensor directory has no 'tokenizer' record");
  if (opts.verify_dense) {
    for (const auto& t : f->tensors_) f->verify_tensor(t);
    if (f->tokenizer_.data) f->verify_tensor(f->tokenizer_);
  }
  return f;
}

// ---------------------------------------------------------------------------
// Writer

struct ColibriWriter::Impl {
  std::string path;
  std::unique_ptr<AtomicOutput> out;  // PATH.tmp.XXXXXX until finish()
  ModelConfig config;
  std::vector<DenseTensor> dense;
  std::vector<TensorRecord> tensor_records;
  std::vector<ExpertRecord> expert_records;
  std::vector<bool> dense_written, expert_written;
  ExpertLayout layout{};
  DType expert_dtype = DType::F32;
  std::string config_text;
  FileHeader header{};

  void pwrite_all(const void* p, size_t n, uint64_t off) { out->pwrite(p, n, off); }
};

ColibriWriter::ColibriWriter(const std::string& path, const ModelConfig& config, const std::vector<DenseTensor>& dense,
                             DType expert_dtype)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.path = path;
  m.config = config;
  m.config.fill_defaults();
  m.config.validate();
  m.dense = dense;
  m.expert_dtype = expert_dtype;
  m.layout = expert_layout(m.config, expert_dtype);
  m.config_text = m.config.to_json().dump(2);

  FileHeader& h = m.header;
  std::memcpy(h.magic, kColibriMagic, 8);
  h.version = kColibriVersion;
  h.header_size = kHeaderSize;
  h.alignment = kBlockAlign;
  h.config_offset = kHeaderSize;
  h.config_size = m.config_text.size();
  h.tensor_dir_offset = align_up(h.config_offset + h.config_size, 8);
  h.tensor_count = dense.size();
  h.expert_index_offset = h.tensor_dir_offset + h.tensor_count * kTensorRecordSize;
  h.expert_count = static_cast<uint64_t>(config.num_moe_layers()) * config.num_experts;
  h.data_offset = align_up(h.expert_index_offset + h.expert_count * kExpertRecordSize, kBlockAlign);

  uint64_t off = h.data_offset;
  for (const auto& d : dense) {
    if (d.name.size() > kMaxTensorName) throw Error(Status::InvalidArgument, "tensor name too long: " + d.name);
    if (d.shape.empty() || d.shape.size() > kMaxDims) throw Error(Status::InvalidArgument, "bad rank for " + d.name);
    TensorRecord r{};
    std::memcpy(r.name, d.name.data(), d.name.size());
    if (d.quant != QuantType::None && (d.shape.size() != 2 || d.group <= 0 || d.shape[1] % d.group != 0))
      throw Error(Status::InvalidArgument, "quantised tensor " + d.name + " is not a matrix of whole groups");
    if (d.raw && (d.shape.size() != 1 || d.shape[0] < 1 || d.name != kTokenizerRecord))
      throw Error(Status::InvalidArgument, "raw block " + d.name + " must be the 'tokenizer' record of shape [nbytes]");
    r.dtype = d.raw ? kRawBytesDType
                    : d.quant != QuantType::None ? quant_storage_code(d.quant) : static_cast<uint32_t>(d.dtype);
    r.ndim = static_cast<uint32_t>(d.shape.size());
    for (size_t i = 0; i < d.shape.size(); ++i) r.shape[i] = d.shape[i];
    const uint64_t n = d.bytes();
    r.offset = off;
    r.size = n;
    off = align_up(off + n, kBlockAlign);
    m.tensor_records.push_back(r);
  }
  for (int l = 0; l < config.num_moe_layers(); ++l)
    for (int e = 0; e < config.num_experts; ++e) {
      ExpertRecord r{};
      r.layer = static_cast<uint32_t>(l);
      r.expert = static_cast<uint32_t>(e);
      r.offset = off;
      r.size = m.layout.size;
      r.dtype = m.layout.quant != QuantType::None ? quant_storage_code(m.layout.quant) : static_cast<uint32_t>(expert_dtype);
      r.gate_offset = m.layout.gate_offset;
      r.up_offset = m.layout.up_offset;
      r.down_offset = m.layout.down_offset;
      off = align_up(off + r.size, kBlockAlign);
      m.expert_records.push_back(r);
    }
  // NOTE: the last block is padded to the alignment too, so file_size is a
  // multiple of 4096 and every block can be mapped whole.
  h.file_size = off;
  m.dense_written.assign(dense.size(), false);
  m.expert_written.assign(m.expert_records.size(), false);

  m.out = std::make_unique<AtomicOutput>(path);
  if (::ftruncate(m.out->fd(), static_cast<off_t>(h.file_size)) != 0) {
    const int e = errno;
    throw Error(Status::Io, "cannot size '" + m.out->temp_path() + "' to " + std::to_string(h.file_size) +
                                " bytes: " + std::strerror(e));
  }
}

// NOTE: an unfinished writer's AtomicOutput removes its temporary.
ColibriWriter::~ColibriWriter() = default;

size_t ColibriWriter::num_dense() const { return impl_->dense.size(); }
const ColibriWriter::DenseTensor& ColibriWriter::dense(size_t i) const { return impl_->dense.at(i); }
const ExpertLayout& ColibriWriter::layout() const { return impl_->layout; }
uint64_t ColibriWriter::total_bytes() const { return impl_->header.file_size; }

void ColibriWriter::write_dense(size_t i, const void* data, size_t nbytes) {
  Impl& m = *impl_;
  TensorRecord& r = m.tensor_records.at(i);
  if (nbytes != r.size) throw Error(Status::Internal, "write_dense: size mismatch for " + m.dense[i].name);
  r.checksum = checksum64(data, nbytes);
  m.pwrite_all(data, nbytes, r.offset);
  m.dense_written[i] = true;
}

void ColibriWriter::write_expert(int layer, int expert, const void* block, size_t nbytes) {
  Impl& m = *impl_;
  if (layer < 0 || layer >= m.config.num_moe_layers() || expert < 0 || expert >= m.config.num_experts)
    throw Error(Status::Internal, "write_expert: index out of range");
  size_t slot = static_cast<size_t>(layer) * m.config.num_experts + expert;
  ExpertRecord& r = m.expert_records[slot];
  if (nbytes != r.size) throw Error(Status::Internal, "write_expert: size mismatch");
  r.checksum = checksum64(block, nbytes);
  m.pwrite_all(block, nbytes, r.offset);
  m.expert_written[slot] = true;
}

void ColibriWriter::finish() {
  Impl& m = *impl_;
  for (size_t i = 0; i < m.dense_written.size(); ++i)
    if (!m.dense_written[i]) throw Error(Status::Internal, "finish: tensor '" + m.dense[i].name + "' was never written");
  for (size_t i = 0; i < m.expert_written.size(); ++i)
    if (!m.expert_written[i]) throw Error(Status::Internal, "finish: expert slot " + std::to_string(i) + " was never written");
  FileHeader& h = m.header;
  // Metadata region [config_offset, data_offset): config, padding, directory, index, padding.
  std::vector<uint8_t> meta(h.data_offset - h.config_offset, 0);
  std::memcpy(meta.data(), m.config_text.data(), m.config_text.size());
  std::memcpy(meta.data() + (h.tensor_dir_offset - h.config_offset), m.tensor_records.data(),
              m.tensor_records.size() * kTensorRecordSize);
  std::memcpy(meta.data() + (h.expert_index_offset - h.config_offset), m.expert_records.data(),
              m.expert_records.size() * kExpertRecordSize);
  h.meta_checksum = checksum64(meta.data(), meta.size());
  m.pwrite_all(meta.data(), meta.size(), h.config_offset);
  m.pwrite_all(&h, sizeof h, 0);
  m.out->commit();
}

}  // namespace colibri

// cmd_convert.cpp: colibri convert HF_DIR OUT.colibri [--dtype f32|bf16|f16]
//                  [--quantize-experts int8|int4] [--quantize-dense int8|int4] [--group-size 16|32|64|128]
//                  [--no-tokenizer]
#include <spdlog/spdlog.h>

#include <chrono>

#include "launcher/commands.h"
#include "launcher/signals.h"
#include "model/config.h"
#include "model/converter.h"
#include "model/error.h"

namespace colibri::cli {

int cmd_convert(int argc, char** argv) {
  cxxopts::Options o("colibri convert", "Convert a Hugging Face checkpoint directory (config.json + safetensors,\n"
                                        "single file or sharded) to one .colibri file. Writes a temporary beside OUT\n"
                                        "(OUT.tmp.XXXXXX) and renames it only when complete; refuses an OUT that is one of\n"
                                        "the checkpoint's files or an existing device, FIFO or directory, and weights\n"
                                        "that are NaN or infinite (or overflow --dtype) unless --allow-non-finite.");
  o.add_options()("input", "Hugging Face model directory", cxxopts::value<std::string>())(
      "output", "Output .colibri file", cxxopts::value<std::string>())(
      "dtype", "Storage of matrices: f32, bf16 or f16 (norms stay f32); default: the checkpoint's",
      cxxopts::value<std::string>())(
      "quantize-experts", "Store the routed experts' matrices as int8 or int4 (symmetric per group, f16 scales; "
      "dense matrices stay in --dtype unless --quantize-dense); see docs/quantization.md", cxxopts::value<std::string>())(
      "quantize-dense", "Store the dense matrices of the attention, dense and shared-expert FFNs and the LM head as "
      "int8 or int4 the same way (embedding table and routers stay in --dtype)", cxxopts::value<std::string>())(
      "group-size", "Inputs per quantisation group, for both options: 16, 32, 64 or 128 (must divide every "
      "quantised matrix's input width)", cxxopts::value<std::string>()->default_value("32"))(
      "allow-non-finite", "Convert NaN or infinite weights instead of refusing them (the model then gives "
      "non-finite logits, which generation refuses)")(
      "no-tokenizer", "Do not embed the checkpoint's tokenizer (tokenizer.json or tokenizer.model)");
  add_common_options(o);
  o.parse_positional({"input", "output"});
  o.positional_help("HF_DIR OUT.colibri");
  auto r = o.parse(argc, argv);
  if (handle_common(o, r)) return 0;
  if (!r.count("input") || !r.count("output"))
    throw Error(Status::InvalidArgument, "convert needs HF_DIR and OUT.colibri (see colibri convert --help)");
  ConvertOptions co;
  if (r.count("dtype")) {
    auto dt = dtype_from_name(r["dtype"].as<std::string>());
    if (!dt) throw Error(Status::InvalidArgument, "unknown --dtype '" + r["dtype"].as<std::string>() + "' (f32, bf16, f16)");
    co.dtype = *dt;
  }
  if (r.count("quantize-experts")) {
    const std::string q = r["quantize-experts"].as<std::string>();
    if (!quant_type_from_name(q, &co.expert_quant) || co.expert_quant == QuantType::None)
      throw Error(Status::InvalidArgument, "unknown --quantize-experts '" + q + "' (int8, int4)");
  }
  if (r.count("quantize-dense")) {
    const std::string q = r["quantize-dense"].as<std::string>();
    if (!quant_type_from_name(q, &co.dense_quant) || co.dense_quant == QuantType::None)
      throw Error(Status::InvalidArgument, "unknown --quantize-dense '" + q + "' (int8, int4)");
  }
  {
    const std::string g = r["group-size"].as<std::string>();
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(g, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != g.size() || !quant_group_supported(v))
      throw Error(Status::InvalidArgument, "--group-size '" + g + "' is not supported (supported: 16, 32, 64, 128)");
    if (r.count("group-size") && co.expert_quant == QuantType::None && co.dense_quant == QuantType::None)
      throw Error(Status::InvalidArgument, "--group-size needs --quantize-experts or --quantize-dense");
    co.group_size = v;
  }
  co.tokenizer = r.count("no-tokenizer") == 0;
  co.allow_non_finite = r.count("allow-non-finite") > 0;
  Progress prog("convert");
  co.progress = [&](uint64_t d, uint64_t t, const std::string&) { prog.update(d, t); };
  install_stop_handlers();
  co.interrupt = stop_flag();
  auto t0 = std::chrono::steady_clock::now();
  ConvertResult res;
  try {
    res = convert_checkpoint(r["input"].as<std::string>(), r["output"].as<std::string>(), co);
  } catch (const Error& e) {
    prog.finish();
    if (e.status() == Status::Cancelled && stop_flag()->load()) {
      spdlog::error("{}", e.what());
      return 128 + stop_flag()->load();
    }
    throw;
  }
  prog.finish();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string experts_as = res.expert_quant == QuantType::None
                               ? std::string()
                               : std::string(", experts ") + quant_type_name(res.expert_quant) + " group " +
                                     std::to_string(res.group_size);
  if (res.dense_quant != QuantType::None)
    experts_as += std::string(", ") + std::to_string(res.dense_quantised) + " dense matrices " +
                  quant_type_name(res.dense_quant) + " group " + std::to_string(res.group_size);
  if (!res.tokenizer_kind.empty())
    experts_as += ", tokenizer " + res.tokenizer_kind + " (" + std::to_string(res.tokenizer_vocab) + " ids, " +
                  std::to_string(res.tokenizer_bytes) + " bytes)";
  spdlog::info("wrote {} ({} tensors, {} experts, {:.1f} MiB, {}{}) in {:.2f} s", r["output"].as<std::string>(), res.tensors,
               res.experts, res.bytes / 1048576.0, dtype_name(res.dtype), experts_as, s);
  return 0;
}

}  // namespace colibri::cli

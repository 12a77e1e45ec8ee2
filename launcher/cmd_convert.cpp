// cmd_convert.cpp: colibri convert HF_DIR OUT.colibri [--dtype f32|bf16|f16]
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
                                        "single file or sharded) to one .colibri file. Writes OUT.tmp and renames it\n"
                                        "only when complete.");
  o.add_options()("input", "Hugging Face model directory", cxxopts::value<std::string>())(
      "output", "Output .colibri file", cxxopts::value<std::string>())(
      "dtype", "Storage of matrices: f32, bf16 or f16 (norms stay f32); default: the checkpoint's",
      cxxopts::value<std::string>());
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
  spdlog::info("wrote {} ({} tensors, {} experts, {:.1f} MiB, {}) in {:.2f} s", r["output"].as<std::string>(), res.tensors,
               res.experts, res.bytes / 1048576.0, dtype_name(res.dtype), s);
  return 0;
}

}  // namespace colibri::cli

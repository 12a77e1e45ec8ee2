// options.h: numeric command-line options with a checked range. Every numeric
// option of every subcommand goes through option_in_range (or option_or), so
// a value out of range is refused before any work with Error(InvalidArgument)
// (exit 11) naming the option, the value and the accepted range. A value that
// is not a number of the option's type at all (`--batch abc`, `--temperature
// nan`) is refused earlier by the option parser, as a usage error (exit 2).
#pragma once
#include <cmath>
#include <cstdio>
#include <string>
#include <type_traits>

#include "coordinator/kv_cache.h"
#include "launcher/commands.h"
#include "model/dtype.h"
#include "model/error.h"

namespace colibri::cli {

// Accepted values of a numeric option: [lo, hi], or (lo, hi] when lo_open.
template <class T>
struct Range {
  T lo, hi;
  bool lo_open = false;
  const char* note = "";  // appended to the refusal, e.g. "(0 = all cores)"
};

template <class T>
std::string option_value_str(T v) {
  if constexpr (std::is_floating_point_v<T>) {
    char b[48];
    std::snprintf(b, sizeof b, "%g", static_cast<double>(v));
    return b;
  } else {
    return std::to_string(v);
  }
}

// Throws Error(InvalidArgument) unless `v` (the value of --NAME) lies in `range`.
template <class T>
T check_option(const std::string& name, T v, const Range<T>& range) {
  bool ok = range.lo_open ? v > range.lo : v >= range.lo;
  ok = ok && v <= range.hi;
  if constexpr (std::is_floating_point_v<T>) ok = ok && std::isfinite(v);
  if (!ok)
    throw Error(Status::InvalidArgument,
                "--" + name + " " + option_value_str(v) + " is out of range: accepted " + (range.lo_open ? "(" : "[") +
                    option_value_str(range.lo) + ", " + option_value_str(range.hi) + "]" +
                    (*range.note ? std::string(" ") + range.note : std::string()));
  return v;
}

// The value of --NAME (given, or its default), checked. T must be the option's declared type.
template <class T>
T option_in_range(const cxxopts::ParseResult& r, const std::string& name, Range<T> range) {
  return check_option(name, r[name].template as<T>(), range);
}

// The same for an option without a default: `def` (not checked) when not given.
template <class T>
T option_or(const cxxopts::ParseResult& r, const std::string& name, std::type_identity_t<T> def, Range<T> range) {
  return r.count(name) ? check_option(name, r[name].template as<T>(), range) : def;
}

// The bounds shared by several subcommands.
constexpr int kMaxRanks = 65536;          // --np, --ranks, --nodes x GPUs
constexpr int64_t kMaxPositions = 1 << 24;  // tokens per sequence, context, top-k
constexpr int64_t kMaxChunk = 65536;      // --prefill-chunk, --batch
constexpr double kMinCommTimeout = 0.1, kMaxCommTimeout = 86400;  // --comm-timeout, seconds

// The KV cache's options of generate, run and batch: --kv-dtype, --kv-block and
// --kv-cache-mb (`mb_zero_means`: what 0 means). bench takes --kv-dtype alone.
inline void add_kv_options(cxxopts::Options& o, const char* mb_zero_means) {
  o.add_options()("kv-dtype", "KV cache storage: f32, bf16 or f16 (half the memory; keys and values rounded)",
                  cxxopts::value<std::string>()->default_value("f32"))(
      "kv-block", "KV cache block size in positions, 1..4096", cxxopts::value<int64_t>()->default_value("16"))(
      "kv-cache-mb", std::string("KV cache size in MiB, 0..2^24; 0 = ") + mb_zero_means,
      cxxopts::value<int64_t>()->default_value("0"));
}
// The value of --kv-dtype; Error(InvalidArgument) (exit 11) unless f32, bf16 or f16.
inline DType parse_kv_dtype(const std::string& name) {
  const auto dt = dtype_from_name(name);
  if (!dt || !KVCache::storable(*dt))
    throw Error(Status::InvalidArgument, "--kv-dtype '" + name + "' is not f32, bf16 or f16");
  return *dt;
}
// Checks them (exit 11 naming the option) and sets them in `eo`.
template <class EngineOptionsT>
void apply_kv_options(const cxxopts::ParseResult& r, EngineOptionsT& eo) {
  eo.kv_dtype = parse_kv_dtype(r["kv-dtype"].as<std::string>());
  eo.kv_block_tokens = option_in_range(r, "kv-block", Range<int64_t>{1, 4096});
  eo.kv_cache_mb = option_in_range(r, "kv-cache-mb", Range<int64_t>{0, int64_t{1} << 24, false, "(0 = whole contexts)"});
}

}  // namespace colibri::cli

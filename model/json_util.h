// json_util.h: small helpers for reading untrusted JSON.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace colibri {

// A value for an error message: primitives as JSON, structures by type name
// (dump() recurses, and a deeply nested hostile value would overflow the stack).
inline std::string json_show(const nlohmann::json& v) {
  return v.is_structured() ? std::string(v.type_name()) : v.dump();
}

}  // namespace colibri

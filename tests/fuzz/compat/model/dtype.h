// compat/model/dtype.h: lets Clang 14 compile model/dtype.h for the fuzzers.
// NOTE: Clang < 15 rejects _Float16 on x86-64 ("not supported on this target");
// __fp16 is the same IEEE binary16 as a storage type, and with -mf16c its
// conversions are single instructions (no libgcc/compiler-rt helper needed).
// The parsers under test never convert f16 values; dtype.cpp does, so it must
// compile. Found first in this directory (see CMakeLists.txt), it includes the
// real header with the spelling replaced.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

#define _Float16 __fp16
#include_next <model/dtype.h>
#undef _Float16

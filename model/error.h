// error.h: the typed error the library throws; the C API and the launcher turn it
// into a status or an exit code. Library code never calls exit().
#pragma once
#include <stdexcept>
#include <string>

#include "colibri.h"

namespace colibri {

enum class Status : int {
  Ok = COLIBRI_OK,
  InvalidArgument = COLIBRI_ERR_INVALID_ARGUMENT,
  Io = COLIBRI_ERR_IO,
  Format = COLIBRI_ERR_FORMAT,
  Checksum = COLIBRI_ERR_CHECKSUM,
  Unsupported = COLIBRI_ERR_UNSUPPORTED,
  OutOfMemory = COLIBRI_ERR_OUT_OF_MEMORY,
  Comm = COLIBRI_ERR_COMM,
  Cancelled = COLIBRI_ERR_CANCELLED,
  Internal = COLIBRI_ERR_INTERNAL,
  Numerical = COLIBRI_ERR_NUMERICAL,
  FileChanged = COLIBRI_ERR_FILE_CHANGED,
};

class Error : public std::runtime_error {
 public:
  Error(Status status, const std::string& message) : std::runtime_error(message), status_(status) {}
  Status status() const { return status_; }

 private:
  Status status_;
};

// Process exit code for a status: distinct per kind so scripts can tell them apart.
inline int exit_code(Status s) { return s == Status::Ok ? 0 : 10 + static_cast<int>(s); }

const char* status_name(Status s);

}  // namespace colibri

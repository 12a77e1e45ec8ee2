// signals.h: SIGINT/SIGTERM become a flag that long-running work polls, so an
// interrupted run stops between steps, keeps what it has and reports it as
// partial, and an interrupted conversion removes its temporary file.
#pragma once
#include <atomic>

namespace colibri::cli {

// Installs the handlers (idempotent). After a signal, stop_flag() holds its number.
void install_stop_handlers();
const std::atomic<int>* stop_flag();
const char* signal_name(int sig);

}  // namespace colibri::cli

// cmd_cache_sim.cpp: placeholder until the subcommand lands.
#include "launcher/commands.h"
#include "model/error.h"

namespace colibri::cli {
int cmd_cache_sim(int, char**) { throw Error(Status::Unsupported, "colibri: this subcommand is not built yet"); }
}  // namespace colibri::cli

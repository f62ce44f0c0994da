#include <cstdio>

#include "commands.hpp"
#include "core/capabilities.hpp"

namespace dmattn::cli {

void add_capabilities(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand(
      "capabilities", "what each backend computes (head dims, tile formats, P.V, transforms, masks), as a markdown table");
  cmd->callback([] { std::fputs(capabilities_markdown().c_str(), stdout); });
}

}  // namespace dmattn::cli

// Output-path checks and the default model's location, shared by the subcommands.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <system_error>

#include "commands.hpp"
#include "dmattn/error.hpp"
#include "model/eval.hpp"

namespace dmattn::cli {

namespace fs = std::filesystem;

void check_outputs(const std::vector<std::pair<std::string, std::string>>& outputs) {
  std::vector<std::pair<std::string, fs::path>> seen;
  for (const auto& [flag, path] : outputs) {
    if (path.empty()) continue;
    std::error_code ec;
    const fs::path full = fs::weakly_canonical(fs::absolute(path), ec);
    for (const auto& [other, p] : seen)
      if (!ec && p == full) throw Error(flag + " and " + other + " name the same file (" + path + "): give each output its own path");
    seen.emplace_back(flag, full);
    if (fs::is_directory(full, ec)) throw Error(flag + " " + path + ": is a directory");
    const fs::path dir = full.has_parent_path() ? full.parent_path() : fs::path(".");
    if (!fs::is_directory(dir, ec)) throw Error(flag + " " + path + ": no such directory (" + dir.string() + ")");
    const bool exists = fs::exists(full, ec);
    if (access(exists ? full.c_str() : dir.c_str(), W_OK) != 0) throw Error(flag + " " + path + ": cannot write there");
  }
}

std::string default_model_path() {
  if (const char* env = std::getenv("DMATTN_MODEL"); env && *env) return env;
  const fs::path rel = model::kDefaultModelPath;
  std::error_code ec;
  // The working directory and the folders above it, those above the executable (a build tree
  // inside the repository), then the source tree the tool was built from.
  std::vector<fs::path> starts{fs::current_path(ec)};
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) starts.push_back(exe.parent_path());
  starts.push_back(DMATTN_SOURCE_DIR);
  for (fs::path dir : starts)
    for (; !dir.empty(); dir = dir.parent_path()) {
      if (fs::exists(dir / rel, ec)) return (dir / rel).string();
      if (dir == dir.root_path()) break;
    }
  return rel.string();
}

}  // namespace dmattn::cli

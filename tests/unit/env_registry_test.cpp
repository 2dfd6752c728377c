// The environment registry: every variable name the library's sources mention is in the table
// of core/env_registry.hpp, nothing but that header calls getenv, and the run-time read refuses
// names the table does not list. The sources are read from the source tree, so a new getenv or
// an unregistered name added anywhere in include/ or src/ fails here.
#include <ddp/core/env_registry.hpp>

#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace ddp_test_env_registry {

namespace {

namespace fs = std::filesystem;

std::vector<fs::path> library_sources() {
  const fs::path root = fs::path(DDP_TEST_DATA_DIR).parent_path().parent_path();
  std::vector<fs::path> files;
  for (const char* dir : {"include", "src"}) {
    for (const auto& entry : fs::recursive_directory_iterator(root / dir)) {
      const auto ext = entry.path().extension();
      if (entry.is_regular_file() && (ext == ".hpp" || ext == ".cpp" || ext == ".cuh")) files.push_back(entry.path());
    }
  }
  return files;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

TEST_CASE("env_registry: every environment variable the library names is registered") {
  // A quoted name with a launcher's or ddp's prefix, or one of the bare names ddp reads.
  const std::regex variable(R"re("((?:DDP|MASTER|PET|SLURM|OMPI|PMIX|PMI|MPI|FLUX|PALS|JSM|LSB|TORCHELASTIC|WORLD|LOCAL|GROUP|ROLE|OMP|XDG)_[A-Z0-9_]+|OMPI_MCA_[a-z_]+|RANK|PATH|HOME)")re");
  const auto files = library_sources();
  REQUIRE(files.size() > 50);
  std::set<std::string> seen, unregistered;
  for (const auto& file : files) {
    const std::string text = read_file(file);
    for (auto it = std::sregex_iterator(text.begin(), text.end(), variable); it != std::sregex_iterator(); ++it) {
      const std::string name = (*it)[1].str();
      seen.insert(name);
      if (!ddp::env_registered(name)) unregistered.insert(name + " (" + file.filename().string() + ")");
    }
  }
  INFO("unregistered: " << [&] { std::string s; for (const auto& n : unregistered) s += n + " "; return s; }());
  CHECK(unregistered.empty());
  // The scan itself must see the variables it is there for (a broken pattern would pass vacuously).
  for (const char* name : {"DDP_TIMEOUT", "MASTER_ADDR", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "OMPI_MCA_ess_base_jobid", "RANK"}) {
    INFO(name);
    CHECK(seen.count(name) == 1);
  }
}

TEST_CASE("env_registry: only the registry reads the process environment") {
  const std::regex direct_read(R"(\bgetenv\s*\()");
  std::vector<std::string> readers;
  for (const auto& file : library_sources()) {
    if (file.filename() == "env_registry.hpp") continue;
    const std::string text = read_file(file);
    if (std::regex_search(text, direct_read)) readers.push_back(file.filename().string());
  }
  INFO("files calling getenv: " << [&] { std::string s; for (const auto& n : readers) s += n + " "; return s; }());
  CHECK(readers.empty());
}

TEST_CASE("env_registry: reads see the environment; unregistered names read as unset") {
  ::setenv("DDP_TCP_SPIN_US", "17", 1);
  const char* spin = ddp::read_env("DDP_TCP_SPIN_US");
  REQUIRE(spin != nullptr);
  CHECK(std::string(spin) == "17");
  ::setenv("DDP_TCP_SPIN_US", "", 1);
  CHECK(ddp::read_env("DDP_TCP_SPIN_US") != nullptr);
  CHECK(ddp::read_env_nonempty("DDP_TCP_SPIN_US") == nullptr);
  ::unsetenv("DDP_TCP_SPIN_US");
  CHECK(ddp::read_env("DDP_TCP_SPIN_US") == nullptr);

  ::setenv("DDP_NOT_A_KNOB", "1", 1);
  CHECK(ddp::read_registered_env("DDP_NOT_A_KNOB") == nullptr);
  ::unsetenv("DDP_NOT_A_KNOB");
  ::setenv("RANK", "3", 1);
  REQUIRE(ddp::read_registered_env("RANK") != nullptr);
  CHECK(std::string(ddp::read_registered_env("RANK")) == "3");
  ::unsetenv("RANK");
}

TEST_CASE("env_registry: every entry has a name and a meaning, once") {
  std::set<std::string_view> names;
  for (const auto& v : ddp::env_variables) {
    INFO(v.name);
    CHECK(!v.name.empty());
    CHECK(!v.meaning.empty());
    CHECK(names.insert(v.name).second);
  }
}

}  // namespace ddp_test_env_registry

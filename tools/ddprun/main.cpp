// ddprun: torchrun's command line over ddp::launch.
//   ddprun --standalone --nproc-per-node=2 ./train_ddp
// Bad options print one line and exit 2. When a worker fails, ddprun names the root cause first,
// then every rank's last error line (see <ddp/launch.hpp>), and the cause's exit code (or
// 128 + signal) becomes ddprun's.
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "command_line.hpp"
#include "ddp/core/env.hpp"
#include "ddp/core/env_registry.hpp"
#include "ddp/core/version.hpp"
#include "ddp/launch.hpp"

namespace {

// Optional run-time libraries are probed with dlopen, so ddprun itself needs none of them.
struct library {
  void* handle = nullptr;
  explicit library(const char* name) : handle(::dlopen(name, RTLD_NOW | RTLD_LOCAL)) {}
  ~library() {
    if (handle != nullptr) ::dlclose(handle);
  }
  library(const library&) = delete;
  library& operator=(const library&) = delete;
  template <class F>
  F* symbol(const char* name) const {
    return handle != nullptr ? reinterpret_cast<F*>(::dlsym(handle, name)) : nullptr;
  }
};

std::string cuda_info() {
  library cuda("libcuda.so.1");
  if (cuda.handle == nullptr) return "no GPU (no CUDA driver: libcuda.so.1 not found)";
  auto* init = cuda.symbol<int(unsigned)>("cuInit");
  auto* version = cuda.symbol<int(int*)>("cuDriverGetVersion");
  auto* count = cuda.symbol<int(int*)>("cuDeviceGetCount");
  if (init == nullptr || version == nullptr || count == nullptr) return "no GPU (libcuda.so.1 lacks the driver API)";
  int v = 0;
  version(&v);
  const std::string driver = "CUDA driver API " + std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
  if (const int rc = init(0); rc != 0) return driver + ", no GPU (cuInit returned " + std::to_string(rc) + ")";
  int n = 0;
  if (count(&n) != 0 || n == 0) return driver + ", no GPU (no visible devices)";
  return driver + ", " + std::to_string(n) + " visible device" + (n == 1 ? "" : "s");
}

std::string nccl_info() {
  library nccl("libnccl.so.2");
  auto* version = nccl.symbol<int(int*)>("ncclGetVersion");
  if (version == nullptr) return "not found (libnccl.so.2)";
  int v = 0;
  if (version(&v) != 0) return "found, version unknown";
  return std::to_string(v / 10000) + "." + std::to_string(v % 10000 / 100) + "." + std::to_string(v % 100);
}

std::string mpi_info() {
  for (const char* name : {"libmpi.so.40", "libmpi.so.12", "libmpi.so"}) {
    library mpi(name);
    auto* version = mpi.symbol<int(char*, int*)>("MPI_Get_library_version");
    if (version == nullptr) continue;
    std::string text(8192, '\0');  // MPI_MAX_LIBRARY_VERSION_STRING is at most this
    int len = 0;
    version(text.data(), &len);
    text.resize(static_cast<std::size_t>(len));
    if (const auto nl = text.find('\n'); nl != std::string::npos) text.resize(nl);
    while (!text.empty() && (text.back() == ',' || text.back() == ' ')) text.pop_back();
    return text;
  }
  return "not found (libmpi.so)";
}

int print_info() {
  std::printf("ddp %d.%d.%d\n", DDP_VERSION_MAJOR, DDP_VERSION_MINOR, DDP_VERSION_PATCH);
  std::printf("backends: ring (tcp, shm) always; nccl and mpi when the program is built with ddp::nccl / ddp::mpi\n");
  std::printf("cuda: %s\n", cuda_info().c_str());
  std::printf("nccl: %s\n", nccl_info().c_str());
  std::printf("mpi: %s\n", mpi_info().c_str());
  try {
    std::fputs(ddp::launch_environment::from_environment().describe().c_str(), stdout);
  } catch (const ddp::error& e) {
    std::printf("launch environment: invalid: %s\n", e.message().c_str());
  }
  return 0;
}

// One line per variable of ddp's registry: the name, padded to the longest, then its meaning.
int print_env() {
  std::size_t width = 0;
  for (const auto& v : ddp::env_variables) width = std::max(width, v.name.size());
  for (const auto& v : ddp::env_variables) {
    std::printf("%-*.*s  %.*s\n", static_cast<int>(width), static_cast<int>(v.name.size()), v.name.data(),
                static_cast<int>(v.meaning.size()), v.meaning.data());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  ddp::launcher_command cmd;
  try {
    cmd = ddp::parse_launcher_args(args);
  } catch (const ddp::error& e) {
    std::fprintf(stderr, "ddprun: %s\n", e.message().c_str());
    return 2;
  }
  if (cmd.help) {
    std::fputs(ddp::launcher_usage("ddprun").c_str(), stdout);
    return 0;
  }
  if (cmd.info) return print_info();
  if (cmd.env) return print_env();
  for (const auto& w : cmd.warnings) std::fprintf(stderr, "ddprun: warning: %s\n", w.c_str());
  try {
    return ddp::launch(cmd.options, cmd.program).exit_code;
  } catch (const ddp::error& e) {
    std::fprintf(stderr, "ddprun: %s\n", e.message().c_str());
    return e.code() == ddp::errc::config ? 2 : 1;
  }
}

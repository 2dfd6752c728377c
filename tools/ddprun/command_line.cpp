// ddprun's command line (command_line.hpp).
#include "command_line.hpp"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "ddp/core/env.hpp"
#include "ddp/core/error.hpp"

namespace ddp {

std::string launcher_usage(std::string_view name) {
  const std::string n(name);
  return "usage: " + n + " [options] program [args...]\n"
         "Starts --nproc-per-node copies of program with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,\n"
         "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT) and DDP_STORE_TOKEN set. When one fails, the\n"
         "others get the settle period to end, then are stopped (SIGTERM, then SIGKILL after the grace period);\n"
         + n + " names the root cause first, then every rank's last error line, and exits with the cause's code.\n"
         "Options (--flag value and --flag=value; '_' and '-' are the same in names):\n"
         "  --standalone              one node, rendezvous on 127.0.0.1 at a free port\n"
         "  --nnodes N                number of nodes (also N:N) [1]\n"
         "  --nproc-per-node N        workers on this node; auto or cpu = number of CPUs [1]\n"
         "  --node-rank N             this node's rank, 0 <= N < nnodes [0]\n"
         "  --master-addr ADDR        address of node 0 (required with --nnodes > 1) [127.0.0.1]\n"
         "  --master-port PORT        rendezvous port [29500; a free port with --standalone]\n"
         "  --max-restarts N          restart the whole worker group up to N times after a failure [0]\n"
         "  --grace-period SECONDS    time between SIGTERM and SIGKILL when stopping workers [5]\n"
         "  --settle-period SECONDS   after a worker fails, time the others get to end on their own (and say\n"
         "                            why) before SIGTERM; then the root cause is named first [0.5]\n"
         "  --prefix-output, --tee    prefix each output line with [rank N]\n"
         "  --cpu-bind none|cores     cores: each worker on its own equal share of this launcher's CPUs [none]\n"
         "  --no-python               accepted for torchrun compatibility (programs always run directly)\n"
         "  --rdzv-backend, --rdzv-endpoint, --rdzv-id, --rdzv-conf, --monitor-interval, --start-method,\n"
         "  --role, --log-dir, --redirects, --local-addr\n"
         "                            accepted and ignored, with a warning\n"
         "  --info                    print ddp's version, backends, devices and the launch environment\n"
         "  --env                     print every environment variable ddp reads, with its meaning\n"
         "  -h, --help                this text\n"
         "Example: " + n + " --standalone --nproc-per-node=2 ./train_ddp --epochs 3\n";
}

launcher_command parse_launcher_args(const std::vector<std::string>& args) {
  launcher_command cmd;
  auto& o = cmd.options;
  const auto bad = [](std::string m) { throw error(errc::invalid_argument, std::move(m)); };
  const auto number = [&bad](const std::string& flag, const std::string& text, int min_value) {
    const auto v = detail::parse_int64(text);
    if (!v || *v < min_value || *v > 1'000'000'000) {
      bad(flag + "='" + text + "' is not " + (min_value > 0 ? "a positive" : "a non-negative") + " integer");
    }
    return static_cast<int>(*v);
  };
  std::size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg == "-h" || arg == "--help") {
      cmd.help = true;
      return cmd;
    }
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) {
      if (!arg.empty() && arg[0] == '-' && arg != "-") bad("unknown option '" + arg + "' (see --help)");
      break;  // the program
    }
    // --name=value or --name value; '_' in names is '-'.
    const std::size_t eq = arg.find('=');
    std::string flag = arg.substr(0, eq);
    std::replace(flag.begin() + 2, flag.end(), '_', '-');
    const bool inline_value = eq != std::string::npos;
    const auto value = [&]() -> std::string {
      if (inline_value) return arg.substr(eq + 1);
      if (i + 1 >= args.size()) bad("option '" + flag + "' needs a value");
      return args[++i];
    };
    const auto no_value = [&] {
      if (inline_value) bad("option '" + flag + "' takes no value");
    };
    if (flag == "--standalone") {
      no_value();
      o.standalone = true;
    } else if (flag == "--nnodes") {
      const std::string v = value();
      const std::size_t colon = v.find(':');
      if (colon == std::string::npos) {
        o.nnodes = number(flag, v, 1);
      } else {
        const int lo = number(flag, v.substr(0, colon), 1);
        const int hi = number(flag, v.substr(colon + 1), 1);
        if (lo != hi) bad("--nnodes='" + v + "': elastic node ranges are not supported (expected N or N:N)");
        o.nnodes = lo;
      }
    } else if (flag == "--nproc-per-node") {
      const std::string v = value();
      if (v == "auto" || v == "cpu") {
        cpu_set_t set;
        CPU_ZERO(&set);
        const int cpus = ::sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
        o.nproc_per_node = cpus > 0 ? cpus : std::max(1, static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)));
      } else if (v == "gpu") {
        bad("--nproc-per-node=gpu needs the CUDA build; give a number");
      } else {
        const auto n = detail::parse_int64(v);
        if (!n || *n < 1 || *n > 1'000'000) bad("--nproc-per-node='" + v + "' is not a positive integer, 'auto' or 'cpu'");
        o.nproc_per_node = static_cast<int>(*n);
      }
    } else if (flag == "--node-rank") {
      o.node_rank = number(flag, value(), 0);
    } else if (flag == "--master-addr") {
      o.master_addr = value();
      if (o.master_addr.empty()) bad("--master-addr is empty");
    } else if (flag == "--master-port") {
      const std::string v = value();
      const auto p = detail::parse_int64(v);
      if (!p || *p < 1 || *p > 65535) bad("--master-port='" + v + "' is out of range (expected 1-65535)");
      o.master_port = static_cast<int>(*p);
    } else if (flag == "--max-restarts") {
      o.max_restarts = number(flag, value(), 0);
    } else if (flag == "--grace-period" || flag == "--settle-period") {
      const std::string v = value();
      char* end = nullptr;
      const double seconds = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || !(seconds >= 0) || seconds > 1e6) {
        bad(flag + "='" + v + "' is not a number of seconds");
      }
      (flag == "--grace-period" ? o.grace_period : o.settle_period) =
          std::chrono::milliseconds(static_cast<long long>(seconds * 1000 + 0.5));
    } else if (flag == "--prefix-output") {
      no_value();
      o.prefix_output = true;
    } else if (flag == "--tee") {
      // torchrun's --tee takes 0-3 (which streams); any non-zero value turns prefixing on.
      if (inline_value || (i + 1 < args.size() && args[i + 1].size() == 1 && args[i + 1][0] >= '0' && args[i + 1][0] <= '3')) {
        o.prefix_output = value() != "0";
      } else {
        o.prefix_output = true;
      }
    } else if (flag == "--cpu-bind") {
      const std::string v = value();
      if (v != "none" && v != "cores") bad("--cpu-bind='" + v + "' is not none or cores");
      o.bind_cpus = v == "cores";
    } else if (flag == "--no-python") {
      no_value();
    } else if (flag == "--info") {
      no_value();
      cmd.info = true;
    } else if (flag == "--env") {
      no_value();
      cmd.env = true;
    } else if (flag.rfind("--rdzv-", 0) == 0 || flag == "--monitor-interval" || flag == "--start-method" ||
               flag == "--role" || flag == "--log-dir" || flag == "--redirects" || flag == "--local-addr" ||
               flag == "--local-ranks-filter") {
      const std::string v = value();
      cmd.warnings.push_back("ignoring " + flag + "=" + v + " (ddprun has no elastic rendezvous; it uses MASTER_ADDR:MASTER_PORT)");
    } else if (flag == "--module") {
      bad("--module runs Python modules; ddprun runs programs (give the program's path)");
    } else {
      bad("unknown option '" + flag + "' (see --help)");
    }
  }
  cmd.program.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  if (cmd.program.empty() && !cmd.info && !cmd.env) bad("no program given (usage: ddprun [options] program [args...])");
  return cmd;
}

}  // namespace ddp

#pragma once
// ddprun's command line: torchrun's flags parsed into ddp::launch_options, and the usage text.
// The program's own: the library starts jobs from launch_options (ddp/launch.hpp).

#include <string>
#include <string_view>
#include <vector>

#include "ddp/launch/options.hpp"

namespace ddp {

/// A parsed launcher command line: options, then the program and its arguments.
struct launcher_command {
  launch_options options;
  std::vector<std::string> program;   // empty with help, info or env
  bool help = false;
  bool info = false;
  bool env = false;
  std::vector<std::string> warnings;  // accepted but ignored options
};

std::string launcher_usage(std::string_view name = "ddprun");

/// Parses torchrun's flags; everything from the first non-option on is the program and its
/// arguments. A bad flag is a ddp::error(errc::invalid_argument) with one line to show.
launcher_command parse_launcher_args(const std::vector<std::string>& args);

}  // namespace ddp

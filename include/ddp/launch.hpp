#pragma once
// ddp::spawn / ddp::launch, the engine of a torchrun-compatible launcher (tools/ddprun, and
// `train_ddp --nproc-per-node N`): what they do is described in ddp/launch/job.hpp.
//   ddp/launch/options.hpp  launch_options, validate()
//   ddp/launch/result.hpp   worker_status, launch_result
//   ddp/launch/job.hpp      spawn(), launch(): start this node's workers and supervise them
// Their parts (ddp::detail): the child environment (child_env.hpp), the store the launcher
// serves (store_host.hpp), the job identity (job_identity.hpp), the workers' output
// (output.hpp), the root-cause summary (root_cause.hpp) and the process helpers (process.hpp).
// torchrun's command line is ddprun's own: tools/ddprun/command_line.hpp.

#include "ddp/launch/job.hpp"
#include "ddp/launch/options.hpp"
#include "ddp/launch/result.hpp"

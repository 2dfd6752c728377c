// launch_environment: every source, the precedence between them, Slurm node lists, and each bad
// value. The environment is a table handed to from_environment(); the real one is not touched.
#include <ddp/core/env.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

// Everything of this file in its own namespace: the test suites compile several files as one
// translation unit (tests/CMakeLists.txt), where file-local helpers must not collide.
namespace ddp_test_env {

namespace {

using vars = std::map<std::string, std::string>;

ddp::launch_environment env_from(const vars& table) {
  return ddp::launch_environment::from_environment([&table](const char* name) -> const char* {
    const auto it = table.find(name);
    return it == table.end() ? nullptr : it->second.c_str();
  });
}

std::string describe(const vars& table) {
  std::string s;
  for (const auto& [k, v] : table) s += k + "=" + v + " ";
  return s;
}

struct expected_env {
  ddp::launch_source source;
  int rank, world_size, local_rank, local_world_size, node_rank, num_nodes;
  std::string master_addr;
  int master_port;
  std::string rank_from, world_from, master_addr_from;
};

}  // namespace

TEST_CASE("launch_environment reads each source and its precedence") {
  using ddp::launch_source;
  const std::vector<std::pair<vars, expected_env>> table = {
      {{}, {launch_source::none, 0, 1, 0, 1, 0, 1, "127.0.0.1", 29500, "default", "default", "default"}},
      {{{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "0"},
        {"GROUP_WORLD_SIZE", "2"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}},
       {launch_source::torchrun, 1, 4, 1, 2, 0, 2, "10.0.0.1", 1234, "RANK", "WORLD_SIZE", "MASTER_ADDR"}},
      // Only RANK and WORLD_SIZE: one node, local rank = rank.
      {{{"RANK", "1"}, {"WORLD_SIZE", "2"}},
       {launch_source::torchrun, 1, 2, 1, 2, 0, 1, "127.0.0.1", 29500, "RANK", "WORLD_SIZE", "default"}},
      // torchrun without GROUP_WORLD_SIZE: the node count follows from the local size.
      {{{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "1"},
        {"MASTER_ADDR", "head"}},
       {launch_source::torchrun, 3, 4, 1, 2, 1, 2, "head", 29500, "RANK", "WORLD_SIZE", "MASTER_ADDR"}},
      {{{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
        {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"MASTER_ADDR", "n1"}},
       {launch_source::openmpi, 3, 4, 1, 2, 1, 2, "n1", 29500, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "MASTER_ADDR"}},
      {{{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
        {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
       {launch_source::openmpi, 1, 2, 1, 2, 0, 1, "127.0.0.1", 29500, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "default"}},
      {{{"PMI_RANK", "1"}, {"PMI_SIZE", "3"}},
       {launch_source::pmi, 1, 3, 0, 3, 0, 1, "127.0.0.1", 29500, "PMI_RANK", "PMI_SIZE", "default"}},
      {{{"PMI_RANK", "2"}, {"PMI_SIZE", "3"}, {"MPI_LOCALRANKID", "2"}, {"MPI_LOCALNRANKS", "3"}},
       {launch_source::pmi, 2, 3, 2, 3, 0, 1, "127.0.0.1", 29500, "PMI_RANK", "PMI_SIZE", "default"}},
      {{{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"}, {"SLURM_TASKS_PER_NODE", "2(x2)"},
        {"SLURM_NNODES", "2"}, {"SLURM_NODEID", "1"}, {"SLURM_JOB_NODELIST", "node[01-02]"}},
       {launch_source::slurm, 3, 4, 1, 2, 1, 2, "node01", 29500, "SLURM_PROCID", "SLURM_NTASKS",
        "derived (first host of SLURM_JOB_NODELIST)"}},
      // Uneven tasks per node: this node's count.
      {{{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "7"}, {"SLURM_LOCALID", "0"}, {"SLURM_TASKS_PER_NODE", "2(x3),1"},
        {"SLURM_NNODES", "4"}, {"SLURM_NODEID", "3"}, {"SLURM_JOB_NODELIST", "gpu[7-9],cpu1"}},
       {launch_source::slurm, 6, 7, 0, 1, 3, 4, "gpu7", 29500, "SLURM_PROCID", "SLURM_NTASKS",
        "derived (first host of SLURM_JOB_NODELIST)"}},
      {{{"SLURM_PROCID", "5"}, {"SLURM_NPROCS", "6"}, {"SLURM_LOCALID", "1"}, {"SLURM_NTASKS_PER_NODE", "2"},
        {"SLURM_NNODES", "3"}, {"SLURM_NODEID", "2"}, {"SLURM_NODELIST", "a[1-2]-b[3,5]"}},
       {launch_source::slurm, 5, 6, 1, 2, 2, 3, "a1-b3", 29500, "SLURM_PROCID", "SLURM_NPROCS",
        "derived (first host of SLURM_NODELIST)"}},
      // A single-node srun without a node count.
      {{{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"}},
       {launch_source::slurm, 1, 2, 1, 2, 0, 1, "127.0.0.1", 29500, "SLURM_PROCID", "SLURM_NTASKS", "default"}},
      // torchrun inside a Slurm allocation: torchrun's variables win.
      {{{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_JOB_NODELIST", "n[1-4]"}},
       {launch_source::torchrun, 1, 2, 1, 2, 0, 1, "127.0.0.1", 29500, "RANK", "WORLD_SIZE", "default"}},
      // mpirun inside a Slurm allocation: Open MPI's variables win.
      {{{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"},
        {"PMI_RANK", "0"}, {"PMI_SIZE", "1"}},
       {launch_source::openmpi, 1, 2, 0, 2, 0, 1, "127.0.0.1", 29500, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "default"}},
      // A PMI launcher inside a Slurm step: PMI_RANK/PMI_SIZE differ from the step's, PMI wins.
      {{{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}},
       {launch_source::pmi, 1, 2, 0, 2, 0, 1, "127.0.0.1", 29500, "PMI_RANK", "PMI_SIZE", "default"}},
      // srun --mpi=pmi2: PMI_RANK/PMI_SIZE are srun's own (the same values); Slurm's local rank counts.
      {{{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"}},
       {launch_source::slurm, 1, 2, 1, 2, 0, 1, "127.0.0.1", 29500, "SLURM_PROCID", "SLURM_NTASKS", "default"}},
      // MASTER_ADDR / MASTER_PORT override the Slurm node list.
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_TASKS_PER_NODE", "1(x2)"},
        {"SLURM_NNODES", "2"}, {"SLURM_NODEID", "0"}, {"SLURM_JOB_NODELIST", "node[1-2]"}, {"MASTER_ADDR", "10.1.1.1"},
        {"MASTER_PORT", "40000"}},
       {launch_source::slurm, 0, 2, 0, 1, 0, 2, "10.1.1.1", 40000, "SLURM_PROCID", "SLURM_NTASKS", "MASTER_ADDR"}},
      // No source, but an address: still a world of one.
      {{{"MASTER_ADDR", "127.0.0.2"}, {"MASTER_PORT", "1"}},
       {launch_source::none, 0, 1, 0, 1, 0, 1, "127.0.0.2", 1, "default", "default", "MASTER_ADDR"}},
      // Empty values count as unset.
      {{{"RANK", ""}, {"WORLD_SIZE", ""}, {"MASTER_PORT", ""}},
       {launch_source::none, 0, 1, 0, 1, 0, 1, "127.0.0.1", 29500, "default", "default", "default"}},
  };
  for (const auto& [input, want] : table) {
    INFO("environment: " << describe(input));
    const auto env = env_from(input);
    CHECK(env.source() == want.source);
    CHECK(env.rank == want.rank);
    CHECK(env.world_size == want.world_size);
    CHECK(env.local_rank == want.local_rank);
    CHECK(env.local_world_size == want.local_world_size);
    CHECK(env.node_rank == want.node_rank);
    CHECK(env.num_nodes == want.num_nodes);
    CHECK(env.master_addr == want.master_addr);
    CHECK(env.master_port == want.master_port);
    CHECK(env.origin.rank == want.rank_from);
    CHECK(env.origin.world_size == want.world_from);
    CHECK(env.origin.master_addr == want.master_addr_from);
  }
}

namespace {

// One launcher's environment as that launcher sets it, and everything from_environment makes of it.
struct launcher_case {
  std::string name;
  vars input;
  ddp::launch_source source;
  int rank, world_size, local_rank, local_world_size, node_rank, num_nodes;
  std::string master_addr;
  int master_port;
  std::string job_id;
  bool from_rendezvous;
  // Origins of rank, world_size, local_rank, local_world_size, node_rank, num_nodes,
  // master_addr, master_port, job_id; and a part of origin.source.
  std::vector<std::string> origins;
  std::string source_from;
};

const std::string rdv(ddp::rendezvous_origin);
const std::string flux_id = "\xc6\x92" "2Hxq9ZLm";  // F58 job ids begin with U+0192

}  // namespace

TEST_CASE("launch_environment follows the launcher that started the process, with its job id") {
  using ddp::launch_source;
  const std::vector<launcher_case> table = {
      {"srun --mpi=pmi2, 4 nodes x 2 tasks: srun's PMI_RANK/PMI_SIZE agree with SLURM_*, whose local rank counts",
       {{"SLURM_JOB_ID", "4242"}, {"SLURM_JOBID", "4242"}, {"SLURM_STEP_ID", "0"}, {"SLURM_STEPID", "0"}, {"SLURM_PROCID", "5"},
        {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "2"}, {"SLURM_NTASKS", "8"}, {"SLURM_NPROCS", "8"}, {"SLURM_NNODES", "4"},
        {"SLURM_JOB_NUM_NODES", "4"}, {"SLURM_STEP_NUM_NODES", "4"}, {"SLURM_STEP_NUM_TASKS", "8"},
        {"SLURM_TASKS_PER_NODE", "2(x4)"}, {"SLURM_STEP_TASKS_PER_NODE", "2(x4)"}, {"SLURM_JOB_NODELIST", "gpu[01-04]"},
        {"SLURM_STEP_NODELIST", "gpu[01-04]"}, {"SLURM_NODELIST", "gpu[01-04]"}, {"SLURMD_NODENAME", "gpu03"},
        {"SLURM_TOPOLOGY_ADDR", "gpu03"}, {"SLURM_MPI_TYPE", "pmi2"}, {"SLURM_SRUN_COMM_HOST", "10.0.0.1"},
        {"SLURM_LAUNCH_NODE_IPADDR", "10.0.0.1"}, {"SLURM_CPUS_ON_NODE", "16"}, {"SLURM_GTIDS", "4,5"}, {"PMI_FD", "7"},
        {"PMI_JOBID", "4242.0"}, {"PMI_RANK", "5"}, {"PMI_SIZE", "8"}},
       launch_source::slurm, 5, 8, 1, 2, 2, 4, "gpu01", 24242, "slurm:4242.0", false,
       {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_NNODES",
        "derived (first host of SLURM_STEP_NODELIST)", "derived (SLURM_JOB_ID, SLURM_STEP_ID)", "SLURM_JOB_ID, SLURM_STEP_ID"},
       "SLURM_PROCID (PMI_RANK, PMI_SIZE agree: slurm's own PMI)"},
      {"srun --mpi=pmi2 on one node: task 1 is local rank 1 (reading PMI made every task local rank 0)",
       {{"SLURM_JOB_ID", "77"}, {"SLURM_STEP_ID", "1"}, {"SLURM_PROCID", "1"}, {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "0"},
        {"SLURM_NTASKS", "2"}, {"SLURM_NNODES", "1"}, {"SLURM_STEP_TASKS_PER_NODE", "2"}, {"SLURM_STEP_NODELIST", "node7"},
        {"SLURM_MPI_TYPE", "pmi2"}, {"PMI_FD", "5"}, {"PMI_JOBID", "77.1"}, {"PMI_RANK", "1"}, {"PMI_SIZE", "2"}},
       launch_source::slurm, 1, 2, 1, 2, 0, 1, "node7", 27996, "slurm:77.1", false,
       {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_NNODES",
        "derived (first host of SLURM_STEP_NODELIST)", "derived (SLURM_JOB_ID, SLURM_STEP_ID)", "SLURM_JOB_ID, SLURM_STEP_ID"},
       "SLURM_PROCID (PMI_RANK, PMI_SIZE agree"},
      {"srun --mpi=pmix: PMIX_* beside SLURM_*",
       {{"SLURM_JOB_ID", "4243"}, {"SLURM_STEP_ID", "1"}, {"SLURM_PROCID", "3"}, {"SLURM_LOCALID", "3"}, {"SLURM_NODEID", "0"},
        {"SLURM_NTASKS", "4"}, {"SLURM_NNODES", "1"}, {"SLURM_STEP_TASKS_PER_NODE", "4"}, {"SLURM_STEP_NODELIST", "node1"},
        {"SLURM_MPI_TYPE", "pmix"}, {"PMIX_RANK", "3"}, {"PMIX_NAMESPACE", "slurm.pmix.4243.1"},
        {"PMIX_SERVER_URI41", "pmix-server.1234;tcp4://127.0.0.1:40000"}, {"PMIX_SERVER_TMPDIR", "/var/spool/slurmd/pmix.4243.1"},
        {"PMIX_HOSTNAME", "node1"}, {"PMIX_VERSION", "4.2.9"}},
       launch_source::slurm, 3, 4, 3, 4, 0, 1, "node1", 32162, "slurm:4243.1", false,
       {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_NNODES",
        "derived (first host of SLURM_STEP_NODELIST)", "derived (SLURM_JOB_ID, SLURM_STEP_ID)", "SLURM_JOB_ID, SLURM_STEP_ID"},
       "SLURM_PROCID"},
      {"mpirun (Open MPI 4) inside a Slurm allocation: the orted's srun step is not the rank's",
       {{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
        {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}, {"OMPI_COMM_WORLD_NODE_RANK", "1"}, {"OMPI_UNIVERSE_SIZE", "8"},
        {"OMPI_MCA_ess_base_jobid", "3178692609"}, {"OMPI_MCA_ess_base_vpid", "5"}, {"PMIX_RANK", "5"},
        {"PMIX_NAMESPACE", "3178692609"}, {"SLURM_JOB_ID", "4244"}, {"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "1"},
        {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "1"}, {"SLURM_NNODES", "2"},
        {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"}, {"SLURM_JOB_NODELIST", "cn[1-2]"}, {"MASTER_ADDR", "cn1"}},
       launch_source::openmpi, 5, 8, 1, 4, 1, 2, "cn1", 29633, "openmpi:3178692609", false,
       {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
        "derived (OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_LOCAL_SIZE)", "derived (OMPI_COMM_WORLD_SIZE / OMPI_COMM_WORLD_LOCAL_SIZE)",
        "MASTER_ADDR", "derived (OMPI_MCA_ess_base_jobid)", "OMPI_MCA_ess_base_jobid"},
       "OMPI_COMM_WORLD_RANK (mpirun inside a slurm job: over SLURM_PROCID)"},
      {"mpirun (Open MPI 5) in a Slurm batch script: the job id is the PMIx namespace",
       {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
        {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"PMIX_NAMESPACE", "prterun-login1-4242@1"}, {"PMIX_RANK", "1"},
        {"SLURM_JOB_ID", "4250"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_JOB_NODELIST", "cn5"}},
       launch_source::openmpi, 1, 2, 1, 2, 0, 1, "127.0.0.1", 22586, "openmpi:prterun-login1-4242@1", false,
       {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "default",
        "derived (single node)", "default", "derived (PMIX_NAMESPACE)", "PMIX_NAMESPACE"},
       "OMPI_COMM_WORLD_RANK"},
      {"hydra's mpiexec inside Slurm: its proxies' srun step numbers nodes; MPI_LOCALRANKID marks hydra",
       {{"PMI_RANK", "5"}, {"PMI_SIZE", "8"}, {"PMI_FD", "6"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "4"},
        {"SLURM_JOB_ID", "4245"}, {"SLURM_STEP_ID", "2"}, {"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"},
        {"SLURM_NODEID", "1"}, {"SLURM_NNODES", "2"}, {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"}, {"SLURM_STEP_NODELIST", "cn[1-2]"},
        {"SLURM_JOB_NODELIST", "cn[1-2]"}, {"MASTER_ADDR", "cn1"}, {"MASTER_PORT", "29600"}},
       launch_source::pmi, 5, 8, 1, 4, 1, 2, "cn1", 29600, "", false,
       {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "derived (PMI_RANK / MPI_LOCALNRANKS)",
        "derived (PMI_SIZE / MPI_LOCALNRANKS)", "MASTER_ADDR", "MASTER_PORT", "default"},
       "PMI_RANK with MPI_LOCALRANKID (hydra's mpiexec)"},
      {"hydra inside Slurm with one rank per node: PMI agrees with the step, MPI_LOCALRANKID still marks hydra",
       {{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "0"}, {"MPI_LOCALNRANKS", "1"}, {"SLURM_PROCID", "1"},
        {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "1"}, {"SLURM_NNODES", "2"}, {"SLURM_JOB_ID", "4246"},
        {"SLURM_STEP_ID", "0"}, {"SLURM_STEP_NODELIST", "cn[1-2]"}, {"MASTER_ADDR", "cn1"}, {"MASTER_PORT", "29601"}},
       launch_source::pmi, 1, 2, 0, 1, 1, 2, "cn1", 29601, "", false,
       {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "derived (PMI_RANK / MPI_LOCALNRANKS)",
        "derived (PMI_SIZE / MPI_LOCALNRANKS)", "MASTER_ADDR", "MASTER_PORT", "default"},
       "hydra"},
      {"a PMI launcher inside a Slurm step, no MPI_LOCALRANKID: PMI differs from SLURM_*, PMI wins",
       {{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_JOB_ID", "7"}},
       launch_source::pmi, 1, 2, 0, 2, 0, 1, "127.0.0.1", 29500, "", false,
       {"PMI_RANK", "PMI_SIZE", "default", "derived (PMI_SIZE, single node)", "default", "derived (single node)", "default",
        "default", "default"},
       "PMI_RANK (differs from SLURM_PROCID: a PMI launcher inside the slurm task)"},
      {"PyTorchJob master pod (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT only): layout at rendezvous",
       {{"MASTER_ADDR", "mnist-master-0"}, {"MASTER_PORT", "23456"}, {"WORLD_SIZE", "2"}, {"RANK", "0"}, {"PYTHONUNBUFFERED", "0"}},
       launch_source::torchrun, 0, 2, 0, 1, 0, 2, "mnist-master-0", 23456, "", true,
       {"RANK", "WORLD_SIZE", rdv, rdv, rdv, rdv, "MASTER_ADDR", "MASTER_PORT", "default"}, "RANK"},
      {"PyTorchJob worker pod, one GPU: local rank 0 (provisional), not RANK=1",
       {{"MASTER_ADDR", "mnist-master-0"}, {"MASTER_PORT", "23456"}, {"WORLD_SIZE", "2"}, {"RANK", "1"}, {"PYTHONUNBUFFERED", "0"}},
       launch_source::torchrun, 1, 2, 0, 1, 1, 2, "mnist-master-0", 23456, "", true,
       {"RANK", "WORLD_SIZE", rdv, rdv, rdv, rdv, "MASTER_ADDR", "MASTER_PORT", "default"}, "RANK"},
      {"PyTorchJob, 4 pods on 1 or 2 hosts: the environment cannot tell, the rendezvous will",
       {{"MASTER_ADDR", "mnist-master-0"}, {"MASTER_PORT", "23456"}, {"WORLD_SIZE", "4"}, {"RANK", "3"}},
       launch_source::torchrun, 3, 4, 0, 1, 3, 4, "mnist-master-0", 23456, "", true,
       {"RANK", "WORLD_SIZE", rdv, rdv, rdv, rdv, "MASTER_ADDR", "MASTER_PORT", "default"}, "RANK"},
      {"PyTorchJob with nprocPerNode: 1 (PET_*): one process per pod, node PET_NODE_RANK of PET_NNODES",
       {{"MASTER_ADDR", "job-master-0"}, {"PET_MASTER_ADDR", "job-master-0"}, {"MASTER_PORT", "23456"},
        {"PET_MASTER_PORT", "23456"}, {"WORLD_SIZE", "3"}, {"RANK", "2"}, {"PET_NODE_RANK", "2"}, {"PET_NPROC_PER_NODE", "1"},
        {"PET_NNODES", "3"}},
       launch_source::torchrun, 2, 3, 0, 1, 2, 3, "job-master-0", 23456, "", false,
       {"RANK", "WORLD_SIZE", "derived (PET_NPROC_PER_NODE=1)", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_NNODES",
        "MASTER_ADDR", "MASTER_PORT", "default"},
       "RANK"},
      {"PyTorchJob with nprocPerNode: auto and WORLD_SIZE == PET_NNODES: one process per pod",
       {{"MASTER_ADDR", "job-master-0"}, {"MASTER_PORT", "23456"}, {"WORLD_SIZE", "2"}, {"RANK", "1"}, {"PET_NODE_RANK", "1"},
        {"PET_NPROC_PER_NODE", "auto"}, {"PET_NNODES", "2"}},
       launch_source::torchrun, 1, 2, 0, 1, 1, 2, "job-master-0", 23456, "", false,
       {"RANK", "WORLD_SIZE", "derived (WORLD_SIZE == PET_NNODES: one process per pod)",
        "derived (WORLD_SIZE == PET_NNODES: one process per pod)", "PET_NODE_RANK", "PET_NNODES", "MASTER_ADDR", "MASTER_PORT",
        "default"},
       "RANK"},
      {"PyTorchJob, elastic PET_NNODES=1:4: the layout is left to the rendezvous",
       {{"MASTER_ADDR", "job-master-0"}, {"MASTER_PORT", "23456"}, {"WORLD_SIZE", "2"}, {"RANK", "1"}, {"PET_NNODES", "1:4"},
        {"PET_RDZV_BACKEND", "c10d"}, {"PET_RDZV_ENDPOINT", "job-worker-0:23456"}},
       launch_source::torchrun, 1, 2, 0, 1, 1, 2, "job-master-0", 23456, "", true,
       {"RANK", "WORLD_SIZE", rdv, rdv, rdv, rdv, "MASTER_ADDR", "MASTER_PORT", "default"}, "RANK"},
      {"Kubeflow Trainer's PET_MASTER_ADDR / PET_MASTER_PORT without MASTER_*",
       {{"WORLD_SIZE", "2"}, {"RANK", "0"}, {"PET_NPROC_PER_NODE", "1"}, {"PET_NNODES", "2"}, {"PET_NODE_RANK", "0"},
        {"PET_MASTER_ADDR", "train-node-0-0.train"}, {"PET_MASTER_PORT", "29400"}},
       launch_source::torchrun, 0, 2, 0, 1, 0, 2, "train-node-0-0.train", 29400, "", false,
       {"RANK", "WORLD_SIZE", "derived (PET_NPROC_PER_NODE=1)", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_NNODES",
        "PET_MASTER_ADDR", "PET_MASTER_PORT", "default"},
       "RANK"},
      {"a script exporting RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS: Slurm's layout and job id",
       {{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "node01"}, {"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"},
        {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "1"}, {"SLURM_NNODES", "2"}, {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"},
        {"SLURM_STEP_NODELIST", "node[01-02]"}, {"SLURM_JOB_ID", "99"}, {"SLURM_STEP_ID", "0"}},
       launch_source::torchrun, 3, 4, 1, 2, 1, 2, "node01", 20099, "slurm:99.0", false,
       {"RANK", "WORLD_SIZE", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_NNODES", "MASTER_ADDR",
        "derived (SLURM_JOB_ID, SLURM_STEP_ID)", "SLURM_JOB_ID, SLURM_STEP_ID"},
       "RANK, WORLD_SIZE (the same as SLURM_PROCID, SLURM_NTASKS: local layout from slurm)"},
      {"the same script without MASTER_ADDR: the first host of the step",
       {{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"},
        {"SLURM_NODEID", "0"}, {"SLURM_NNODES", "2"}, {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"},
        {"SLURM_STEP_NODELIST", "node[01-02]"}, {"SLURM_JOB_ID", "99"}, {"SLURM_STEP_ID", "0"}, {"MASTER_PORT", "29555"}},
       launch_source::torchrun, 0, 4, 0, 2, 0, 2, "node01", 29555, "slurm:99.0", false,
       {"RANK", "WORLD_SIZE", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_NNODES",
        "derived (first host of SLURM_STEP_NODELIST)", "MASTER_PORT", "SLURM_JOB_ID, SLURM_STEP_ID"},
       "local layout from slurm"},
      {"RANK and WORLD_SIZE with a loopback MASTER_ADDR: one host, local rank = rank",
       {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}},
       launch_source::torchrun, 1, 2, 1, 2, 0, 1, "127.0.0.1", 29500, "", false,
       {"RANK", "WORLD_SIZE", "derived (RANK, single node)", "derived (WORLD_SIZE, single node)", "default",
        "derived (single node)", "MASTER_ADDR", "MASTER_PORT", "default"},
       "RANK"},
      {"flux run -N2 -n8: 4 tasks per node",
       {{"FLUX_JOB_ID", flux_id}, {"FLUX_JOB_SIZE", "8"}, {"FLUX_JOB_NNODES", "2"}, {"FLUX_TASK_RANK", "5"},
        {"FLUX_TASK_LOCAL_ID", "1"}, {"FLUX_URI", "local:///tmp/flux-abc/local-1"}, {"FLUX_KVS_NAMESPACE", "job-12345"},
        {"FLUX_JOB_TMPDIR", "/tmp/flux-abc/jobtmp-1-" + flux_id}, {"PMI_RANK", "5"}, {"PMI_SIZE", "8"}, {"PMI_FD", "12"},
        {"FLUX_PMI_LIBRARY_PATH", "/usr/lib64/flux/libpmi.so"}, {"MASTER_ADDR", "fluke1"}},
       launch_source::flux, 5, 8, 1, 4, 1, 2, "fluke1", 30853, "flux:" + flux_id, false,
       {"FLUX_TASK_RANK", "FLUX_JOB_SIZE", "FLUX_TASK_LOCAL_ID", "derived (FLUX_JOB_SIZE / FLUX_JOB_NNODES)",
        "derived (FLUX_TASK_RANK / tasks per node, block task map)", "FLUX_JOB_NNODES", "MASTER_ADDR", "derived (FLUX_JOB_ID)",
        "FLUX_JOB_ID"},
       "FLUX_TASK_RANK (PMI_RANK, PMI_SIZE agree: flux's own PMI)"},
      {"flux run -N2 -n7: uneven, so the tasks per node come from the rendezvous",
       {{"FLUX_JOB_ID", flux_id}, {"FLUX_JOB_SIZE", "7"}, {"FLUX_JOB_NNODES", "2"}, {"FLUX_TASK_RANK", "6"},
        {"FLUX_TASK_LOCAL_ID", "2"}, {"MASTER_ADDR", "fluke1"}, {"MASTER_PORT", "29700"}},
       launch_source::flux, 6, 7, 2, 4, 1, 2, "fluke1", 29700, "flux:" + flux_id, true,
       {"FLUX_TASK_RANK", "FLUX_JOB_SIZE", "FLUX_TASK_LOCAL_ID", rdv, rdv, "FLUX_JOB_NNODES", "MASTER_ADDR", "MASTER_PORT",
        "FLUX_JOB_ID"},
       "FLUX_TASK_RANK"},
      {"Cray PALS mpiexec -n 8 --ppn 4 (PBS): PALS before its own PMI_*",
       {{"PALS_APID", "3f9d2c1e-8b7a-4c55-9e0f-1a2b3c4d5e6f"}, {"PALS_RANKID", "5"}, {"PALS_LOCAL_RANKID", "1"},
        {"PALS_NODEID", "1"}, {"PALS_DEPTH", "8"}, {"PALS_SPOOL_DIR", "/var/run/palsd/3f9d2c1e"}, {"PMI_RANK", "5"},
        {"PMI_SIZE", "8"}, {"PMI_LOCAL_RANK", "1"}, {"PMI_LOCAL_SIZE", "4"}, {"PMI_UNIVERSE_SIZE", "8"},
        {"PMI_JOBID", "3f9d2c1e-8b7a-4c55-9e0f-1a2b3c4d5e6f"}, {"PMI_CONTROL_PORT", "11997"}, {"PMI_SHARED_SECRET", "1234567"},
        {"PMI_NO_FORK", "1"}, {"PMI_NO_PREINITIALIZE", "1"}, {"PBS_JOBID", "1234.polaris-pbs-01"},
        {"MASTER_ADDR", "x3001c0s1b0n0"}},
       launch_source::pals, 5, 8, 1, 4, 1, 2, "x3001c0s1b0n0", 21349, "pals:3f9d2c1e-8b7a-4c55-9e0f-1a2b3c4d5e6f", false,
       {"PALS_RANKID", "PMI_SIZE", "PALS_LOCAL_RANKID", "PMI_LOCAL_SIZE", "PALS_NODEID", "derived (PMI_SIZE / PMI_LOCAL_SIZE)",
        "MASTER_ADDR", "derived (PALS_APID)", "PALS_APID"},
       "PALS_RANKID (PMI_RANK, PMI_SIZE agree: pals's own PMI)"},
      {"LSF jsrun -n 8 -r 4: JSM_NAMESPACE_*, with jsrun's duplicate OMPI_COMM_WORLD_*",
       {{"LSB_JOBID", "5678"}, {"LSB_JOBINDEX", "0"}, {"LSB_JOBNAME", "train"}, {"LSB_MCPU_HOSTS", "batch1 1 h1 42 h2 42"},
        {"JSM_NAMESPACE_RANK", "5"}, {"JSM_NAMESPACE_SIZE", "8"}, {"JSM_NAMESPACE_LOCAL_RANK", "1"},
        {"JSM_NAMESPACE_LOCAL_SIZE", "4"}, {"JSM_GPU_ASSIGNMENTS", "1"}, {"OMPI_COMM_WORLD_RANK", "5"},
        {"OMPI_COMM_WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
        {"PMIX_RANK", "5"}, {"MASTER_ADDR", "h1"}},
       launch_source::lsf, 5, 8, 1, 4, 1, 2, "h1", 25678, "lsf:5678", false,
       {"JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_LOCAL_SIZE",
        "derived (JSM_NAMESPACE_RANK / JSM_NAMESPACE_LOCAL_SIZE)", "derived (JSM_NAMESPACE_SIZE / JSM_NAMESPACE_LOCAL_SIZE)",
        "MASTER_ADDR", "derived (LSB_JOBID)", "LSB_JOBID"},
       "JSM_NAMESPACE_RANK (OMPI_COMM_WORLD_RANK, _SIZE agree: jsrun's own)"},
      {"mpirun inside a one-task jsrun: Open MPI's variables differ from JSM's and win",
       {{"LSB_JOBID", "5679"}, {"JSM_NAMESPACE_RANK", "0"}, {"JSM_NAMESPACE_SIZE", "1"}, {"JSM_NAMESPACE_LOCAL_RANK", "0"},
        {"JSM_NAMESPACE_LOCAL_SIZE", "1"}, {"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"},
        {"OMPI_COMM_WORLD_LOCAL_RANK", "2"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}, {"OMPI_MCA_ess_base_jobid", "12345"}},
       launch_source::openmpi, 2, 4, 2, 4, 0, 1, "127.0.0.1", 32345, "openmpi:12345", false,
       {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "default",
        "derived (single node)", "default", "derived (OMPI_MCA_ess_base_jobid)", "OMPI_MCA_ess_base_jobid"},
       "OMPI_COMM_WORLD_RANK (mpirun inside a lsf job"},
      {"an element of an LSF job array: LSB_JOBID[LSB_JOBINDEX]",
       {{"LSB_JOBID", "5678"}, {"LSB_JOBINDEX", "3"}, {"JSM_NAMESPACE_RANK", "0"}, {"JSM_NAMESPACE_SIZE", "1"}},
       launch_source::lsf, 0, 1, 0, 1, 0, 1, "127.0.0.1", 32197, "lsf:5678[3]", false,
       {"JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "default", "derived (JSM_NAMESPACE_SIZE, single node)", "default",
        "derived (single node)", "default", "derived (LSB_JOBID, LSB_JOBINDEX)", "LSB_JOBID, LSB_JOBINDEX"},
       "JSM_NAMESPACE_RANK"},
      {"torchrun --rdzv-id inside srun: TORCHELASTIC_RUN_ID names the job",
       {{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "1"},
        {"GROUP_WORLD_SIZE", "2"}, {"ROLE_RANK", "3"}, {"ROLE_WORLD_SIZE", "4"}, {"ROLE_NAME", "default"},
        {"MASTER_ADDR", "node1"}, {"MASTER_PORT", "29400"}, {"TORCHELASTIC_RUN_ID", "f1d2d2f9"},
        {"TORCHELASTIC_RESTART_COUNT", "0"}, {"TORCHELASTIC_MAX_RESTARTS", "0"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"},
        {"OMP_NUM_THREADS", "1"}, {"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", "88"}, {"SLURM_STEP_ID", "0"}},
       launch_source::torchrun, 3, 4, 1, 2, 1, 2, "node1", 29400, "torchrun:f1d2d2f9", false,
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RUN_ID"},
       "RANK"},
      {"torchrun's static rendezvous (run id 'none'): no job id, the allocation's is not borrowed",
       {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
        {"MASTER_PORT", "29500"}, {"TORCHELASTIC_RUN_ID", "none"}, {"SLURM_JOB_ID", "88"}},
       launch_source::torchrun, 1, 2, 1, 2, 0, 1, "127.0.0.1", 29500, "", false,
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "default", "derived (single node)", "MASTER_ADDR", "MASTER_PORT",
        "default"},
       "RANK"},
      {"ddprun's worker: DDP_JOB_ID verbatim",
       {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "0"},
        {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "41000"}, {"DDP_JOB_ID", "ddprun:7f3a9c"}, {"DDP_STORE_TOKEN", "t"},
        {"TORCHELASTIC_RESTART_COUNT", "0"}, {"TORCHELASTIC_RUN_ID", "ignored"}},
       launch_source::torchrun, 1, 2, 1, 2, 0, 1, "127.0.0.1", 41000, "ddprun:7f3a9c", false,
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "derived (single node)", "MASTER_ADDR",
        "MASTER_PORT", "DDP_JOB_ID"},
       "RANK"},
      {"DDP_JOB_ID over Slurm's id, and the default port from it",
       {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_JOB_ID", "5"}, {"SLURM_STEP_ID", "0"}, {"DDP_JOB_ID", "ddprun:7f3a9c"}},
       launch_source::slurm, 0, 1, 0, 1, 0, 1, "127.0.0.1", 22403, "ddprun:7f3a9c", false,
       {"SLURM_PROCID", "SLURM_NTASKS", "default", "derived (SLURM_NTASKS, single node)", "default", "derived (single node)",
        "default", "derived (DDP_JOB_ID)", "DDP_JOB_ID"},
       "SLURM_PROCID"},
      {"Slurm without MASTER_PORT: step 3 of job 1234 gets 20000 + (1234 + 3 x 7919) % 12768",
       {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_JOB_ID", "1234"}, {"SLURM_STEP_ID", "3"},
        {"SLURM_STEP_NODELIST", "n1"}},
       launch_source::slurm, 0, 2, 0, 2, 0, 1, "n1", 32223, "slurm:1234.3", false,
       {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "derived (SLURM_NTASKS, single node)", "default",
        "derived (single node)", "derived (first host of SLURM_STEP_NODELIST)", "derived (SLURM_JOB_ID, SLURM_STEP_ID)",
        "SLURM_JOB_ID, SLURM_STEP_ID"},
       "SLURM_PROCID"},
      {"Slurm's old spelling SLURM_JOBID without a step: 20000 + 1234",
       {{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"}, {"SLURM_JOBID", "1234"}},
       launch_source::slurm, 1, 2, 1, 2, 0, 1, "127.0.0.1", 21234, "slurm:1234", false,
       {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "derived (SLURM_NTASKS, single node)", "default",
        "derived (single node)", "default", "derived (SLURM_JOBID)", "SLURM_JOBID"},
       "SLURM_PROCID"},
  };
  for (const auto& c : table) {
    INFO(c.name << "\nenvironment: " << describe(c.input));
    const auto env = env_from(c.input);
    INFO(env.describe());
    CHECK(env.source() == c.source);
    CHECK(env.rank == c.rank);
    CHECK(env.world_size == c.world_size);
    CHECK(env.local_rank == c.local_rank);
    CHECK(env.local_world_size == c.local_world_size);
    CHECK(env.node_rank == c.node_rank);
    CHECK(env.num_nodes == c.num_nodes);
    CHECK(env.master_addr == c.master_addr);
    CHECK(env.master_port == c.master_port);
    CHECK(env.job_id == c.job_id);
    CHECK(env.local_layout_from_rendezvous == c.from_rendezvous);
    REQUIRE(c.origins.size() == 9);
    CHECK(env.origin.rank == c.origins[0]);
    CHECK(env.origin.world_size == c.origins[1]);
    CHECK(env.origin.local_rank == c.origins[2]);
    CHECK(env.origin.local_world_size == c.origins[3]);
    CHECK(env.origin.node_rank == c.origins[4]);
    CHECK(env.origin.num_nodes == c.origins[5]);
    CHECK(env.origin.master_addr == c.origins[6]);
    CHECK(env.origin.master_port == c.origins[7]);
    CHECK(env.origin.job_id == c.origins[8]);
    CHECK_THAT(env.origin.source, Catch::Contains(c.source_from));
  }
}

TEST_CASE("launch_environment's default port spreads jobs and steps over 20000-32767, below the ephemeral ports") {
  // Consecutive jobs, and the steps of one job, get distinct ports; non-numeric ids are hashed.
  std::vector<int> ports;
  for (int job = 1000; job < 1100; ++job) {
    for (int step = 0; step < 4; ++step) {
      const auto env = env_from({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_JOB_ID", std::to_string(job)},
                                 {"SLURM_STEP_ID", std::to_string(step)}});
      CHECK(env.master_port >= 20000);
      CHECK(env.master_port < 32768);
      ports.push_back(env.master_port);
    }
  }
  std::sort(ports.begin(), ports.end());
  CHECK(std::adjacent_find(ports.begin(), ports.end()) == ports.end());
  // Every rank of the job computes the same port.
  const auto a = env_from({{"FLUX_TASK_RANK", "0"}, {"FLUX_JOB_SIZE", "2"}, {"FLUX_JOB_ID", "f3abc"}});
  const auto b = env_from({{"FLUX_TASK_RANK", "1"}, {"FLUX_JOB_SIZE", "2"}, {"FLUX_JOB_ID", "f3abc"}, {"FLUX_TASK_LOCAL_ID", "1"}});
  CHECK(a.master_port == b.master_port);
  CHECK(a.master_port != env_from({{"FLUX_TASK_RANK", "0"}, {"FLUX_JOB_SIZE", "2"}, {"FLUX_JOB_ID", "f3abd"}}).master_port);
  // A derived port has 7 alternates in the same range, distinct from it and from each other,
  // 4099 apart modulo 12768; the same on every rank.
  CHECK(a.master_port_alternates == b.master_port_alternates);
  const auto slurm = env_from({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", "1234"}});
  REQUIRE(slurm.master_port == 21234);
  CHECK(slurm.master_port_alternates == std::vector<int>{25333, 29432, 20763, 24862, 28961, 20292, 24391});
  for (const auto& env : {a, slurm}) {
    std::vector<int> all = env.master_port_alternates;
    all.push_back(env.master_port);
    CHECK(all.size() == 8);
    for (const int p : all) CHECK((p >= 20000 && p < 32768));
    std::sort(all.begin(), all.end());
    CHECK(std::adjacent_find(all.begin(), all.end()) == all.end());
  }
  // A given port has none.
  CHECK(env_from({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", "1234"}, {"MASTER_PORT", "4000"}})
            .master_port_alternates.empty());
  // No source: a world of one keeps 29500 whatever the ids.
  CHECK(env_from({{"DDP_JOB_ID", "x"}}).master_port == 29500);
  CHECK(env_from({{"DDP_JOB_ID", "x"}}).job_id == "x");
}

TEST_CASE("launch_environment reports every bad value as one line naming the variable") {
  struct bad_case {
    vars input;
    std::string message;  // must appear in the error's message
  };
  const std::vector<bad_case> table = {
      {{{"RANK", "0"}, {"WORLD_SIZE", "abc"}}, "WORLD_SIZE='abc' is not an integer (expected a positive integer, e.g. WORLD_SIZE=2)"},
      {{{"RANK", "2"}, {"WORLD_SIZE", "2"}}, "RANK=2 is out of range for WORLD_SIZE=2 (expected 0 <= RANK < WORLD_SIZE)"},
      {{{"MASTER_PORT", "70000"}}, "MASTER_PORT=70000 is out of range (expected 1-65535)"},
      {{{"MASTER_PORT", "0"}}, "MASTER_PORT=0 is out of range (expected 1-65535)"},
      {{{"MASTER_PORT", "http"}}, "MASTER_PORT='http' is not a port number"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE=0 is zero (expected a positive integer"},
      {{{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, "RANK=-1 is negative (expected a non-negative integer, e.g. RANK=0)"},
      {{{"RANK", "1.5"}, {"WORLD_SIZE", "2"}}, "RANK='1.5' is not an integer"},
      {{{"RANK", " 1"}, {"WORLD_SIZE", "2"}}, "RANK=' 1' is not an integer"},
      {{{"RANK", "99999999999999999999"}, {"WORLD_SIZE", "2"}}, "RANK='99999999999999999999' is not an integer"},
      {{{"RANK", "1"}}, "RANK is set but WORLD_SIZE is not"},
      {{{"WORLD_SIZE", "2"}}, "WORLD_SIZE is set but RANK is not"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
       "LOCAL_RANK=2 is out of range for LOCAL_WORLD_SIZE=2 (expected 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE)"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "3"}, {"GROUP_WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}},
       "LOCAL_WORLD_SIZE=3 x GROUP_WORLD_SIZE=2 != WORLD_SIZE=4"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "4"}}, "LOCAL_WORLD_SIZE=4 is larger than WORLD_SIZE=2"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}}, "but MASTER_ADDR is not set"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"GROUP_WORLD_SIZE", "2"}}, "but MASTER_ADDR is not set"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"GROUP_RANK", "1"}, {"GROUP_WORLD_SIZE", "1"}},
       "GROUP_RANK=1 is out of range for GROUP_WORLD_SIZE=1"},
      {{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "x"}}, "OMPI_COMM_WORLD_SIZE='x' is not an integer"},
      {{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
        {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
       "but MASTER_ADDR is not set"},
      {{{"PMI_RANK", "5"}, {"PMI_SIZE", "2"}}, "PMI_RANK=5 is out of range for PMI_SIZE=2"},
      {{{"SLURM_PROCID", "0"}}, "SLURM_PROCID is set but SLURM_NTASKS is not"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_TASKS_PER_NODE", "2(x)"}}, "SLURM_TASKS_PER_NODE='2(x)'"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "3"}, {"SLURM_TASKS_PER_NODE", "2(x2)"}, {"SLURM_NNODES", "2"},
        {"SLURM_JOB_NODELIST", "n[1-2]"}},
       "SLURM_TASKS_PER_NODE adds up to 4 tasks but SLURM_NTASKS=3"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_TASKS_PER_NODE", "1(x2)"}, {"SLURM_NNODES", "3"}},
       "SLURM_TASKS_PER_NODE='1(x2)' lists 2 nodes but SLURM_NNODES=3"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "node[1-"}}, "SLURM_JOB_NODELIST: node list 'node[1-'"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NODEID", "2"}, {"SLURM_TASKS_PER_NODE", "1(x2)"}},
       "SLURM_NODEID=2 is out of range"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "8"}, {"MASTER_ADDR", "job-master-0"}, {"PET_NPROC_PER_NODE", "4"}, {"PET_NNODES", "2"}},
       "PET_NPROC_PER_NODE=4 asks for that many processes per pod but LOCAL_RANK is not set (expected the pod to start "
       "torchrun or ddprun"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"PET_NPROC_PER_NODE", "many"}},
       "PET_NPROC_PER_NODE='many' is not a process count (expected a positive integer, auto, gpu, cpu or xpu"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"PET_NPROC_PER_NODE", "0"}}, "PET_NPROC_PER_NODE=0 is zero"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"PET_NNODES", "two"}},
       "PET_NNODES='two' is not a node count (expected a positive integer or an elastic range MIN:MAX"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"PET_NPROC_PER_NODE", "1"}, {"PET_NNODES", "2"}, {"MASTER_ADDR", "m"}},
       "PET_NPROC_PER_NODE=1 x PET_NNODES=2 != WORLD_SIZE=4"},
      {{{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"PET_NPROC_PER_NODE", "1"}, {"PET_NODE_RANK", "-1"}}, "PET_NODE_RANK=-1 is negative"},
      // RANK and WORLD_SIZE exported from mpirun's: its layout spans 2 nodes, so MASTER_ADDR is needed.
      {{{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "8"},
        {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}},
       "the job spans 2 nodes (WORLD_SIZE=8, OMPI_COMM_WORLD_LOCAL_SIZE=4) but MASTER_ADDR is not set"},
      {{{"FLUX_TASK_RANK", "0"}}, "FLUX_TASK_RANK is set but FLUX_JOB_SIZE is not"},
      {{{"FLUX_TASK_RANK", "0"}, {"FLUX_JOB_SIZE", "2"}, {"FLUX_JOB_NNODES", "x"}}, "FLUX_JOB_NNODES='x' is not an integer"},
      {{{"FLUX_TASK_RANK", "0"}, {"FLUX_JOB_SIZE", "3"}, {"FLUX_TASK_LOCAL_ID", "3"}, {"FLUX_JOB_NNODES", "2"}},
       "FLUX_TASK_LOCAL_ID=3 is out of range for FLUX_JOB_SIZE=3"},
      {{{"PALS_RANKID", "0"}}, "PALS_RANKID is set but PMI_SIZE is not"},
      {{{"PALS_RANKID", "4"}, {"PMI_RANK", "4"}, {"PMI_SIZE", "4"}}, "PALS_RANKID=4 is out of range for PMI_SIZE=4"},
      {{{"JSM_NAMESPACE_RANK", "0"}}, "JSM_NAMESPACE_RANK is set but JSM_NAMESPACE_SIZE is not"},
      {{{"JSM_NAMESPACE_RANK", "0"}, {"JSM_NAMESPACE_SIZE", "4"}, {"JSM_NAMESPACE_LOCAL_SIZE", "2"}},
       "but MASTER_ADDR is not set"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"DDP_JOB_ID", "my job"}},
       "DDP_JOB_ID='my job' contains a space or control character (expected one word, e.g. DDP_JOB_ID=ddprun:1a2b3c)"},
      {{{"DDP_TIMEOUT", "abc"}}, "DDP_TIMEOUT='abc' is not a positive number of seconds"},
      {{{"DDP_TIMEOUT", "-5"}}, "DDP_TIMEOUT='-5'"},
  };
  for (const auto& c : table) {
    INFO("environment: " << describe(c.input));
    try {
      (void)env_from(c.input);
      FAIL_CHECK("no error; expected: " << c.message);
    } catch (const ddp::error& e) {
      CHECK(e.code() == ddp::errc::config);
      CHECK_THAT(e.message(), Catch::Contains(c.message));
      CHECK(std::string(e.what()).find('\n') == std::string::npos);
    }
  }
}

TEST_CASE("launch_environment reads DDP_TIMEOUT with its origin") {
  const auto env = env_from({{"DDP_TIMEOUT", "2.5"}});
  CHECK(env.timeout == std::chrono::milliseconds(2500));
  CHECK(env.origin.timeout == "DDP_TIMEOUT");
  CHECK(env_from({}).timeout == std::chrono::seconds(300));
  CHECK(env_from({}).origin.timeout == "default");
}

TEST_CASE("launch_environment::describe prints each value with its origin") {
  const auto env = env_from({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "4000"}});
  const std::string text = env.describe();
  INFO(text);
  CHECK_THAT(text, Catch::StartsWith("launch environment (source: torchrun)\n"));
  CHECK_THAT(text, Catch::Matches("(.|\n)*  rank +1 +<- RANK\n(.|\n)*"));
  CHECK_THAT(text, Catch::Matches("(.|\n)*  world_size +2 +<- WORLD_SIZE\n(.|\n)*"));
  CHECK_THAT(text, Catch::Matches("(.|\n)*  local_rank +1 +<- derived \\(RANK, single node\\)\n(.|\n)*"));
  CHECK_THAT(text, Catch::Matches("(.|\n)*  master_addr +127.0.0.1 +<- default\n(.|\n)*"));
  CHECK_THAT(text, Catch::Matches("(.|\n)*  master_port +4000 +<- MASTER_PORT\n(.|\n)*"));
  CHECK_THAT(text, Catch::Matches("(.|\n)*  timeout +300 s +<- default\n(.|\n)*"));
}

TEST_CASE("launch_environment::describe shows the launcher, why it was chosen, the job and provisional values") {
  {
    const auto env = env_from({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"}, {"SLURM_JOB_ID", "4242"},
                               {"SLURM_STEP_ID", "0"}, {"PMI_RANK", "1"}, {"PMI_SIZE", "2"}});
    const std::string text = env.describe();
    INFO(text);
    CHECK_THAT(text, Catch::StartsWith("launch environment (source: slurm)\n"));
    CHECK_THAT(text, Catch::Contains("  source            slurm                <- SLURM_PROCID (PMI_RANK, PMI_SIZE agree: slurm's own PMI)\n"));
    CHECK_THAT(text, Catch::Contains("  job               slurm:4242.0         <- SLURM_JOB_ID, SLURM_STEP_ID\n"));
    CHECK_THAT(text, Catch::Contains("  local_rank        1                    <- SLURM_LOCALID\n"));
    CHECK_THAT(text, Catch::Contains("  master_port       24242                <- derived (SLURM_JOB_ID, SLURM_STEP_ID)\n"));
    // 20000 + (4242 + k * 4099) % 12768 for k = 1..7, by hand.
    CHECK_THAT(text, Catch::Contains("  port_alternates   28341 32440 23771 27870 31969 23300 27399 <- derived (in turn, where master_port is held)\n"));
  }
  {
    const auto env = env_from({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "job-master-0"}, {"MASTER_PORT", "23456"}});
    const std::string text = env.describe();
    INFO(text);
    CHECK_THAT(text, Catch::Contains("  job               (none)               <- default\n"));
    CHECK_THAT(text, !Catch::Contains("port_alternates"));  // MASTER_PORT given: no alternates
    CHECK_THAT(text, Catch::Contains("  local_rank        0 (provisional)      <- derived at rendezvous (ranks sharing a host)\n"));
    CHECK_THAT(text, Catch::Contains("  local_world_size  1 (provisional)      <- derived at rendezvous (ranks sharing a host)\n"));
    CHECK_THAT(text, Catch::Contains("  node_rank         1 (provisional)      <- derived at rendezvous (ranks sharing a host)\n"));
    CHECK_THAT(text, Catch::Contains("  num_nodes         2 (provisional)      <- derived at rendezvous (ranks sharing a host)\n"));
    CHECK_THAT(text, Catch::Contains("  rank              1                    <- RANK\n"));
  }
  CHECK_THAT(env_from({}).describe(), Catch::Contains("  source            none                 <- no launcher variables (a world of one)\n"));
}

TEST_CASE("launch_source names") {
  CHECK(ddp::to_string(ddp::launch_source::none) == "none");
  CHECK(ddp::to_string(ddp::launch_source::torchrun) == "torchrun");
  CHECK(ddp::to_string(ddp::launch_source::openmpi) == "openmpi");
  CHECK(ddp::to_string(ddp::launch_source::pmi) == "pmi");
  CHECK(ddp::to_string(ddp::launch_source::slurm) == "slurm");
  CHECK(ddp::to_string(ddp::launch_source::flux) == "flux");
  CHECK(ddp::to_string(ddp::launch_source::pals) == "pals");
  CHECK(ddp::to_string(ddp::launch_source::lsf) == "lsf");
}

TEST_CASE("expand_nodelist expands Slurm host lists") {
  using list = std::vector<std::string>;
  const std::vector<std::pair<std::string, list>> table = {
      {"node[01-03,7],gpu5", {"node01", "node02", "node03", "node7", "gpu5"}},
      {"host", {"host"}},
      {"a,b", {"a", "b"}},
      {"n[8-10]", {"n8", "n9", "n10"}},
      {"n[08-10]", {"n08", "n09", "n10"}},
      {"n[007]", {"n007"}},
      {"a[1-2]-b[3,5]", {"a1-b3", "a1-b5", "a2-b3", "a2-b5"}},
      {"rack[1-2]n[01-02].ib,login", {"rack1n01.ib", "rack1n02.ib", "rack2n01.ib", "rack2n02.ib", "login"}},
      {"[1-3]", {"1", "2", "3"}},
      {"x[0]y", {"x0y"}},
  };
  for (const auto& [text, want] : table) {
    INFO("node list: " << text);
    CHECK(ddp::expand_nodelist(text) == want);
  }
}

TEST_CASE("expand_nodelist rejects malformed lists with a clear error") {
  const std::vector<std::pair<std::string, std::string>> table = {
      {"node[01-03", "has a '[' without ']'"},
      {"node01]", "has a ']' without '['"},
      {"a[[1]]", "has nested brackets"},
      {"a[]", "has an empty range '[]'"},
      {"a[3-1]", "has a range that runs backwards '3-1'"},
      {"a[x-2]", "has a bad range 'x-2'"},
      {"a[1-]", "has a bad range '1-'"},
      {"a[1,,2]", "has a bad range ''"},
      {"a,,b", "has an empty host name"},
      {"a,", "has an empty host name"},
      {"", "is empty"},
      {"n[0-99999999]", "names too many hosts"},
  };
  for (const auto& [text, why] : table) {
    INFO("node list: " << text);
    try {
      (void)ddp::expand_nodelist(text);
      FAIL_CHECK("no error; expected: " << why);
    } catch (const ddp::error& e) {
      CHECK(e.code() == ddp::errc::config);
      CHECK_THAT(e.message(), Catch::Contains("node list '" + text + "' " + why));
    }
  }
}

TEST_CASE("from_environment with the real environment reads ::getenv") {
  // Whatever ctest's environment holds, it must parse or name the variable that is wrong.
  try {
    const auto env = ddp::launch_environment::from_environment();
    CHECK(env.rank < env.world_size);
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::config);
  }
}

}  // namespace ddp_test_env

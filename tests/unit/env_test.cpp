// launch_environment: every source, the precedence between them, Slurm node lists, and each bad
// value. The environment is a table handed to from_environment(); the real one is not touched.
#include <ddp/core/env.hpp>

#include <catch2/catch.hpp>

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
      // srun --mpi=pmi2: PMI before Slurm.
      {{{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}},
       {launch_source::pmi, 1, 2, 0, 2, 0, 1, "127.0.0.1", 29500, "PMI_RANK", "PMI_SIZE", "default"}},
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

TEST_CASE("launch_source names") {
  CHECK(ddp::to_string(ddp::launch_source::none) == "none");
  CHECK(ddp::to_string(ddp::launch_source::torchrun) == "torchrun");
  CHECK(ddp::to_string(ddp::launch_source::openmpi) == "openmpi");
  CHECK(ddp::to_string(ddp::launch_source::pmi) == "pmi");
  CHECK(ddp::to_string(ddp::launch_source::slurm) == "slurm");
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

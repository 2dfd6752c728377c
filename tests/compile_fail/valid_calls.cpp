// The control case: calls that must compile (without it, a harness that failed every
// compilation would pass every test of this folder).
// expect: compiles
#include <array>
#include <ddp/group.hpp>
#include <span>
#include <vector>

#include "minimal_backend.hpp"

template <class G>
void calls(G& g) {
  std::vector<float> v(4);
  std::array<double, 4> a{};
  std::int64_t c_array[4] = {};
  std::vector<ddp::bfloat16> h(4);
  float loss = 1.0f;
  std::uint8_t flag = 1;
  const float sent = 2.0f;
  g.all_reduce(v);
  g.all_reduce(a, ddp::max{});
  g.all_reduce(c_array, ddp::prod{});
  g.all_reduce(h, ddp::avg{});
  g.all_reduce(std::span<float>(v), ddp::min{});
  g.all_reduce(loss, ddp::avg{});
  g.all_reduce_async(loss).wait();
  g.broadcast(flag, 0);
  g.reduce(loss, 0, ddp::sum{});
  std::vector<float> all(4 * static_cast<std::size_t>(g.size()));
  g.all_gather(v, all);
  g.all_gather(std::span<const float>(v), std::span<float>(all));
  g.reduce_scatter(all, v, ddp::sum{});
  g.all_reduce(std::span<const float>(v), std::span<float>(all.data(), 4));
  g.all_reduce(v, all, ddp::max{});
  g.send(sent, 1);
  g.recv(loss, 1);
  g.barrier();
}

template void calls(ddp::group&);
template void calls(ddp::process_group<minimal_backend>&);

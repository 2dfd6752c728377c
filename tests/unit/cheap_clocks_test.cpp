// The cheap clocks of process_group's bookkeeping against steady_clock: tick_clock intervals
// converted to time agree with steady_clock over the same interval, and coarse_now() is never
// ahead of steady_clock and never behind it by more than coarse_resolution().
#include <ddp/process_group/cheap_clocks.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>

namespace ddp_test_cheap_clocks {

using namespace std::chrono_literals;
using steady = std::chrono::steady_clock;

// Busy for about `span` of steady_clock time; returns the exact steady_clock interval and the
// tick_clock interval read around the same points.
std::pair<std::chrono::nanoseconds, ddp::detail::tick_clock::ticks> busy_interval(std::chrono::nanoseconds span) {
  const auto t0 = ddp::detail::tick_clock::now();
  const auto s0 = steady::now();
  while (steady::now() - s0 < span) {
  }
  const auto s1 = steady::now();
  const auto t1 = ddp::detail::tick_clock::now();
  return {std::chrono::duration_cast<std::chrono::nanoseconds>(s1 - s0), t1 - t0};
}

TEST_CASE("tick_clock: an interval in ticks converts to the steady_clock time it took") {
  for (const auto span : {1ms, 20ms}) {
    const auto [reference, ticks] = busy_interval(span);
    const auto converted = ddp::detail::tick_clock::to_duration(ticks);
    // The ticks were read just outside the steady_clock reads: longer by at most a few reads,
    // or by a preemption between them, which the 2 % + 20 us margin covers.
    INFO("reference " << reference.count() << " ns, converted " << converted.count() << " ns");
    CHECK(converted >= reference - std::chrono::nanoseconds(reference.count() / 50));
    CHECK(converted <= reference + std::chrono::nanoseconds(reference.count() / 50) + 20us);
  }
}

TEST_CASE("tick_clock: totals of many short intervals add up to their steady_clock total") {
  // What process_group's statistics do: sum ticks of many calls, convert once when read.
  ddp::detail::tick_clock::ticks total = 0;
  std::chrono::nanoseconds reference{0};
  for (int i = 0; i < 200; ++i) {
    const auto [r, t] = busy_interval(50us);
    reference += r;
    total += t;
  }
  const auto converted = ddp::detail::tick_clock::to_duration(total);
  INFO("reference " << reference.count() << " ns, converted " << converted.count() << " ns");
  CHECK(std::abs(static_cast<double>(converted.count() - reference.count())) <= 0.02 * static_cast<double>(reference.count()) + 200e3);
}

TEST_CASE("coarse_now: not ahead of steady_clock, behind it by at most coarse_resolution()") {
  const auto resolution = ddp::detail::coarse_resolution();
  CHECK(resolution >= 0ns);
  CHECK(resolution <= 100ms);
  for (int i = 0; i < 1000; ++i) {
    const auto before = steady::now();
    const auto coarse = ddp::detail::coarse_now();
    const auto after = steady::now();
    REQUIRE(coarse <= after);
    // A timer tick can be late while the VM's CPU is descheduled: 20 ms of margin for that.
    REQUIRE(coarse >= before - resolution - 20ms);
  }
}

}  // namespace ddp_test_cheap_clocks

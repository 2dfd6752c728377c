// detail::staging_copy_choice: the schedule of its trials (which calls try which way and are
// timed) and its decision, fed known timings instead of the clock's.
#include <ddp/backends/ring/staging_copy_choice.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <string>

namespace ddp_test_staging_copy_choice {

using choice = ddp::algo::detail::staging_copy_choice;

// Runs `calls` calls through c; a timed call records `streaming_ns` or `ordinary_ns` per byte
// for its way. Returns how many calls were timed.
int run(choice& c, int calls, double streaming_ns, double ordinary_ns, bool* last_way = nullptr) {
  int timed = 0;
  for (int i = 0; i < calls; ++i) {
    const auto call = c.begin();
    if (last_way) *last_way = call.streaming;
    if (!call.timed) continue;
    ++timed;
    c.record(call.streaming, call.streaming ? streaming_ns : ordinary_ns);
  }
  return timed;
}

TEST_CASE("staging_copy_choice: the first 2 x samples calls alternate the two ways and are timed") {
  choice c;
  CHECK(c.streaming());  // before any trial: streaming stores, as before the choice existed
  for (int i = 0; i < 2 * choice::samples; ++i) {
    const auto call = c.begin();
    CHECK(call.timed);
    CHECK(call.streaming == (i % 2 == 0));
  }
  const auto after = c.begin();
  CHECK_FALSE(after.timed);
}

TEST_CASE("staging_copy_choice: ordinary stores win where their median is lower, streaming where its is") {
  SECTION("ordinary faster") {
    choice c;
    CHECK(run(c, 2 * choice::samples, 0.30, 0.10) == 2 * choice::samples);
    CHECK_FALSE(c.streaming());
    bool way = true;
    run(c, 100, 0.30, 0.10, &way);
    CHECK_FALSE(way);  // untimed calls use the choice
  }
  SECTION("streaming faster") {
    choice c;
    run(c, 2 * choice::samples, 0.10, 0.30);
    CHECK(c.streaming());
  }
}

TEST_CASE("staging_copy_choice: one slow call (a preemption) does not decide a trial") {
  choice c;
  for (int i = 0; i < 2 * choice::samples; ++i) {
    const auto call = c.begin();
    // Streaming is faster in every call but one, which took 1000x as long.
    c.record(call.streaming, call.streaming ? (i == 0 ? 100.0 : 0.1) : 0.2);
  }
  CHECK(c.streaming());
}

TEST_CASE("staging_copy_choice: every period calls a new trial follows a change of the machine") {
  choice c;
  run(c, static_cast<int>(choice::period), 0.30, 0.10);
  CHECK_FALSE(c.streaming());
  // The next trial starts at call `period`; after it, streaming has become the faster way.
  CHECK(run(c, static_cast<int>(choice::period), 0.10, 0.30) == 2 * choice::samples);
  CHECK(c.streaming());
}

TEST_CASE("staging_copy_choice: calls that are not recorded leave the trial open until both ways have their samples") {
  choice c;
  // A trial whose ordinary-store calls all failed (end() is not called for a failed call).
  for (int i = 0; i < 2 * choice::samples; ++i) {
    const auto call = c.begin();
    if (call.streaming) c.record(true, 0.5);
  }
  CHECK(c.streaming());
  // The next trial brings the ordinary samples; streaming's are already complete.
  run(c, static_cast<int>(choice::period), 0.5, 0.1);
  CHECK_FALSE(c.streaming());
}

}  // namespace ddp_test_staging_copy_choice

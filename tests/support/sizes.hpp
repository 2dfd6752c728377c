#pragma once
// The "large" message of the collective tests: 2^20 + 3 elements in a plain build (several
// pipelined chunks per block, a count no group size divides), 2^16 + 3 under a sanitizer. The
// smaller count still takes the same paths (chunked, pipelined, more than the small-message
// limit) at a sixteenth of the work: ThreadSanitizer runs these tests 10-50x slower, and the
// full size adds no code path, only time. The Release suite checks the full size.
#include <cstddef>

namespace ddp::test {

#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
inline constexpr bool sanitized_build = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
inline constexpr bool sanitized_build = true;
#else
inline constexpr bool sanitized_build = false;
#endif
#else
inline constexpr bool sanitized_build = false;
#endif

inline constexpr std::size_t large_count = sanitized_build ? (std::size_t{1} << 16) + 3 : (std::size_t{1} << 20) + 3;

}  // namespace ddp::test

#pragma once
// Shared by the all-reduce benchmarks: the nccl-tests table (size, count, type, time,
// algbw, busbw), CSV output, size sweeps and robust timing (median of repetitions).
//
// busbw = algbw * 2(p-1)/p for all-reduce: the per-rank traffic of an optimal algorithm,
// comparable across process counts and with the hardware's bandwidth.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace ddp::bench {

struct sweep_options {
  std::size_t min_bytes = 4;
  std::size_t max_bytes = std::size_t{64} << 20;
  int iters = 20;
  int warmup = 5;
  bool csv = false;
  std::string system = "ddp";  // the name in the CSV's first column
};

/// The sweep's first size: min_bytes, at least one float.
inline std::size_t first_size(const sweep_options& o) { return std::max<std::size_t>(o.min_bytes, 4); }

/// 4 B, 8 B, ... doubling up to max_bytes (inclusive), at least one float.
inline std::vector<std::size_t> sizes(const sweep_options& o) {
  std::vector<std::size_t> out;
  for (std::size_t b = first_size(o); b <= o.max_bytes; b *= 2) out.push_back(b);
  return out;
}

/// A whole decimal integer in [lo, hi], or nothing ("12x", "", out of range): for flag values.
inline std::optional<int> parse_int(const std::string& text, long lo, long hi) {
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0' || value < lo || value > hi) return std::nullopt;
  return static_cast<int>(value);
}

/// "a,b,,c" -> {"a", "b", "c"}: a comma-separated flag value, empty items dropped.
inline std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> out;
  for (std::size_t start = 0; start <= text.size();) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    if (comma > start) out.push_back(text.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

/// Iterations for a size: fewer for big messages so a sweep stays bounded, many for small ones:
/// a timed block of 200 calls of 0.2 us lasted 50 us, and one preemption of the VM's vCPU or one
/// timer interrupt in it moved the median of a 5-repetition run by 1.5-3x (64 B: 0.24 or 1.0 us
/// in back-to-back runs); 2000 calls make the block last long enough to average such events out.
inline int iterations_for(std::size_t bytes, int iters) {
  if (bytes >= (std::size_t{16} << 20)) return std::max(3, iters / 4);
  if (bytes >= (std::size_t{1} << 20)) return std::max(5, iters / 2);
  if (bytes >= (std::size_t{64} << 10)) return iters * 10;
  return iters * 100;
}

/// Untimed calls before a size's timed block: --warmup, and before the sweep's first size a
/// timed block's worth more, so that the start of a run (processes just forked, caches cold, a
/// vCPU just woken) lands in no measurement: a sweep's first size read 5 us against 0.8 in the
/// next run. The same count on every rank (the calls are collective).
inline int warmup_for(std::size_t bytes, const sweep_options& o) {
  return bytes == first_size(o) ? o.warmup + iterations_for(bytes, o.iters) : o.warmup;
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

inline void print_header(const sweep_options& o, int ranks, const char* what) {
  if (o.csv) {
    std::printf("system,ranks,bytes,count,type,time_us,algbw_gbs,busbw_gbs\n");
  } else {
    std::printf("# %s, %d ranks\n", what, ranks);
    std::printf("%12s %12s %8s %12s %10s %10s\n", "size(B)", "count", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)");
  }
  std::fflush(stdout);
}

inline void print_row(const sweep_options& o, int ranks, std::size_t bytes, double seconds) {
  const double algbw = static_cast<double>(bytes) / seconds / 1e9;
  const double busbw = algbw * 2.0 * (ranks - 1) / ranks;
  if (o.csv) {
    std::printf("%s,%d,%zu,%zu,float,%.3f,%.4f,%.4f\n", o.system.c_str(), ranks, bytes, bytes / 4, seconds * 1e6, algbw, busbw);
  } else {
    std::printf("%12zu %12zu %8s %12.2f %10.3f %10.3f\n", bytes, bytes / 4, "float", seconds * 1e6, algbw, busbw);
  }
  std::fflush(stdout);
}

/// Parses the flags the sweeps share; returns false (after printing why) on a bad one.
/// Unknown flags are left for the caller (returned in `rest`).
inline bool parse_common(int argc, char** argv, sweep_options& o, std::vector<std::string>& rest) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* name) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", name);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--min-bytes") o.min_bytes = std::strtoull(value("--min-bytes"), nullptr, 10);
    else if (a == "--max-bytes") o.max_bytes = std::strtoull(value("--max-bytes"), nullptr, 10);
    else if (a == "--iters") o.iters = std::atoi(value("--iters"));
    else if (a == "--warmup") o.warmup = std::atoi(value("--warmup"));
    else if (a == "--csv") o.csv = true;
    else if (a == "--system") o.system = value("--system");
    else rest.push_back(a);
  }
  if (o.iters < 1 || o.min_bytes > o.max_bytes) {
    std::fprintf(stderr, "bad sweep options: --iters >= 1 and --min-bytes <= --max-bytes\n");
    return false;
  }
  return true;
}

}  // namespace ddp::bench

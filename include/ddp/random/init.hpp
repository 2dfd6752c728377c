#pragma once
// torch.nn.Linear's default initialization, reproduced bit for bit on a torch_generator.
//
// nn.Linear(in, out).reset_parameters() (torch 2.15):
//   kaiming_uniform_(weight, a=sqrt(5)): bound = sqrt(3) * sqrt(2 / (1 + a^2)) / sqrt(fan_in), in double
//   (close to, but not exactly, 1/sqrt(fan_in)); weight.uniform_(-bound, bound), row-major [out][in]
//   bias.uniform_(-1/sqrt(fan_in), 1/sqrt(fan_in))
// one generator word per value, weight first. `torch.manual_seed(S); nn.Linear(a, b); nn.Linear(b, c)`
// is torch_generator g{S}; torch_linear_init(b, a, g); torch_linear_init(c, b, g).

#include <cstdint>
#include <string>
#include <vector>

#include "ddp/core/compiled.hpp"
#include "ddp/core/error.hpp"
#include "ddp/random/distributions.hpp"
#include "ddp/random/generator.hpp"
#if !DDP_DECLARATIONS_ONLY
#include <cmath>
#endif

namespace ddp {

struct linear_init {
  std::int64_t out_features = 0;
  std::int64_t in_features = 0;
  std::vector<float> weight;  // [out_features * in_features], row-major like torch's weight
  std::vector<float> bias;    // [out_features]
};

/// kaiming_uniform_'s bound for nn.Linear (a = sqrt(5), leaky_relu gain), computed as torch does.
double torch_linear_weight_bound(std::int64_t fan_in);

/// The weight and bias of torch.nn.Linear(in_features, out_features) drawn from `gen`.
linear_init torch_linear_init(std::int64_t out_features, std::int64_t in_features, torch_generator& gen,
                              torch_cpu_kernel kernel = torch_cpu_kernel::avx2);

// Compiled once with the compiled library (ddp/core/compiled.hpp).
#if !DDP_DECLARATIONS_ONLY
DDP_COMPILED_INLINE double torch_linear_weight_bound(std::int64_t fan_in) {
  const double a = std::sqrt(5.0);
  const double gain = std::sqrt(2.0 / (1.0 + a * a));  // Python's a**2 is the correctly rounded a*a
  const double std_dev = gain / std::sqrt(static_cast<double>(fan_in));
  return std::sqrt(3.0) * std_dev;
}

DDP_COMPILED_INLINE linear_init torch_linear_init(std::int64_t out_features, std::int64_t in_features, torch_generator& gen,
                                                  torch_cpu_kernel kernel) {
  if (out_features < 0 || in_features < 0)
    throw error(errc::invalid_argument,
                "torch_linear_init: out_features and in_features must be >= 0, got out_features=" +
                    std::to_string(out_features) + ", in_features=" + std::to_string(in_features),
                {.op = "torch_linear_init"});
  linear_init p{out_features, in_features,
                std::vector<float>(static_cast<std::size_t>(out_features) * static_cast<std::size_t>(in_features)),
                std::vector<float>(static_cast<std::size_t>(out_features))};
  // torch skips initializing a zero-element weight (no draws); a zero fan_in gives a zero bias bound.
  if (!p.weight.empty()) {
    const double bound = torch_linear_weight_bound(in_features);
    fill_uniform(p.weight, -bound, bound, gen, kernel);
  }
  if (in_features > 0) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
    fill_uniform(p.bias, -bound, bound, gen, kernel);
  } else {
    fill_uniform(p.bias, 0.0, 0.0, gen, kernel);
  }
  return p;
}
#endif  // !DDP_DECLARATIONS_ONLY

}  // namespace ddp

#pragma once
// The model's flat parameter buffers as a ddp parameter container: one parameter per tensor slot.

#include <span>
#include <vector>

#include "ddp/parameters.hpp"
#include "mlp.hpp"

namespace train {

/// The parameters DDP synchronizes: spans over the model's flat buffers, reduced in place (CPU
/// build; CUDA build with a device-memory backend such as nccl), over host mirrors of the device
/// buffers (CUDA build with a host-memory backend such as ring), or over the bfloat16 / float16
/// copies of --precision (precision.hpp).
template <class T>
struct flat_params {
  std::span<T> values, grads;
  const std::vector<tensor_slot>* slots = nullptr;
  ddp::memory_space memory = ddp::memory_space::host;
};

template <class T>
std::vector<ddp::parameter_ref> parameters(flat_params<T>& p) {
  std::vector<ddp::parameter_ref> out;
  for (const auto& s : *p.slots)
    out.push_back(ddp::make_parameter(p.values.subspan(s.offset, s.numel), p.grads.subspan(s.offset, s.numel), s.shape,
                                      s.name, p.memory));
  return out;
}

}  // namespace train

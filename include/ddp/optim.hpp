#pragma once
// ddp::optim: the shipped optimizers, torch's loss scaler and gradient clipping, each over
// contiguous spans so that the same code steps a whole model or one rank's flat shard, and each
// numerically matching its torch counterpart (each header states what is bit for bit):
//   sgd.hpp          torch.optim.SGD (foreach=False)
//   adamw.hpp        torch.optim.AdamW (foreach=False, fused=False)
//   grad_scaler.hpp  torch.amp.GradScaler (the caller agrees found_inf across ranks)
//   clip.hpp         torch.nn.utils.clip_grad_norm_, and its distributed form
//   distributed.hpp  the collectives: found_inf agreed across ranks, the sharded global norm
//   master_weights.hpp  an fp32 master copy of bf16 / fp16 parameters for distributed_data_parallel
//
// ddp/optim/cuda.hpp (CUDA builds, compiled by nvcc) has the same optimizers, unscale and clipping
// on spans of device memory, bit for bit with these host classes; it is not included here, so
// that host programs need no CUDA toolkit.

#include "ddp/optim/adamw.hpp"
#include "ddp/optim/clip.hpp"
#include "ddp/optim/distributed.hpp"
#include "ddp/optim/grad_scaler.hpp"
#include "ddp/optim/master_weights.hpp"
#include "ddp/optim/sgd.hpp"

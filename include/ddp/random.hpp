#pragma once
// PyTorch-identical random numbers: torch's CPU generator and the distributions built on it
// (randperm, randint, rand, uniform_, randn) plus nn.Linear's initialization, bit for bit with
// torch 2.15.0's AVX2/AVX512 CPU kernels (or its scalar DEFAULT kernel on request).

#include "ddp/random/distributions.hpp"
#include "ddp/random/generator.hpp"
#include "ddp/random/init.hpp"

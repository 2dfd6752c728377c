// The CUDA build of train_ddp: the same source, compiled by nvcc (Thrust on CUDA, cuBLAS).
#include "train_ddp.cpp"

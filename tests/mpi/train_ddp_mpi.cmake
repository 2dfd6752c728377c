# train_ddp --backend BACKEND (default mpi) under mpirun -n 2 prints the lines PyTorch printed for
# the same job (tests/data/training.json, W2_real_torchrun_gloo), and exits 0. With the ring
# backend the ranks read Open MPI's variables and rendezvous through ddp's own store. ARGS adds
# train_ddp options and LINES names the golden lines (default: W2_real_torchrun_gloo;stdout_loss_lines).
#   cmake -DMPIEXEC=... -DMPIEXEC_FLAGS="a;b" -DTRAIN_DDP=... -DGOLDEN=... [-DBACKEND=ring] [-DARGS="a;b" -DLINES="k;k"]
#         -P train_ddp_mpi.cmake
file(READ ${GOLDEN} golden)
if(NOT LINES)
  set(LINES W2_real_torchrun_gloo stdout_loss_lines)
endif()
string(JSON n LENGTH "${golden}" ${LINES})
set(expected "")
math(EXPR last "${n} - 1")
foreach(i RANGE ${last})
  string(JSON line GET "${golden}" ${LINES} ${i})
  string(APPEND expected "${line}\n")
endforeach()

if(NOT BACKEND)
  set(BACKEND mpi)
endif()
execute_process(COMMAND ${MPIEXEC} ${MPIEXEC_FLAGS} -n 2 ${TRAIN_DDP} --backend ${BACKEND} --init-seed 0 ${ARGS}
                RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
if(NOT code EQUAL 0)
  message(FATAL_ERROR "mpirun -n 2 train_ddp --backend ${BACKEND} ${ARGS} exited with '${code}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
if(NOT out STREQUAL expected)
  message(FATAL_ERROR "train_ddp under mpirun printed\n${out}\nPyTorch printed\n${expected}\nstderr:\n${err}")
endif()
message(STATUS "train_ddp --backend ${BACKEND} ${ARGS} under mpirun -n 2 printed PyTorch's ${n} lines")

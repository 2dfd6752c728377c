# train_ddp --backend mpi under mpirun -n 2 prints the lines PyTorch printed for the same job
# (tests/data/training.json, W2_real_torchrun_gloo), and exits 0.
#   cmake -DMPIEXEC=... -DMPIEXEC_FLAGS="a;b" -DTRAIN_DDP=... -DGOLDEN=... -P train_ddp_mpi.cmake
file(READ ${GOLDEN} golden)
string(JSON n LENGTH "${golden}" W2_real_torchrun_gloo stdout_loss_lines)
set(expected "")
math(EXPR last "${n} - 1")
foreach(i RANGE ${last})
  string(JSON line GET "${golden}" W2_real_torchrun_gloo stdout_loss_lines ${i})
  string(APPEND expected "${line}\n")
endforeach()

execute_process(COMMAND ${MPIEXEC} ${MPIEXEC_FLAGS} -n 2 ${TRAIN_DDP} --backend mpi --init-seed 0
                RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
if(NOT code EQUAL 0)
  message(FATAL_ERROR "mpirun -n 2 train_ddp --backend mpi exited with '${code}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
if(NOT out STREQUAL expected)
  message(FATAL_ERROR "train_ddp under mpirun printed\n${out}\nPyTorch printed\n${expected}\nstderr:\n${err}")
endif()
message(STATUS "train_ddp --backend mpi under mpirun -n 2 printed PyTorch's ${n} lines")

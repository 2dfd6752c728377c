# Compiles one source of this folder to an object at -O2 and checks, with nm, whether it holds the
# ring backend's code, as the source's comment asks:
#   // expect: no ring backend    no symbol of ddp::ring_backend, ddp::algo:: or the transports
#   // expect: ring backend       some (the control: the check can see them)
# Header-only, every file that instantiates the ring backend compiles all of it (most of what
# <ddp/ddp.hpp> costs); only the file that calls init_process_group should.
#
# cmake -DCOMPILER=<c++> -DNM=<nm> -DSOURCE=<file.cpp> -DINCLUDE_DIR=<dir> -DOBJECT=<out.o> -P check.cmake
cmake_minimum_required(VERSION 3.20)
foreach(var COMPILER NM SOURCE INCLUDE_DIR OBJECT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check.cmake: -D${var}=... is required")
  endif()
endforeach()

file(STRINGS ${SOURCE} expect REGEX "^// expect: ")
if(expect STREQUAL "// expect: no ring backend")
  set(want_backend OFF)
elseif(expect STREQUAL "// expect: ring backend")
  set(want_backend ON)
else()
  message(FATAL_ERROR "${SOURCE}: one '// expect: no ring backend' or '// expect: ring backend' line is required")
endif()

execute_process(COMMAND ${COMPILER} -std=c++20 -O2 -I${INCLUDE_DIR} -c ${SOURCE} -o ${OBJECT}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${SOURCE} does not compile:\n${out}")
endif()
execute_process(COMMAND ${NM} -C --defined-only ${OBJECT} RESULT_VARIABLE rc OUTPUT_VARIABLE symbols ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${NM} ${OBJECT}: ${err}")
endif()
string(REGEX MATCHALL "[^\n]*(ddp::ring_backend|ddp::algo::|ddp::tcp_transport|ddp::shm_transport)[^\n]*" backend "${symbols}")
list(LENGTH backend count)
file(SIZE ${OBJECT} bytes)
if(want_backend AND count EQUAL 0)
  message(FATAL_ERROR "${SOURCE}: expected the ring backend's symbols in the object (${bytes} bytes), found none")
elseif(NOT want_backend AND count GREATER 0)
  list(SUBLIST backend 0 5 first)
  string(REPLACE ";" "\n  " first "${first}")
  message(FATAL_ERROR "${SOURCE}: ${count} symbols of the ring backend in a file that never calls init_process_group "
                      "(${bytes} bytes of object), e.g.:\n  ${first}")
endif()
message(STATUS "${SOURCE}: ${count} ring backend symbols, ${bytes} bytes of object: as expected")

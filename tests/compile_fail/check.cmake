# Compiles one source of this folder with -fsyntax-only and checks the outcome its comments ask for:
#   // expect: compiles             the source must compile (the harness's control case);
#   // expect-error: <text>         compilation must fail, and the output must contain <text>
#                                   (several such lines: every text must appear).
# A failing compilation must also print at most MAX_LINES lines (the whole diagnostic: a wrong
# argument to a collective is one short error, not a list of every overload).
#
# cmake -DCOMPILER=<c++> -DSOURCE=<file.cpp> -DINCLUDE_DIR=<dir> [-DMAX_LINES=20] -P check.cmake
cmake_minimum_required(VERSION 3.20)
foreach(var COMPILER SOURCE INCLUDE_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check.cmake: -D${var}=... is required")
  endif()
endforeach()
if(NOT DEFINED MAX_LINES)
  set(MAX_LINES 20)
endif()

file(STRINGS ${SOURCE} expect_lines REGEX "^// expect(-error)?: ")
set(expect_compiles OFF)
set(expected_texts "")
foreach(line IN LISTS expect_lines)
  if(line MATCHES "^// expect: compiles")
    set(expect_compiles ON)
  elseif(line MATCHES "^// expect-error: (.+)$")
    list(APPEND expected_texts "${CMAKE_MATCH_1}")
  endif()
endforeach()
if(NOT expect_compiles AND NOT expected_texts)
  message(FATAL_ERROR "${SOURCE}: no '// expect: compiles' or '// expect-error: <text>' line")
endif()

set(ENV{LC_ALL} C)  # plain quotes in the compiler's messages
execute_process(COMMAND ${COMPILER} -std=c++20 -Wall -Wextra -Wpedantic -Werror -fsyntax-only -fdiagnostics-color=never
                        -I${INCLUDE_DIR} ${SOURCE}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
string(REGEX MATCHALL "\n" newlines "${out}")
list(LENGTH newlines lines)

if(expect_compiles)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${SOURCE} should compile, but the compiler said (${lines} lines):\n${out}")
  endif()
  message(STATUS "compiles, as expected")
  return()
endif()

if(rc EQUAL 0)
  message(FATAL_ERROR "${SOURCE} compiled, but it should fail with: ${expected_texts}")
endif()
foreach(text IN LISTS expected_texts)
  string(FIND "${out}" "${text}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${SOURCE}: the compiler's output lacks \"${text}\"; it said (${lines} lines):\n${out}")
  endif()
endforeach()
if(lines GREATER MAX_LINES)
  message(FATAL_ERROR "${SOURCE}: ${lines} lines of compiler output, more than ${MAX_LINES}:\n${out}")
endif()
message(STATUS "fails as expected, in ${lines} lines:\n${out}")

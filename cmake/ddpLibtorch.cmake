# ddp::libtorch: <ddp/adapters/libtorch.hpp> with PyTorch's C++ library (libtorch).
# Torch comes from find_package(Torch): CMAKE_PREFIX_PATH / Torch_DIR, or the PyTorch venv
# DDP_TORCH_VENV (its python says where torch's CMake files are). PyTorch's PyPI wheels are CUDA
# builds: their TorchConfig needs a CUDA toolkit, and its `torch` target links libtorch_cuda,
# which needs the NCCL of the nvidia-* wheels (the system's older libnccl leaves symbols
# undefined at link time). So for such a wheel the CPU libraries of the same install
# (libtorch_cpu, libc10) are imported directly, which is all CPU tensors need; DDP_LIBTORCH_CUDA=ON
# uses find_package(Torch) and its `torch` target instead (CUDA tensors; needs a toolkit and a
# linkable NCCL). A CPU build of libtorch (Torch_DIR / CMAKE_PREFIX_PATH, or a CPU wheel) always
# goes through find_package(Torch). The lookup runs in a function: TorchConfig sets CUDA flags and
# variables that must not leak into the rest of the build.
option(DDP_ENABLE_LIBTORCH "Build the libtorch adapter's example, tests and bench when Torch is found" ON)
option(DDP_LIBTORCH_CUDA "For a CUDA build of PyTorch: link its CUDA libraries too (find_package(Torch))" OFF)
set(DDP_TORCH_VENV ${PROJECT_SOURCE_DIR}/build/torch-venv CACHE PATH "PyTorch venv for the tests against real PyTorch")
set(DDP_HAVE_LIBTORCH OFF)

function(ddp_find_libtorch)
  set(prefix "")
  set(torch_cuda "")
  if(EXISTS ${DDP_TORCH_VENV}/bin/python)
    execute_process(
      COMMAND ${DDP_TORCH_VENV}/bin/python -c
              "import torch, torch.utils; print(torch.utils.cmake_prefix_path); print(torch.version.cuda or '')"
      OUTPUT_VARIABLE out RESULT_VARIABLE rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(rc EQUAL 0)
      string(REPLACE "\n" ";" out "${out}")
      list(GET out 0 prefix)
      list(LENGTH out n)
      if(n GREATER 1)
        list(GET out 1 torch_cuda)
      endif()
    endif()
  endif()
  if(NOT prefix AND NOT Torch_DIR AND NOT CMAKE_PREFIX_PATH)
    message(STATUS "ddp: libtorch not found (no PyTorch in DDP_TORCH_VENV=${DDP_TORCH_VENV}); ddp::libtorch skipped")
    return()
  endif()
  if(prefix)
    list(APPEND CMAKE_PREFIX_PATH ${prefix})
  endif()

  if(prefix AND torch_cuda AND NOT DDP_LIBTORCH_CUDA)
    get_filename_component(root ${prefix}/../.. ABSOLUTE)
    find_library(DDP_TORCH_LIB torch PATHS ${root}/lib NO_DEFAULT_PATH)
    find_library(DDP_TORCH_CPU_LIB torch_cpu PATHS ${root}/lib NO_DEFAULT_PATH)
    find_library(DDP_C10_LIB c10 PATHS ${root}/lib NO_DEFAULT_PATH)
    if(NOT DDP_TORCH_CPU_LIB OR NOT DDP_C10_LIB OR NOT EXISTS ${root}/include/torch/csrc/api/include)
      message(STATUS "ddp: libtorch's CPU libraries not found under ${root}; ddp::libtorch skipped")
      return()
    endif()
    add_library(ddp_torch_cpu INTERFACE IMPORTED GLOBAL)
    set_target_properties(ddp_torch_cpu PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${root}/include;${root}/include/torch/csrc/api/include"
      INTERFACE_LINK_LIBRARIES "${DDP_TORCH_CPU_LIB};${DDP_C10_LIB}"
      INTERFACE_LINK_OPTIONS "LINKER:-rpath,${root}/lib")
    set(torch_target ddp_torch_cpu)
    set(how "CPU libraries of ${root}")
  else()
    find_package(Torch QUIET)
    if(NOT Torch_FOUND)
      message(STATUS "ddp: find_package(Torch) failed; ddp::libtorch skipped")
      return()
    endif()
    set(torch_target torch)
    set(how "find_package(Torch) ${Torch_DIR}")
    # A wheel's libtorch_cuda finds its CUDA libraries through $ORIGIN rpaths, which the linker
    # does not follow: point it at the nvidia-* wheels, or it links the system's (older) NCCL.
    if(prefix)
      file(GLOB wheel_libs LIST_DIRECTORIES true ${prefix}/../../../nvidia/*/lib)
      foreach(dir IN LISTS wheel_libs)
        get_filename_component(dir ${dir} ABSOLUTE)
        target_link_options(torch INTERFACE "LINKER:-rpath-link,${dir}")
      endforeach()
    endif()
    if(TORCH_CXX_FLAGS)  # _GLIBCXX_USE_CXX11_ABI must match the library's
      separate_arguments(flags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
      set_property(TARGET torch APPEND PROPERTY INTERFACE_COMPILE_OPTIONS ${flags})
    endif()
  endif()

  add_library(ddp_libtorch INTERFACE)
  add_library(ddp::libtorch ALIAS ddp_libtorch)
  target_link_libraries(ddp_libtorch INTERFACE ddp ${torch_target})
  target_compile_definitions(ddp_libtorch INTERFACE DDP_HAS_LIBTORCH=1)
  # PyTorch's wheels have used the new std::string ABI since 2.7; an older libtorch says otherwise
  # in TORCH_CXX_FLAGS (above), and the CPU import asks torch itself.
  if(torch_target STREQUAL ddp_torch_cpu)
    execute_process(COMMAND ${DDP_TORCH_VENV}/bin/python -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
                    OUTPUT_VARIABLE abi OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(abi MATCHES "^[01]$")
      target_compile_definitions(ddp_libtorch INTERFACE _GLIBCXX_USE_CXX11_ABI=${abi})
    endif()
  endif()
  set(DDP_HAVE_LIBTORCH ON PARENT_SCOPE)
  # The libtorch programs link the compiled library where it is built (as an application does,
  # CMakeLists.txt), unless libtorch uses the old std::string ABI, which the library was not built with.
  get_target_property(torch_options ${torch_target} INTERFACE_COMPILE_OPTIONS)
  get_target_property(torch_definitions ddp_libtorch INTERFACE_COMPILE_DEFINITIONS)
  if("${torch_options};${torch_definitions}" MATCHES "_GLIBCXX_USE_CXX11_ABI=0")
    set(DDP_LIBTORCH_APPLICATION_LIBRARY ddp::ddp PARENT_SCOPE)
  else()
    set(DDP_LIBTORCH_APPLICATION_LIBRARY ${DDP_APPLICATION_LIBRARY} PARENT_SCOPE)
  endif()
  message(STATUS "ddp: libtorch found (${how})")
endfunction()

if(DDP_ENABLE_LIBTORCH)
  ddp_find_libtorch()
endif()

# Finds NCCL in the CUDA toolkit or a system install; defines NCCL::NCCL.
find_package(CUDAToolkit QUIET)
find_path(NCCL_INCLUDE_DIR nccl.h
  HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_INCLUDE_DIRS}
  PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR  # the wheel ships only libnccl.so.2; NCCL_ROOT first
  HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_DIR}
  PATH_SUFFIXES lib lib64)
if(NCCL_INCLUDE_DIR AND EXISTS ${NCCL_INCLUDE_DIR}/nccl.h)
  file(STRINGS ${NCCL_INCLUDE_DIR}/nccl.h _nccl_major REGEX "^#define NCCL_MAJOR")
  file(STRINGS ${NCCL_INCLUDE_DIR}/nccl.h _nccl_minor REGEX "^#define NCCL_MINOR")
  string(REGEX MATCH "[0-9]+" _nccl_major "${_nccl_major}")
  string(REGEX MATCH "[0-9]+" _nccl_minor "${_nccl_minor}")
  set(NCCL_VERSION "${_nccl_major}.${_nccl_minor}")
endif()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR VERSION_VAR NCCL_VERSION)
if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL UNKNOWN IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES
    IMPORTED_LOCATION ${NCCL_LIBRARY}
    INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR})
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)

# Generates fakecuda's driver symbol tables (stubs, cuGetProcAddress rows, export list) from the toolkit's
# cuda.h/cudaTypedefs.h and implemented.txt; include() it from fakecuda/driver/CMakeLists.txt.
#
# Needs CUDA_DRIVER_INCLUDE_DIR and the targets cuda_headers, vgpu_warnings (cmake/VgpuDeps.cmake,
# cmake/VgpuWarnings.cmake). Sets, as INTERNAL cache entries so that every directory (tests/unit too) sees them:
#   FAKECUDA_GENERATED_DIR           folder of the generated files (holds proc_table.inc)
#   FAKECUDA_GENERATED_SOURCES       unimplemented_stubs.cc, proc_table.cc: compile into libcuda.so.1 together
#                                    with proc_address.cc and the implemented symbols
#   FAKECUDA_GENERATED_INCLUDE_DIRS  what those sources include from: FAKECUDA_GENERATED_DIR and this folder
#                                    (proc_address.h)
#   FAKECUDA_LIBCUDA_MAP             libcuda.map, the version script exporting exactly the driver symbols
#   FAKECUDA_EXPORTED_SYMBOLS_FILE   the same names, one a line
#   FAKECUDA_TEST_STAND_INS_SOURCE   stand-ins for the implemented symbols, for unit tests only
#   FAKECUDA_LINK_OPTIONS            -Wl,-Bsymbolic-functions, for libcuda.so.1: the table's addresses must be
#                                    fakecuda's own functions even when a preloaded library (the vgpu shim)
#                                    exports the same names, as the real driver's are; without it cuGetProcAddress
#                                    hands the shim its own hooks back as "the driver's" functions
# and the targets
#   fakecuda_generated_symbols       runs the generator
#   fakecuda_symbol_tables           OBJECT library: proc_address.cc + FAKECUDA_GENERATED_SOURCES, for libcuda.so.1
#                                    and for unit tests
#   fakecuda_test_stand_ins          OBJECT library: FAKECUDA_TEST_STAND_INS_SOURCE, for unit tests only

find_package(Python3 REQUIRED COMPONENTS Interpreter)

set(FAKECUDA_GENERATED_DIR ${CMAKE_CURRENT_BINARY_DIR}/generated CACHE INTERNAL "")
set(_fakecuda_generator ${CMAKE_CURRENT_LIST_DIR}/gen_symbols.py)
set(_fakecuda_implemented ${CMAKE_CURRENT_LIST_DIR}/implemented.txt)

set(_fakecuda_header_arguments
  --cuda-header ${CUDA_DRIVER_INCLUDE_DIR}/cuda.h
  --typedefs-header ${CUDA_DRIVER_INCLUDE_DIR}/cudaTypedefs.h)
set(_fakecuda_header_inputs ${CUDA_DRIVER_INCLUDE_DIR}/cuda.h ${CUDA_DRIVER_INCLUDE_DIR}/cudaTypedefs.h)
# The real driver also exports the profiler and the OpenGL, EGL and VDPAU interop entry points.
foreach(_fakecuda_api Profiler GL EGL VDPAU)
  set(_fakecuda_header ${CUDA_DRIVER_INCLUDE_DIR}/cuda${_fakecuda_api}.h)
  set(_fakecuda_typedefs ${CUDA_DRIVER_INCLUDE_DIR}/cuda${_fakecuda_api}Typedefs.h)
  if(EXISTS ${_fakecuda_header} AND EXISTS ${_fakecuda_typedefs})
    list(APPEND _fakecuda_header_arguments --interop-header ${_fakecuda_header} ${_fakecuda_typedefs})
    list(APPEND _fakecuda_header_inputs ${_fakecuda_header} ${_fakecuda_typedefs})
  else()
    message(WARNING "fakecuda: ${_fakecuda_header} or ${_fakecuda_typedefs} is missing, so libcuda.so.1 will "
                    "not export the cuda${_fakecuda_api}.h entry points that the real driver exports")
  endif()
endforeach()

set(FAKECUDA_LIBCUDA_MAP ${FAKECUDA_GENERATED_DIR}/libcuda.map CACHE INTERNAL "")
set(FAKECUDA_EXPORTED_SYMBOLS_FILE ${FAKECUDA_GENERATED_DIR}/exported_symbols.txt CACHE INTERNAL "")
set(FAKECUDA_TEST_STAND_INS_SOURCE ${FAKECUDA_GENERATED_DIR}/test_implemented_stand_ins.cc CACHE INTERNAL "")
set(FAKECUDA_GENERATED_SOURCES
  ${FAKECUDA_GENERATED_DIR}/unimplemented_stubs.cc
  ${FAKECUDA_GENERATED_DIR}/proc_table.cc
  CACHE INTERNAL "")
set(FAKECUDA_GENERATED_INCLUDE_DIRS ${FAKECUDA_GENERATED_DIR} ${CMAKE_CURRENT_LIST_DIR} CACHE INTERNAL "")
set(FAKECUDA_LINK_OPTIONS -Wl,-Bsymbolic-functions CACHE INTERNAL "")

add_custom_command(
  OUTPUT
    ${FAKECUDA_GENERATED_SOURCES}
    ${FAKECUDA_GENERATED_DIR}/proc_table.inc
    ${FAKECUDA_LIBCUDA_MAP}
    ${FAKECUDA_EXPORTED_SYMBOLS_FILE}
    ${FAKECUDA_TEST_STAND_INS_SOURCE}
  COMMAND ${Python3_EXECUTABLE} ${_fakecuda_generator}
    ${_fakecuda_header_arguments}
    --implemented ${_fakecuda_implemented}
    --output-dir ${FAKECUDA_GENERATED_DIR}
  DEPENDS ${_fakecuda_generator} ${_fakecuda_implemented} ${_fakecuda_header_inputs}
  COMMENT "Generating fakecuda driver symbol tables from cuda.h, cudaTypedefs.h and implemented.txt"
  VERBATIM)

# A target of its own, so that several targets (libcuda.so.1, unit tests) can wait for one generation run.
add_custom_target(fakecuda_generated_symbols
  DEPENDS ${FAKECUDA_GENERATED_SOURCES} ${FAKECUDA_LIBCUDA_MAP} ${FAKECUDA_TEST_STAND_INS_SOURCE})

add_library(fakecuda_symbol_tables OBJECT ${CMAKE_CURRENT_LIST_DIR}/proc_address.cc ${FAKECUDA_GENERATED_SOURCES})
add_dependencies(fakecuda_symbol_tables fakecuda_generated_symbols)
target_include_directories(fakecuda_symbol_tables PUBLIC ${FAKECUDA_GENERATED_INCLUDE_DIRS})
target_link_libraries(fakecuda_symbol_tables PUBLIC cuda_headers PRIVATE vgpu_warnings)
set_target_properties(fakecuda_symbol_tables PROPERTIES
  CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON POSITION_INDEPENDENT_CODE ON)

add_library(fakecuda_test_stand_ins OBJECT ${FAKECUDA_TEST_STAND_INS_SOURCE})
add_dependencies(fakecuda_test_stand_ins fakecuda_generated_symbols)
target_link_libraries(fakecuda_test_stand_ins PRIVATE vgpu_warnings)

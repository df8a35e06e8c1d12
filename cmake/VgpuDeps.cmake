# Third-party headers: CUDA driver API declarations from the CUDA toolkit,
# NVML declarations from the nvidia-nvml-dev wheel (pip), both header-only
# for us: we never link the real libraries.
find_package(Threads REQUIRED)
find_package(Python3 REQUIRED COMPONENTS Interpreter)

# pip wheels (nvidia-nvml-dev, nvidia-cuda-runtime) put headers under site-packages/nvidia/<flavour>/include.
set(_vgpu_wheel_include_dirs "")
execute_process(
  COMMAND ${Python3_EXECUTABLE} -c
    "import importlib.util,pathlib;s=importlib.util.find_spec('nvidia');print(';'.join(sorted({str(p.parent) for d in (s.submodule_search_locations if s else []) for p in pathlib.Path(d).glob('*/include/*.h')})))"
  OUTPUT_VARIABLE _vgpu_wheel_include_dirs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET TIMEOUT 60)

find_path(CUDA_DRIVER_INCLUDE_DIR cuda.h
  HINTS $ENV{CUDA_HOME}/include /usr/local/cuda/include /usr/include ${_vgpu_wheel_include_dirs}
  DOC "Folder holding the CUDA driver API headers cuda.h and cudaTypedefs.h (CUDA toolkit, or pip nvidia-cuda-runtime)")
if(NOT CUDA_DRIVER_INCLUDE_DIR)
  message(FATAL_ERROR "cuda.h not found: install the CUDA toolkit headers, pip install nvidia-cuda-runtime, or set CUDA_HOME")
endif()

find_path(NVML_INCLUDE_DIR nvml.h HINTS ${_vgpu_wheel_include_dirs} ${CUDA_DRIVER_INCLUDE_DIR}
  DOC "Folder holding nvml.h (pip install nvidia-nvml-dev)")
if(NOT NVML_INCLUDE_DIR)
  message(FATAL_ERROR "nvml.h not found: pip install nvidia-nvml-dev, or pass -DNVML_INCLUDE_DIR=")
endif()

add_library(cuda_headers INTERFACE)
target_include_directories(cuda_headers SYSTEM INTERFACE ${CUDA_DRIVER_INCLUDE_DIR})
add_library(nvml_headers INTERFACE)
target_include_directories(nvml_headers SYSTEM INTERFACE ${NVML_INCLUDE_DIR})

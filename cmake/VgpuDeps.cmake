# Third-party headers: CUDA driver API declarations from the CUDA toolkit,
# NVML declarations from the nvidia-nvml-dev wheel (pip), both header-only
# for us: we never link the real libraries.
find_package(Threads REQUIRED)
find_package(Python3 REQUIRED COMPONENTS Interpreter)

find_path(CUDA_DRIVER_INCLUDE_DIR cuda.h
  HINTS $ENV{CUDA_HOME}/include /usr/local/cuda/include /usr/include
  DOC "Folder holding the CUDA toolkit's cuda.h")
if(NOT CUDA_DRIVER_INCLUDE_DIR)
  message(FATAL_ERROR "cuda.h not found: install the CUDA toolkit headers or set CUDA_HOME")
endif()

if(NOT NVML_INCLUDE_DIR)
  find_package(Python3 COMPONENTS Interpreter)
  if(Python3_FOUND)
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -c
        "import importlib.util,pathlib;s=importlib.util.find_spec('nvidia');print(next((str(p.parent) for d in s.submodule_search_locations for p in pathlib.Path(d).glob('*/include/nvml.h')),''))"
      OUTPUT_VARIABLE _nvml_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
  find_path(NVML_INCLUDE_DIR nvml.h HINTS ${_nvml_dir} ${CUDA_DRIVER_INCLUDE_DIR}
    DOC "Folder holding nvml.h (pip install nvidia-nvml-dev)")
endif()
if(NOT NVML_INCLUDE_DIR)
  message(FATAL_ERROR "nvml.h not found: pip install nvidia-nvml-dev, or pass -DNVML_INCLUDE_DIR=")
endif()

add_library(cuda_headers INTERFACE)
target_include_directories(cuda_headers SYSTEM INTERFACE ${CUDA_DRIVER_INCLUDE_DIR})
add_library(nvml_headers INTERFACE)
target_include_directories(nvml_headers SYSTEM INTERFACE ${NVML_INCLUDE_DIR})

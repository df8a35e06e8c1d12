// What every runtime test program shares: a CUDA call that fails ends the program (exit 1) with one line naming the
// call, its line and the runtime's error name, so the Python side can say what broke.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(call)                                                                                       \
  do {                                                                                                    \
    const cudaError_t check_error_ = (call);                                                              \
    if (check_error_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorName(check_error_)); \
      std::exit(1);                                                                                       \
    }                                                                                                     \
  } while (0)

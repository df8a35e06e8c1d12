// driver_memory_probe: every way the driver grows a process's device memory without an allocation call (issue 19),
// each step followed by NVML's per-process figure for this process (the host's view) and cuMemGetInfo's free.
//
//   driver_memory_probe steps            # the sources, one JSON line per step (CUDA_MODULE_LOADING decides lazy/eager)
//   driver_memory_probe ipc-open HANDLE  # (child of `steps`) opens a parent's IPC handle, reports its own figure
//   driver_memory_probe pidns            # which pid NVML reports for this process (run it under unshare -pf)
//   driver_memory_probe limits-fill      # a 4 KiB stack and a 64 MiB printf FIFO, a kernel using 4 KiB of local
//                                        # memory, then 2 MiB allocations to OOM: what a capped program can use
//   driver_memory_probe alloc-loop N     # N x (cuMemAlloc 2 MiB, cuMemFree): ns per pair (the shim's price)
//   driver_memory_probe launch-loop N    # N launches of an empty kernel, a synchronize every 1000: ns per launch
//
// Output: lines "STEP {...}" with the step's name, NVML's figure for this process (MiB), the change since the last
// step, and cuMemGetInfo's free (MiB). Build: nvcc -O2 -arch=sm_90 -o driver_memory_probe driver_memory_probe.cu
//   -lcuda -lnvidia-ml
#include <cuda.h>
#include <cuda_runtime.h>
#include <nvml.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <chrono>

extern char** environ;

namespace {

constexpr double kMiB = 1048576.0;

// Module data: 64 MiB of device globals, loaded with the module's code (at load when eager, at the first launch of a
// function of the module when lazy).
__device__ char g_module_data[64 << 20];

__global__ void Small(int* out) {
  if (out != nullptr && threadIdx.x == 0) out[blockIdx.x] = 1;
}
__global__ void Small2(int* out) {
  if (out != nullptr && threadIdx.x == 0) out[blockIdx.x] = 2;
}
__global__ void TouchModuleData(int* out) {
  if (threadIdx.x == 0) out[0] = g_module_data[blockIdx.x * 4096];
}
// Local memory: a per-thread array the compiler cannot keep in registers.
template <int kBytes>
__global__ void Local(int* out, int index) {
  volatile char stack[kBytes];
  for (int i = threadIdx.x % 64; i < kBytes; i += 64) stack[i] = static_cast<char>(i);
  if (out != nullptr && threadIdx.x == 0) out[blockIdx.x] = stack[index % kBytes];
}
__global__ void Printf() {
  if (threadIdx.x == 0 && blockIdx.x == 0) printf("probe printf\n");
}
__global__ void DeviceMalloc(int* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    void* p = malloc(1 << 20);
    out[0] = p != nullptr;
    free(p);
  }
}

nvmlDevice_t g_nvml = nullptr;
double g_last_mib = 0;

double OwnMiB(pid_t pid = getpid()) {
  nvmlProcessInfo_t processes[128];
  unsigned int count = 128;
  if (nvmlDeviceGetComputeRunningProcesses_v3(g_nvml, &count, processes) != NVML_SUCCESS) return -1;
  for (unsigned int i = 0; i < count; ++i) {
    if (static_cast<pid_t>(processes[i].pid) == pid) return processes[i].usedGpuMemory / kMiB;
  }
  return 0;
}

void Step(const char* name, const char* note = "") {
  cudaDeviceSynchronize();
  const double own = OwnMiB();
  size_t free_bytes = 0, total = 0;
  cuMemGetInfo(&free_bytes, &total);
  std::printf(
      "STEP {\"step\": \"%s\", \"nvml_MiB\": %.0f, \"delta_MiB\": %.0f, \"free_MiB\": %.0f, \"note\": \"%s\"}\n", name,
      own, own - g_last_mib, free_bytes / kMiB, note);
  std::fflush(stdout);
  g_last_mib = own;
}

#define CHECK(call)                                                                                       \
  do {                                                                                                    \
    const auto result_ = (call);                                                                          \
    if (static_cast<int>(result_) != 0) std::printf("ERROR %s = %d\n", #call, static_cast<int>(result_)); \
  } while (0)

void OpenNvml() {
  CHECK(nvmlInit_v2());
  CUdevice device = 0;
  CUuuid uuid{};
  CHECK(cuDeviceGet(&device, 0));
  CHECK(cuDeviceGetUuid_v2(&uuid, device));
  char text[96];
  const auto* u = reinterpret_cast<const unsigned char*>(uuid.bytes);
  std::snprintf(text, sizeof text, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
  CHECK(nvmlDeviceGetHandleByUUID(text, &g_nvml));
}

int IpcOpen(const char* hex) {
  CHECK(cuInit(0));
  OpenNvml();
  CHECK(cudaFree(nullptr));
  Step("ipc child: context");
  CUipcMemHandle handle{};
  for (size_t i = 0; i < sizeof handle.reserved; ++i) {
    unsigned int byte = 0;
    std::sscanf(hex + 2 * i, "%2x", &byte);
    handle.reserved[i] = static_cast<char>(byte);
  }
  CUdeviceptr pointer = 0;
  CHECK(cuIpcOpenMemHandle_v2(&pointer, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  Step("ipc child: cuIpcOpenMemHandle of the parent's 256 MiB");
  std::this_thread::sleep_for(std::chrono::seconds(2));  // the parent reads its own figure meanwhile
  CHECK(cuIpcCloseMemHandle(pointer));
  Step("ipc child: closed");
  return 0;
}

void Ipc(const char* self) {
  CUdeviceptr pointer = 0;
  CHECK(cuMemAlloc(&pointer, 256 << 20));
  Step("ipc parent: cuMemAlloc 256 MiB to share");
  CUipcMemHandle handle{};
  CHECK(cuIpcGetMemHandle(&handle, pointer));
  char hex[2 * sizeof handle.reserved + 1];
  for (size_t i = 0; i < sizeof handle.reserved; ++i) {
    std::snprintf(hex + 2 * i, 3, "%02x", static_cast<unsigned char>(handle.reserved[i]));
  }
  char arg0[] = "driver_memory_probe", arg1[] = "ipc-open";
  char* argv[] = {arg0, arg1, hex, nullptr};
  pid_t child = 0;
  if (posix_spawn(&child, self, nullptr, nullptr, argv, environ) != 0) {
    std::printf("ERROR posix_spawn\n");
    return;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  std::printf(
      "STEP {\"step\": \"ipc parent: while the child holds it\", \"nvml_MiB\": %.0f, \"child_nvml_MiB\": %.0f}\n",
      OwnMiB(), OwnMiB(child));
  int status = 0;
  waitpid(child, &status, 0);
  CHECK(cuMemFree(pointer));
  Step("ipc parent: freed");
}

int Steps(const char* self) {
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  std::printf("LOADING %s\n", loading != nullptr ? loading : "(unset: lazy)");
  CHECK(cuInit(0));
  OpenNvml();
  Step("cuInit + nvmlInit (no context)");
  CHECK(cudaFree(nullptr));
  Step("context (cudaFree(0): primary context, runtime modules registered)");
  int* out = nullptr;
  CHECK(cudaMalloc(&out, 2 << 20));
  Step("cudaMalloc 2 MiB");
  CUfunction small = nullptr;
  CHECK(cudaGetFuncBySymbol(&small, reinterpret_cast<const void*>(Small)));
  CUfunctionLoadingState state = CU_FUNCTION_LOADING_STATE_MAX;
  CHECK(cuFuncIsLoaded(&state, small));
  std::printf("FUNC_LOADED before first launch: %d (1 unloaded, 2 loaded)\n", static_cast<int>(state));
  Step("cudaGetFuncBySymbol(Small)");
  CHECK(cuFuncLoad(small));
  Step("cuFuncLoad(Small)");
  Small<<<132, 128>>>(out);
  Step("first launch of Small");
  Small2<<<132, 128>>>(out);
  Step("first launch of Small2 (same module)");
  TouchModuleData<<<132, 128>>>(out);
  Step("first launch of TouchModuleData (64 MiB __device__ array)");
  int local_bytes = 0;
  cudaFuncAttributes attributes{};
  CHECK(cudaFuncGetAttributes(&attributes, Local<4096>));
  local_bytes = static_cast<int>(attributes.localSizeBytes);
  std::printf("LOCAL Local<4096> localSizeBytes=%d\n", local_bytes);
  Local<4096><<<132, 128>>>(out, 7);
  Step("first launch of Local<4096> (4 KiB local per thread)");
  Local<4096><<<132, 128>>>(out, 9);
  Step("second launch of Local<4096>");
  Local<16384><<<132, 128>>>(out, 7);
  std::printf("STEP {\"step\": \"Local<16384> launched, not yet synchronized\", \"nvml_MiB\": %.0f}\n", OwnMiB());
  Step("first launch of Local<16384> (16 KiB local per thread)");
  Small<<<132, 128>>>(out);
  Step("Small again after Local<16384> (does local memory shrink?)");
  size_t value = 0;
  CHECK(cuCtxGetLimit(&value, CU_LIMIT_STACK_SIZE));
  std::printf("LIMIT stack %zu\n", value);
  CHECK(cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 32768));
  Step("cuCtxSetLimit(STACK_SIZE, 32 KiB)");
  Small<<<132, 128>>>(out);
  Step("launch after the stack limit");
  CHECK(cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 1024));
  Step("cuCtxSetLimit(STACK_SIZE, 1 KiB) back");
  CHECK(cuCtxGetLimit(&value, CU_LIMIT_PRINTF_FIFO_SIZE));
  std::printf("LIMIT printf %zu\n", value);
  CHECK(cuCtxSetLimit(CU_LIMIT_PRINTF_FIFO_SIZE, 64 << 20));
  Step("cuCtxSetLimit(PRINTF_FIFO_SIZE, 64 MiB)");
  Printf<<<1, 32>>>();
  Step("first launch of a printf kernel");
  CHECK(cuCtxGetLimit(&value, CU_LIMIT_MALLOC_HEAP_SIZE));
  std::printf("LIMIT heap %zu\n", value);
  CHECK(cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 256 << 20));
  Step("cuCtxSetLimit(MALLOC_HEAP_SIZE, 256 MiB)");
  DeviceMalloc<<<1, 32>>>(out);
  Step("first launch of a device-malloc kernel");
  // Graph memory nodes.
  cudaStream_t stream = nullptr;
  CHECK(cudaStreamCreate(&stream));
  Step("cudaStreamCreate");
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  void* graph_block = nullptr;
  CHECK(cudaMallocAsync(&graph_block, 128 << 20, stream));
  CHECK(cudaMemsetAsync(graph_block, 1, 128 << 20, stream));
  CHECK(cudaFreeAsync(graph_block, stream));
  CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  Step("graph with a 128 MiB memory node: instantiated");
  CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaStreamSynchronize(stream));
  Step("graph launched");
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  Step("graph destroyed");
  CHECK(cudaDeviceGraphMemTrim(0));
  Step("cudaDeviceGraphMemTrim");
  // Host registration: pinned host memory, no device memory expected.
  void* host = std::malloc(256 << 20);
  CHECK(cuMemHostRegister_v2(host, 256 << 20, 0));
  Step("cuMemHostRegister 256 MiB");
  CHECK(cuMemHostUnregister(host));
  std::free(host);
  // Streams and events in number.
  cudaStream_t streams[64];
  for (auto& s : streams) CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Step("64 more streams");
  cudaEvent_t events[256];
  for (auto& e : events) CHECK(cudaEventCreate(&e));
  Step("256 events");
  CUcontext second = nullptr;
  CUctxCreateParams params{};
  CUcontext primary = nullptr;
  CHECK(cuCtxGetCurrent(&primary));
  CHECK(cuCtxCreate_v4(&second, &params, 0, 0));
  Step("a second context (cuCtxCreate)");
  CHECK(cuCtxDestroy(second));
  CHECK(cuCtxSetCurrent(primary));
  Step("second context destroyed");
  Ipc(self);
  // What one read of NVML's process list costs (the reconciliation's price).
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 200; ++i) OwnMiB();
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / 200;
  std::printf("NVML_READ_US %.1f\n", us);
  return 0;
}

int PidNamespace() {
  CHECK(cuInit(0));
  OpenNvml();
  CHECK(cudaFree(nullptr));
  nvmlProcessInfo_t processes[128];
  unsigned int count = 128;
  CHECK(nvmlDeviceGetComputeRunningProcesses_v3(g_nvml, &count, processes));
  std::printf("PIDNS getpid=%d nvml_pids=[", static_cast<int>(getpid()));
  for (unsigned int i = 0; i < count; ++i) std::printf("%s%u", i ? "," : "", processes[i].pid);
  std::printf("]\n");
  if (FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    while (std::fgets(line, sizeof line, f) != nullptr) {
      if (std::strncmp(line, "NSpid:", 6) == 0) std::printf("PIDNS %s", line);
    }
    std::fclose(f);
  }
  return 0;
}

int LimitsFill() {
  CHECK(cuInit(0));
  OpenNvml();
  CHECK(cudaFree(nullptr));
  Step("context");
  const cudaError_t stack = cudaDeviceSetLimit(cudaLimitStackSize, 4096);
  const cudaError_t fifo = cudaDeviceSetLimit(cudaLimitPrintfFifoSize, 64 << 20);
  std::printf("LIMITS stack=%d fifo=%d\n", static_cast<int>(stack), static_cast<int>(fifo));
  Step("stack 4 KiB, printf FIFO 64 MiB");
  int* out = nullptr;
  CHECK(cudaMalloc(&out, 2 << 20));
  Local<4096><<<132, 128>>>(out, 7);
  const cudaError_t launched = cudaGetLastError();
  std::printf("LAUNCH local=%d\n", static_cast<int>(launched));
  Step("a kernel with 4 KiB of local memory");
  int blocks = 0;
  for (void* p = nullptr; blocks < 100000 && cudaMalloc(&p, 2 << 20) == cudaSuccess; ++blocks) {
  }
  cudaGetLastError();
  Step("filled in 2 MiB blocks to OOM");
  std::printf("RESULT {\"mode\": \"limits-fill\", \"blocks_2MiB\": %d, \"MiB_filled\": %d, \"nvml_MiB\": %.0f}\n",
              blocks, 2 * blocks, OwnMiB());
  std::fflush(stdout);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // held: the host sampler reads the peak
  return 0;
}

int AllocLoop(int count) {
  CHECK(cuInit(0));
  CHECK(cudaFree(nullptr));
  CUdeviceptr p = 0;
  for (int i = 0; i < 200; ++i) {  // warm-up
    cuMemAlloc(&p, 2 << 20);
    cuMemFree(p);
  }
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < count; ++i) {
    cuMemAlloc(&p, 2 << 20);
    cuMemFree(p);
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / count;
  std::printf(
      "RESULT {\"mode\": \"alloc-loop\", \"pairs\": %d, \"ns_per_pair\": %.0f, \"preload\": \"%s\", \"limit\": "
      "\"%s\"}\n",
      count, ns, std::getenv("LD_PRELOAD") ? std::getenv("LD_PRELOAD") : "",
      std::getenv("CUDA_DEVICE_MEMORY_LIMIT") ? std::getenv("CUDA_DEVICE_MEMORY_LIMIT") : "");
  return 0;
}

int LaunchLoop(int count) {
  CHECK(cudaFree(nullptr));
  for (int i = 0; i < 2000; ++i) Small<<<1, 32>>>(nullptr);  // warm-up (the first launch loads the module)
  CHECK(cudaDeviceSynchronize());
  const auto start = std::chrono::steady_clock::now();
  for (int i = 1; i <= count; ++i) {
    Small<<<1, 32>>>(nullptr);
    if (i % 1000 == 0) cudaDeviceSynchronize();
  }
  CHECK(cudaDeviceSynchronize());
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / count;
  std::printf(
      "RESULT {\"mode\": \"launch-loop\", \"launches\": %d, \"ns_per_launch\": %.0f, \"preload\": \"%s\", \"limit\": "
      "\"%s\"}\n",
      count, ns, std::getenv("LD_PRELOAD") ? std::getenv("LD_PRELOAD") : "",
      std::getenv("CUDA_DEVICE_MEMORY_LIMIT") ? std::getenv("CUDA_DEVICE_MEMORY_LIMIT") : "");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "steps";
  if (mode == "ipc-open" && argc > 2) return IpcOpen(argv[2]);
  if (mode == "pidns") return PidNamespace();
  if (mode == "limits-fill") return LimitsFill();
  if (mode == "launch-loop") return LaunchLoop(argc > 2 ? std::atoi(argv[2]) : 200000);
  if (mode == "alloc-loop") return AllocLoop(argc > 2 ? std::atoi(argv[2]) : 20000);
  return Steps(argv[0]);
}

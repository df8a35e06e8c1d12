// Compute caps on every launch path: each launch is admitted by the limiter (the container's GPU-time budget in
// the region), the launching thread sleeps to the exact moment the budget allows, and CUDA events around the
// kernel measure what it really cost (docs/compute-limit.md). The stages a launch passes are in launch.h, each in
// its own file; this file holds the entry points and the order of the stages.
#include "vgpu/base/random.h"
#include "driver_memory.h"
#include "launch.h"

namespace vgpu::hooks {
namespace {

using namespace launch;

std::uint64_t ShapeOf(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shared) {
  std::uint64_t h = base::kFnvOffset;
  for (std::uint64_t v : {gx, gy, gz, bx, by, bz, shared}) h = base::Fnv1aStep(h, v);
  return h;
}

// Whether `stream` is being captured into a graph (asked only while some capture may be in progress: g_captures).
// A launch into it records a graph node and runs nothing now: it is admitted when the graph is launched. Nothing may
// be queried or recorded meanwhile (that would invalidate the capture).
bool CapturingInto(CUstream stream) {
  if (g_captures.load(std::memory_order_acquire) == 0) return false;  // (below zero: a capture ended that began unseen)
  CUstreamCaptureStatus capturing = CU_STREAM_CAPTURE_STATUS_NONE;
  return Real::cuStreamIsCapturing != nullptr && Real::cuStreamIsCapturing(stream, &capturing) == CUDA_SUCCESS &&
         capturing != CU_STREAM_CAPTURE_STATUS_NONE;
}

// Admits, waits, launches, measures: the stages of launch.h in order. `launch` performs the real launch on `stream`;
// `per_thread` says that a null stream means the per-thread default stream (the _ptsz entry points).
template <typename Launch>
CUresult LimitedCompute(const void* function, std::uint64_t shape, CUstream stream, bool per_thread, Launch&& launch) {
  if (CurrentMode() != Mode::limited || !TheShim().compute_limits) return launch();
  // (A _ptsz entry point's null stream is the per-thread stream: asked about and recorded on as such.)
  if (per_thread && stream == nullptr) stream = CU_STREAM_PER_THREAD;
  // A launch the thread's book admitted already: nothing else to do.
  if (LaunchBook* book = OpenBookFor(function, shape, stream); book != nullptr && BeginBooked(*book)) {
    const CUresult result = launch();
    Booked(*book, result);
    return result;
  }
  VGPU_COUNT(whole_path, 1);
  Launching l;
  l.key = policy::KernelKey{function, shape};
  l.stream = stream;
  l.force_sample = CloseBookFor(function, shape, stream);
  if (CapturingInto(stream)) return launch();
  if (CUresult refused; !Find(l, refused)) return refused != CUDA_SUCCESS ? refused : launch();
  l.now = NowNs();
  Observe(*l.d, l.ordinal, l.now);
  Release(l);
  if (!Admit(l)) return CUDA_ERROR_OUT_OF_MEMORY;
  if (const CUresult refused = BeginMeasure(l); refused != CUDA_SUCCESS) return refused;
  return Settle(l, launch());
}

// Every launch hook's way in: the driver's own memory a first launch takes (driver_memory.h), then the compute limiter.
// `shape` 0 is a graph launch.
template <typename Launch>
CUresult Limited(const void* function, std::uint64_t shape, CUstream stream, bool per_thread, Launch&& launch) {
  BeforeLaunch();
  if (!TheShim().memory_limits) return LimitedCompute(function, shape, stream, per_thread, launch);
  return LaunchCountingDriverMemory(function, shape == 0,
                                    [&] { return LimitedCompute(function, shape, stream, per_thread, launch); });
}

}  // namespace

void ForgetLaunchBooksAfterFork() {
  ForgetBooksAfterFork();
  gates::ForgetAfterFork();
}

void ForgetComputeContext(CUcontext context) {
  gates::ForgetContext(context);  // a gate word in its pinned memory goes with it
  for (DeviceLimiter& d : g_devices) {
    if (d.limiter) ForgetContextOn(d, context);
  }
}

}  // namespace vgpu::hooks

using namespace vgpu::hooks;
using namespace vgpu::hooks::launch;

#define VGPU_LAUNCH_FUNCTION_CHECK(real)                         \
  do {                                                           \
    if (Real::real == nullptr) ResolveReal();                    \
    if (Real::real == nullptr) return CUDA_ERROR_NOT_FOUND;      \
    if (CurrentMode() == Mode::failed) return kFailedClosedCuda; \
  } while (0)

extern "C" VGPU_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                               unsigned by, unsigned bz, unsigned shared, CUstream stream,
                                               void** params, void** extra) try {
  VGPU_LAUNCH_FUNCTION_CHECK(cuLaunchKernel);
  return Limited(f, ShapeOf(gx, gy, gz, bx, by, bz, shared), stream, false,
                 [&] { return Real::cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                                    unsigned by, unsigned bz, unsigned shared, CUstream stream,
                                                    void** params, void** extra) try {
  VGPU_LAUNCH_FUNCTION_CHECK(cuLaunchKernel_ptsz);
  return Limited(f, ShapeOf(gx, gy, gz, bx, by, bz, shared), stream, true,
                 [&] { return Real::cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                                          unsigned bx, unsigned by, unsigned bz, unsigned shared,
                                                          CUstream stream, void** params) try {
  VGPU_LAUNCH_FUNCTION_CHECK(cuLaunchCooperativeKernel);
  return Limited(f, ShapeOf(gx, gy, gz, bx, by, bz, shared), stream, false,
                 [&] { return Real::cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                                               unsigned bx, unsigned by, unsigned bz, unsigned shared,
                                                               CUstream stream, void** params) try {
  VGPU_LAUNCH_FUNCTION_CHECK(cuLaunchCooperativeKernel_ptsz);
  return Limited(f, ShapeOf(gx, gy, gz, bx, by, bz, shared), stream, true, [&] {
    return Real::cuLaunchCooperativeKernel_ptsz(f, gx, gy, gz, bx, by, bz, shared, stream, params);
  });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig* config, CUfunction f, void** params,
                                                 void** extra) try {
  VGPU_LAUNCH_FUNCTION_CHECK(cuLaunchKernelEx);
  if (config == nullptr) return Real::cuLaunchKernelEx(config, f, params, extra);
  return Limited(f,
                 ShapeOf(config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
                         config->blockDimZ, config->sharedMemBytes),
                 config->hStream, false, [&] { return Real::cuLaunchKernelEx(config, f, params, extra); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig* config, CUfunction f, void** params,
                                                      void** extra) try {
  VGPU_LAUNCH_FUNCTION_CHECK(cuLaunchKernelEx_ptsz);
  if (config == nullptr) return Real::cuLaunchKernelEx_ptsz(config, f, params, extra);
  return Limited(f,
                 ShapeOf(config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
                         config->blockDimZ, config->sharedMemBytes),
                 config->hStream, true, [&] { return Real::cuLaunchKernelEx_ptsz(config, f, params, extra); });
}
VGPU_CUDA_CATCH

// A graph launch is admitted and measured as one unit: its key is the executable graph.
extern "C" VGPU_EXPORT CUresult cuGraphLaunch(CUgraphExec graph, CUstream stream) try {
  VGPU_LAUNCH_FUNCTION_CHECK(cuGraphLaunch);
  return Limited(graph, 0, stream, false, [&] { return Real::cuGraphLaunch(graph, stream); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec graph, CUstream stream) try {
  VGPU_LAUNCH_FUNCTION_CHECK(cuGraphLaunch_ptsz);
  return Limited(graph, 0, stream, true, [&] { return Real::cuGraphLaunch_ptsz(graph, stream); });
}
VGPU_CUDA_CATCH

// ---- stream capture: counted, so that launches need no capture check while nothing is captured (g_captures) ----

namespace {

// Whether the driver says `stream` is capturing (an invalidated capture too: it still has to be ended). A query that
// fails counts as capturing: the count then stays up, which is only slower.
bool Capturing(CUstream stream) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  if (Real::cuStreamIsCapturing == nullptr || Real::cuStreamIsCapturing(stream, &status) != CUDA_SUCCESS) return true;
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

template <typename Begin>
CUresult CountedBegin(Begin&& begin) {
  g_captures.fetch_add(1, std::memory_order_acq_rel);
  const CUresult result = begin();
  if (result != CUDA_SUCCESS) g_captures.fetch_sub(1, std::memory_order_acq_rel);
  return result;
}

// `stream` as the driver names it for the non-_ptsz query (a _ptsz call's null stream is the per-thread stream).
template <typename End>
CUresult CountedEnd(CUstream stream, End&& end) {
  const bool was = Capturing(stream);
  const CUresult result = end();
  if (was && !Capturing(stream)) g_captures.fetch_sub(1, std::memory_order_acq_rel);
  return result;
}

}  // namespace

#define VGPU_REAL_OR_NOT_FOUND(real)                        \
  do {                                                      \
    if (Real::real == nullptr) ResolveReal();               \
    if (Real::real == nullptr) return CUDA_ERROR_NOT_FOUND; \
  } while (0)

// (The CUDA 10.0 entry points, without a mode: a global-mode capture.)
extern "C" VGPU_EXPORT CUresult cuStreamBeginCapture(CUstream stream) try {
  VGPU_REAL_OR_NOT_FOUND(cuStreamBeginCapture);
  return CountedBegin([&] { return Real::cuStreamBeginCapture(stream); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuStreamBeginCapture_ptsz(CUstream stream) try {
  VGPU_REAL_OR_NOT_FOUND(cuStreamBeginCapture_ptsz);
  return CountedBegin([&] { return Real::cuStreamBeginCapture_ptsz(stream); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuStreamBeginCapture_v2(CUstream stream, CUstreamCaptureMode mode) try {
  VGPU_REAL_OR_NOT_FOUND(cuStreamBeginCapture_v2);
  return CountedBegin([&] { return Real::cuStreamBeginCapture_v2(stream, mode); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream stream, CUstreamCaptureMode mode) try {
  VGPU_REAL_OR_NOT_FOUND(cuStreamBeginCapture_v2_ptsz);
  return CountedBegin([&] { return Real::cuStreamBeginCapture_v2_ptsz(stream, mode); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuStreamBeginCaptureToGraph(CUstream stream, CUgraph graph,
                                                            const CUgraphNode* dependencies,
                                                            const CUgraphEdgeData* edges, size_t count,
                                                            CUstreamCaptureMode mode) try {
  VGPU_REAL_OR_NOT_FOUND(cuStreamBeginCaptureToGraph);
  return CountedBegin(
      [&] { return Real::cuStreamBeginCaptureToGraph(stream, graph, dependencies, edges, count, mode); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream stream, CUgraph graph,
                                                                 const CUgraphNode* dependencies,
                                                                 const CUgraphEdgeData* edges, size_t count,
                                                                 CUstreamCaptureMode mode) try {
  VGPU_REAL_OR_NOT_FOUND(cuStreamBeginCaptureToGraph_ptsz);
  return CountedBegin(
      [&] { return Real::cuStreamBeginCaptureToGraph_ptsz(stream, graph, dependencies, edges, count, mode); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuStreamEndCapture(CUstream stream, CUgraph* graph) try {
  VGPU_REAL_OR_NOT_FOUND(cuStreamEndCapture);
  return CountedEnd(stream, [&] { return Real::cuStreamEndCapture(stream, graph); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream stream, CUgraph* graph) try {
  VGPU_REAL_OR_NOT_FOUND(cuStreamEndCapture_ptsz);
  return CountedEnd(stream == nullptr ? CU_STREAM_PER_THREAD : stream,
                    [&] { return Real::cuStreamEndCapture_ptsz(stream, graph); });
}
VGPU_CUDA_CATCH

// ---- synchronize calls: while a thread waits in one, time division keeps the process's work published as running --

extern "C" VGPU_EXPORT CUresult cuCtxSynchronize() try {
  VGPU_REAL_OR_NOT_FOUND(cuCtxSynchronize);
  return Synchronizing([] { return Real::cuCtxSynchronize(); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuCtxSynchronize_v2(CUcontext context) try {
  VGPU_REAL_OR_NOT_FOUND(cuCtxSynchronize_v2);
  return Synchronizing([&] { return Real::cuCtxSynchronize_v2(context); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuStreamSynchronize(CUstream stream) try {
  VGPU_REAL_OR_NOT_FOUND(cuStreamSynchronize);
  return Synchronizing([&] { return Real::cuStreamSynchronize(stream); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream stream) try {
  VGPU_REAL_OR_NOT_FOUND(cuStreamSynchronize_ptsz);
  return Synchronizing([&] { return Real::cuStreamSynchronize_ptsz(stream); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuEventSynchronize(CUevent event) try {
  VGPU_REAL_OR_NOT_FOUND(cuEventSynchronize);
  return Synchronizing([&] { return Real::cuEventSynchronize(event); });
}
VGPU_CUDA_CATCH

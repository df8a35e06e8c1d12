// Launches vgpu_spin through the CUDA Driver API, closed loop or at a fixed rate, and measures the run.
#include "workload.h"

#include <time.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace vgpu::tenant {
namespace {

void Check(CUresult result, const char* call)
{
    if (result != CUDA_SUCCESS) {
        throw CudaFailure{result, call};
    }
}

// Names the function once: it is both called and reported. Write the exported,
// versioned symbol (cuMemAlloc_v2, not the cuda.h macro cuMemAlloc), since the
// report must name what a shim or fakecuda's fault rules see.
#define VGPU_TENANT_CUDA(function, ...) Check(function(__VA_ARGS__), #function)

// Owns one driver object and gives it back exactly once.
template <typename Handle>
class DriverObject {
public:
    using ReleaseFunction = CUresult (*)(Handle);

    DriverObject() = default;
    DriverObject(Handle handle, ReleaseFunction release, const char* release_name)
        : handle_(handle), release_(release), release_name_(release_name), held_(true)
    {
    }
    DriverObject(const DriverObject&) = delete;
    DriverObject& operator=(const DriverObject&) = delete;
    DriverObject(DriverObject&& other) noexcept
        : handle_(other.handle_), release_(other.release_), release_name_(other.release_name_),
          held_(std::exchange(other.held_, false))
    {
    }
    DriverObject& operator=(DriverObject&& other) noexcept
    {
        if (this != &other) {
            Abandon();
            handle_ = other.handle_;
            release_ = other.release_;
            release_name_ = other.release_name_;
            held_ = std::exchange(other.held_, false);
        }
        return *this;
    }
    ~DriverObject() { Abandon(); }

    Handle get() const { return handle_; }

    // The normal end: a failure to release is a failure of the run, so it is
    // reported rather than assumed away.
    void Release()
    {
        if (held_) {
            held_ = false;
            Check(release_(handle_), release_name_);
        }
    }

private:
    // Unwinding after a failure: that first failure is what gets reported, and
    // a second one while tearing down (a sticky launch error, say) adds nothing.
    void Abandon() noexcept
    {
        if (held_) {
            held_ = false;
            static_cast<void>(release_(handle_));
        }
    }

    Handle handle_{};
    ReleaseFunction release_ = nullptr;
    const char* release_name_ = "";
    bool held_ = false;
};

std::int64_t MonotonicNs()
{
    timespec now{};
    clock_gettime(CLOCK_MONOTONIC, &now);
    return static_cast<std::int64_t>(now.tv_sec) * 1'000'000'000 + now.tv_nsec;
}

// Sleeps to an absolute time, so that a schedule of deadlines never drifts
// however late each wake-up is.
void SleepUntilNs(std::int64_t deadline_ns)
{
    const timespec deadline{static_cast<time_t>(deadline_ns / 1'000'000'000),
                            static_cast<long>(deadline_ns % 1'000'000'000)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &deadline, nullptr) == EINTR) {
    }
}

// One stream and a ring of events, one per kernel in flight: the oldest event
// is the one to wait for when the stream is full.
class StreamQueue {
public:
    explicit StreamQueue(std::uint32_t depth)
    {
        CUstream stream = nullptr;
        // Non-blocking: the tenant's streams never wait for work on the legacy default stream.
        VGPU_TENANT_CUDA(cuStreamCreate, &stream, CU_STREAM_NON_BLOCKING);
        stream_ = DriverObject<CUstream>(stream, cuStreamDestroy_v2, "cuStreamDestroy_v2");
        completions_.reserve(depth);
        for (std::uint32_t index = 0; index < depth; ++index) {
            CUevent event = nullptr;
            // Waiting follows the context's scheduling policy (spin while the host
            // has idle CPUs, else yield), as in the CUDA runtime and PyTorch, so a
            // synchronous loop leaves the GPU idle no longer than theirs would.
            // Timing off: the events only mark completion.
            VGPU_TENANT_CUDA(cuEventCreate, &event, CU_EVENT_DISABLE_TIMING);
            completions_.emplace_back(event, cuEventDestroy_v2, "cuEventDestroy_v2");
        }
    }

    // Returns once fewer than depth kernels are in flight on this stream.
    void WaitForRoom()
    {
        if (in_flight_ == completions_.size()) {
            VGPU_TENANT_CUDA(cuEventSynchronize, completions_[oldest_].get());
            oldest_ = (oldest_ + 1) % completions_.size();
            --in_flight_;
        }
    }

    void Launch(CUfunction function, std::uint32_t blocks, std::uint32_t threads, unsigned long long ns_per_block)
    {
        void* parameters[] = {&ns_per_block};
        VGPU_TENANT_CUDA(cuLaunchKernel, function, blocks, 1, 1, threads, 1, 1, 0, stream_.get(), parameters,
                         nullptr);
        const std::size_t newest = (oldest_ + in_flight_) % completions_.size();
        VGPU_TENANT_CUDA(cuEventRecord, completions_[newest].get(), stream_.get());
        ++in_flight_;
    }

    void Drain()
    {
        VGPU_TENANT_CUDA(cuStreamSynchronize, stream_.get());
        in_flight_ = 0;
    }

    void Release()
    {
        for (DriverObject<CUevent>& event : completions_) {
            event.Release();
        }
        stream_.Release();
    }

private:
    DriverObject<CUstream> stream_;
    std::vector<DriverObject<CUevent>> completions_;
    std::size_t oldest_ = 0;
    std::size_t in_flight_ = 0;
};

int DeviceAttribute(CUdevice_attribute attribute, CUdevice device)
{
    int value = 0;
    VGPU_TENANT_CUDA(cuDeviceGetAttribute, &value, attribute, device);
    return value;
}

}  // namespace

std::uint64_t WavesFor(std::uint64_t blocks, std::uint64_t threads_per_block, int sm_count,
                       int max_threads_per_sm, int max_blocks_per_sm)
{
    std::uint64_t resident_per_sm =
        threads_per_block > 0 ? static_cast<std::uint64_t>(std::max(max_threads_per_sm, 0)) / threads_per_block : 0;
    if (max_blocks_per_sm > 0) {
        resident_per_sm = std::min(resident_per_sm, static_cast<std::uint64_t>(max_blocks_per_sm));
    }
    // A block larger than an SM's thread limit does not launch at all; the
    // launch reports that, so count one block per SM rather than divide by 0.
    resident_per_sm = std::max<std::uint64_t>(resident_per_sm, 1);
    const std::uint64_t blocks_per_wave = static_cast<std::uint64_t>(std::max(sm_count, 1)) * resident_per_sm;
    return std::max<std::uint64_t>((blocks + blocks_per_wave - 1) / blocks_per_wave, 1);
}

std::string ErrorName(CUresult result)
{
    const char* name = nullptr;
    if (cuGetErrorName(result, &name) == CUDA_SUCCESS && name != nullptr) {
        return name;
    }
    // The toolkit's stub libcuda answers every call, cuGetErrorName included,
    // with this code: name it, since it is the one that says "no driver here".
    if (result == CUDA_ERROR_STUB_LIBRARY) {
        return "CUDA_ERROR_STUB_LIBRARY";
    }
    return "CUresult " + std::to_string(static_cast<int>(result));
}

std::string ErrorDescription(CUresult result)
{
    const char* description = nullptr;
    if (cuGetErrorString(result, &description) == CUDA_SUCCESS && description != nullptr) {
        return description;
    }
    if (result == CUDA_ERROR_STUB_LIBRARY) {
        return "the CUDA toolkit's stub libcuda.so.1 was loaded instead of a driver";
    }
    return "no description from the driver";
}

void RunWorkload(const Options& options, const char* ptx, ResultLine* result)
{
    VGPU_TENANT_CUDA(cuInit, 0);
    CUdevice device = 0;
    VGPU_TENANT_CUDA(cuDeviceGet, &device, options.device);

    // The primary context, as the CUDA runtime and PyTorch use it, so the
    // tenant looks to a shim like the applications it stands for.
    CUcontext context = nullptr;
    VGPU_TENANT_CUDA(cuDevicePrimaryCtxRetain, &context, device);
    DriverObject<CUdevice> primary_context(device, cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease_v2");
    VGPU_TENANT_CUDA(cuCtxSetCurrent, context);

    CUmodule module_handle = nullptr;
    VGPU_TENANT_CUDA(cuModuleLoadData, &module_handle, ptx);
    DriverObject<CUmodule> module(module_handle, cuModuleUnload, "cuModuleUnload");
    CUfunction spin = nullptr;
    VGPU_TENANT_CUDA(cuModuleGetFunction, &spin, module.get(), "vgpu_spin");

    const std::uint64_t waves = WavesFor(
        options.blocks, options.threads, DeviceAttribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device),
        DeviceAttribute(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, device),
        DeviceAttribute(CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR, device));
    const unsigned long long ns_per_block = options.kernel_us * 1000 / waves;

    DriverObject<CUdeviceptr> memory;
    if (options.alloc_bytes > 0) {
        CUdeviceptr address = 0;
        VGPU_TENANT_CUDA(cuMemAlloc_v2, &address, options.alloc_bytes);
        memory = DriverObject<CUdeviceptr>(address, cuMemFree_v2, "cuMemFree_v2");
        result->alloc_bytes = options.alloc_bytes;
        // Touch every byte, so that the memory is really in use (a driver may
        // back pages lazily), and finish before the clock starts.
        VGPU_TENANT_CUDA(cuMemsetD8_v2, address, 0, options.alloc_bytes);
        VGPU_TENANT_CUDA(cuCtxSynchronize);
    }

    std::vector<StreamQueue> streams;
    streams.reserve(options.streams);
    for (std::uint32_t index = 0; index < options.streams; ++index) {
        streams.emplace_back(options.depth);
    }

    const std::uint64_t kernel_limit = options.seconds ? std::numeric_limits<std::uint64_t>::max()
                                                       : options.kernel_count.value_or(kDefaultKernelCount);
    const std::int64_t start_ns = MonotonicNs();
    // Bounded by the option parser (at most 10^6 s), so this cannot overflow.
    const std::int64_t stop_ns = options.seconds
                                     ? start_ns + static_cast<std::int64_t>(std::llround(*options.seconds * 1e9))
                                     : std::numeric_limits<std::int64_t>::max();
    const double period_ns = options.rate_hz ? 1e9 / *options.rate_hz : 0;
    // A deadline past this is centuries away: the schedule is over in practice.
    constexpr double kLatestDeadlineOffsetNs = 1e18;

    // The elapsed time so far is kept in the result, so a failure part way
    // still reports how long the tenant ran.
    const auto note_progress = [&](std::uint64_t launched) {
        result->kernels = launched;
        result->elapsed_s = static_cast<double>(MonotonicNs() - start_ns) * 1e-9;
    };
    std::uint64_t launched = 0;
    try {
        while (launched < kernel_limit) {
            StreamQueue& stream = streams[launched % streams.size()];
            if (options.rate_hz) {
                // Each deadline from the launch index, not from the last one, so
                // no error accumulates: launch i is due at start + i / rate.
                const double offset_ns = static_cast<double>(launched) * period_ns;
                if (offset_ns >= kLatestDeadlineOffsetNs) {
                    break;
                }
                const std::int64_t deadline_ns = start_ns + static_cast<std::int64_t>(offset_ns);
                if (deadline_ns >= stop_ns) {
                    break;
                }
                SleepUntilNs(deadline_ns);
                stream.WaitForRoom();
            } else {
                stream.WaitForRoom();
                if (MonotonicNs() >= stop_ns) {
                    break;
                }
            }
            stream.Launch(spin, options.blocks, options.threads, ns_per_block);
            ++launched;
        }
        for (StreamQueue& stream : streams) {
            stream.Drain();
        }
    } catch (const CudaFailure&) {
        note_progress(launched);
        throw;
    }
    note_progress(launched);

    for (StreamQueue& stream : streams) {
        stream.Release();
    }
    memory.Release();
    module.Release();
    primary_context.Release();
}

}  // namespace vgpu::tenant

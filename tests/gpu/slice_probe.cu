// slice_probe: how a real GPU time-slices between processes, seen from inside the kernels (issue 6, calibration).
//
// Each kernel spins until it has *run* --kernel-us of device time, reading %globaltimer (one clock for every
// context on the device) in a tight loop: consecutive reads are ~0.1-0.3 us apart while the kernel runs, so a gap
// over --gap-us means the context was switched out. Block 0 writes, per kernel: the globaltimer at entry and exit,
// the time it ran, and the first 16 gaps. The host puts a CUDA event pair around every kernel (as the shim does
// when it measures one), so each line compares what the event pair says with what the kernel ran.
//
//   slice_probe --kernel-us 1000 --blocks 132 --seconds 4 --depth 2 [--duty 0.3] --out a.jsonl
//
// --duty D < 1: after each kernel completes the host sleeps so that the kernels fill about D of the wall time (a
// throttled tenant, as the shim's limiter makes one); with --duty the depth is 1.
// Output: one JSON line per kernel, then a summary line. Build: nvcc -O2 -arch=sm_90 -o slice_probe slice_probe.cu
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int kMaxGaps = 16;

struct Record {
  unsigned long long entry;  // globaltimer when block 0 started
  unsigned long long exit;   // globaltimer when block 0 finished
  unsigned long long ran;    // sum of the small steps: the time block 0 ran
  unsigned int gaps;         // how many gaps (switched out) block 0 saw
  unsigned int pad;
  unsigned long long gap[kMaxGaps][2];
};

__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void Probe(unsigned long long run_ns, unsigned long long gap_ns, Record* record) {
  unsigned long long previous = GlobalTimer();
  const unsigned long long entry = previous;
  unsigned long long ran = 0;
  unsigned int gaps = 0;
  const bool writer = blockIdx.x == 0 && threadIdx.x == 0;
  while (ran < run_ns) {
    const unsigned long long now = GlobalTimer();
    const unsigned long long step = now - previous;
    if (step > gap_ns) {
      if (writer && gaps < kMaxGaps) {
        record->gap[gaps][0] = previous;
        record->gap[gaps][1] = now;
      }
      ++gaps;
    } else {
      ran += step;
    }
    previous = now;
  }
  if (writer) {
    record->entry = entry;
    record->exit = previous;
    record->ran = ran;
    record->gaps = gaps;
  }
}

__global__ void ReadTimer(unsigned long long* out) { *out = GlobalTimer(); }

void Check(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    std::fprintf(stderr, "slice_probe: %s: %s\n", what, cudaGetErrorString(error));
    std::exit(1);
  }
}

double Arg(int argc, char** argv, const char* name, double fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atof(argv[i + 1]);
  }
  return fallback;
}

const char* StrArg(int argc, char** argv, const char* name, const char* fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  }
  return fallback;
}

long long HostNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int main(int argc, char** argv) {
  const double kernel_us = Arg(argc, argv, "--kernel-us", 1000);
  const int blocks = static_cast<int>(Arg(argc, argv, "--blocks", 132));
  const double seconds = Arg(argc, argv, "--seconds", 4);
  const double duty = Arg(argc, argv, "--duty", 1.0);
  int depth = static_cast<int>(Arg(argc, argv, "--depth", 2));
  const double gap_us = Arg(argc, argv, "--gap-us", 5);
  const char* out_path = StrArg(argc, argv, "--out", "slice_probe.jsonl");
  if (duty < 1.0) depth = 1;

  Check(cudaSetDevice(0), "cudaSetDevice");
  cudaStream_t stream;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const std::size_t capacity = static_cast<std::size_t>(seconds * 1e6 / std::max(kernel_us, 1.0) * 1.5) + 64;
  Record* records = nullptr;
  Check(cudaMalloc(&records, capacity * sizeof(Record)), "cudaMalloc");
  Check(cudaMemset(records, 0, capacity * sizeof(Record)), "cudaMemset");
  unsigned long long* timer = nullptr;
  Check(cudaMalloc(&timer, sizeof(*timer)), "cudaMalloc timer");
  // Warm up (module load, first launch), then one read of the GPU clock against the host's.
  Probe<<<blocks, 32, 0, stream>>>(10000, 1000000, records);
  ReadTimer<<<1, 1, 0, stream>>>(timer);
  Check(cudaStreamSynchronize(stream), "warm-up");
  unsigned long long gpu_t0 = 0;
  const long long host_t0 = HostNs();
  ReadTimer<<<1, 1, 0, stream>>>(timer);
  Check(cudaMemcpy(&gpu_t0, timer, sizeof(gpu_t0), cudaMemcpyDeviceToHost), "timer");

  std::vector<cudaEvent_t> start(capacity), end(capacity);
  std::vector<float> event_ms(capacity, -1.0f);
  std::vector<long long> launched(capacity), completed(capacity);
  const long long stop_at = HostNs() + static_cast<long long>(seconds * 1e9);
  std::size_t issued = 0, done = 0;
  auto complete = [&](std::size_t i) {
    Check(cudaEventSynchronize(end[i]), "cudaEventSynchronize");
    completed[i] = HostNs();
    Check(cudaEventElapsedTime(&event_ms[i], start[i], end[i]), "cudaEventElapsedTime");
  };
  while (HostNs() < stop_at && issued < capacity) {
    Check(cudaEventCreate(&start[issued]), "cudaEventCreate");
    Check(cudaEventCreate(&end[issued]), "cudaEventCreate");
    launched[issued] = HostNs();
    Check(cudaEventRecord(start[issued], stream), "cudaEventRecord");
    Probe<<<blocks, 32, 0, stream>>>(static_cast<unsigned long long>(kernel_us * 1000),
                                     static_cast<unsigned long long>(gap_us * 1000), records + issued);
    Check(cudaGetLastError(), "launch");
    Check(cudaEventRecord(end[issued], stream), "cudaEventRecord");
    ++issued;
    while (issued - done >= static_cast<std::size_t>(depth)) complete(done++);
    if (duty < 1.0) {
      const double idle_us = kernel_us * (1.0 / duty - 1.0);
      std::this_thread::sleep_for(std::chrono::microseconds(static_cast<long long>(idle_us)));
    }
  }
  while (done < issued) complete(done++);
  std::vector<Record> host(issued);
  Check(cudaMemcpy(host.data(), records, issued * sizeof(Record), cudaMemcpyDeviceToHost), "copy records");

  FILE* out = std::fopen(out_path, "w");
  if (out == nullptr) {
    std::perror(out_path);
    return 1;
  }
  double ran = 0, event = 0, span = 0;
  unsigned long long gap_total = 0;
  std::size_t preempted = 0;
  for (std::size_t i = 0; i < issued; ++i) {
    const Record& r = host[i];
    std::fprintf(out,
                 "{\"i\":%zu,\"entry\":%llu,\"exit\":%llu,\"ran\":%llu,\"gaps\":%u,\"event_ns\":%.0f,"
                 "\"launched\":%lld,\"completed\":%lld,\"gap\":[",
                 i, r.entry, r.exit, r.ran, r.gaps, event_ms[i] * 1e6, launched[i], completed[i]);
    for (unsigned g = 0; g < std::min<unsigned>(r.gaps, kMaxGaps); ++g) {
      std::fprintf(out, "%s[%llu,%llu]", g ? "," : "", r.gap[g][0], r.gap[g][1]);
      gap_total += r.gap[g][1] - r.gap[g][0];
    }
    std::fprintf(out, "]}\n");
    ran += static_cast<double>(r.ran);
    event += event_ms[i] * 1e6;
    span += static_cast<double>(r.exit - r.entry);
    preempted += r.gaps > 0;
  }
  const double wall = static_cast<double>(completed[issued - 1] - launched[0]);
  std::fprintf(out,
               "{\"summary\":true,\"kernels\":%zu,\"kernel_us\":%.1f,\"blocks\":%d,\"depth\":%d,\"duty\":%.3f,"
               "\"wall_ns\":%.0f,\"ran_ns\":%.0f,\"event_ns\":%.0f,\"span_ns\":%.0f,\"gap_ns\":%llu,"
               "\"preempted\":%zu,\"gpu_t0\":%llu,\"host_t0\":%lld}\n",
               issued, kernel_us, blocks, depth, duty, wall, ran, event, span, gap_total, preempted, gpu_t0, host_t0);
  std::fclose(out);
  std::printf("%s: %zu kernels, ran %.1f%% of wall, event sum %.1f%%, preempted %zu\n", out_path, issued,
              100 * ran / wall, 100 * event / wall, preempted);
  return 0;
}

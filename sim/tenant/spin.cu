// The workload kernel of vgpu-tenant: every block holds its SM slot for a given time of actually running.
//
// The program does not compile this file. It embeds spin.ptx, the PTX that this
// file compiles to, because that text is what both a real driver and fakecuda
// load (fakecuda recognises `vgpu_spin` by name and models its run time). After
// changing this file, regenerate and check the PTX from this folder with
//   ./regenerate-ptx.sh
// which runs
//   nvcc -ptx -arch=compute_75 spin.cu -o spin.ptx
//   ptxas -arch=sm_75 spin.ptx -o /dev/null && ptxas -arch=sm_90 spin.ptx -o /dev/null
// compute_75 so that the same PTX is JIT-compiled on a T4 (sm_75), an A100
// (sm_80) and an H100 (sm_90).

// Nanoseconds of the GPU-wide wall clock. %globaltimer rather than clock64():
// clock64 counts SM cycles, whose rate changes with the clock boost, while the
// tenant asks for microseconds of wall time.
__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long now_ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now_ns));
  return now_ns;
}

// A gap between two consecutive clock reads longer than this means the block
// was not running: the GPU switched to another process's context (time
// slicing). A running loop reads the clock every few tens of nanoseconds, and
// the clock itself steps by at most a microsecond on any GPU; a time slice
// lasts a millisecond or more.
constexpr unsigned long long kSwitchedOutGapNs = 10000;

// Every block runs for ns_per_block nanoseconds of the time it actually holds
// its SM, not of wall time: gaps while switched out are not counted. So a
// kernel costs the same GPU time whether or not other processes time-slice
// with it, as fakecuda models it. (Counting wall time, two time-sliced tenants
// with 20 ms kernels each finished at full speed on an H100: both read ~99 %.)
//
// Only thread 0 of a block reads the clock and spins; the other threads wait
// at the barrier. A waiting warp issues no instructions, so the block occupies
// its SM slot (what the tenant models: occupancy for a given time) without
// taking issue cycles from other work on the same SM, and one reader means the
// block ends exactly when its one clock says so.
__device__ __forceinline__ void spin_block(unsigned long long ns_per_block) {
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
    unsigned long long ran_ns = 0;
    unsigned long long previous_ns = globaltimer_ns();
    while (ran_ns < ns_per_block) {
      const unsigned long long now_ns = globaltimer_ns();
      const unsigned long long step_ns = now_ns - previous_ns;
      if (step_ns < kSwitchedOutGapNs) {
        ran_ns += step_ns;
      }
      previous_ns = now_ns;
    }
  }
  __syncthreads();
}

extern "C" __global__ void vgpu_spin(unsigned long long ns_per_block) { spin_block(ns_per_block); }

// A collective kernel, as NCCL's: on fakecuda it cannot do its work until the kernels of the same `group` and
// round have started on the group's other `size` - 1 devices (it holds its device meanwhile), then runs
// ns_per_block like vgpu_spin. On a real GPU nothing here waits for peers: it is vgpu_spin with two more
// arguments, so a scenario that uses it runs everywhere (the wait is modelled on fakecuda only).
extern "C" __global__ void vgpu_collective(unsigned long long ns_per_block, unsigned long long group,
                                           unsigned long long size) {
  (void)group;
  (void)size;
  spin_block(ns_per_block);
}

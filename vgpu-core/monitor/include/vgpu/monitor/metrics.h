// vgpu-monitor's metrics in Prometheus' text format (docs/metrics.md), pure: one period's figures in, the exposition
// text out. No sockets (metrics_server.h), no files (hami_cache.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "vgpu/monitor/hami_cache.h"
#include "vgpu/monitor/monitor.h"
#include "vgpu/monitor/region_counters.h"

namespace vgpu::monitor {

// One device NVML answered for this period.
struct DeviceFigures {
  std::uint32_t index = 0;  // NVML's
  std::string uuid;
  std::uint64_t memory_used_bytes = 0;
  std::uint64_t memory_total_bytes = 0;
  std::optional<std::uint32_t> utilization_percent;  // nvmlDeviceGetUtilizationRates' gpu; none: NVML failed
};

// A container's cache file this period (only for containers with a VGPU_CACHE, with --hami-metrics).
struct CacheFigures {
  std::size_t container = 0;  // index into PeriodFigures::containers
  CacheState state = CacheState::absent;
  HamiCache cache;  // when state is `read`
};

// A container's region counters, read this period from its cache file (only for containers with a VGPU_CACHE whose
// file was read as a region of this build's layout).
struct CounterFigures {
  std::size_t container = 0;            // index into PeriodFigures::containers
  std::vector<RegionCounters> devices;  // matched to the judged devices by UUID
};

struct PeriodFigures {
  std::vector<Container> containers;
  std::vector<Judgement> judgements;  // Judge's, for `containers`
  std::vector<DeviceFigures> devices;
  bool hami = false;  // --hami-metrics: the hami_* series and vgpu_container_hami_cache_valid
  std::vector<CacheFigures> caches;
  std::vector<CounterFigures> counters;  // vgpu_container_throttled_seconds_total, _refused_allocations_total
  std::uint64_t periods = 0;             // periods judged so far, this one included
  std::uint64_t stamp_ns = 0;            // CLOCK_REALTIME at the end of the period
};

// The exposition text (Prometheus text format 0.0.4) of one period: families in a fixed order, each with its HELP and
// TYPE and all its samples together; a family without samples is left out.
std::string FormatMetrics(const PeriodFigures& figures);

// A label value as the text format needs it: \ " and newline escaped, any byte outside printable ASCII made '?'.
std::string EscapeLabelValue(std::string_view value);

}  // namespace vgpu::monitor

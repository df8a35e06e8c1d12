// Hand-written JSON for vgpu-tenant's result line: one flat object of numbers and short strings.
#include "result_line.h"

#include <cmath>

#include "vgpu/base/json_line.h"

namespace vgpu::tenant {

std::string FormatResultLine(const ResultLine& result) {
  const bool elapsed = result.elapsed_s > 0 && std::isfinite(result.elapsed_s);
  const double kernels = static_cast<double>(result.kernels);
  const double kernels_per_s = elapsed ? kernels / result.elapsed_s : 0;
  const double busy_s = result.busy_from_busy_ns ? static_cast<double>(result.busy_ns) * 1e-9
                                                 : kernels * static_cast<double>(result.kernel_us) * 1e-6;
  const double busy_fraction = elapsed ? busy_s / result.elapsed_s : 0;

  std::string line;
  base::JsonLine json(line);
  json.Begin()
      .Signed("pid", result.pid)
      .Signed("device", result.device)
      .Number("kernels", result.kernels)
      .Number("kernel_us", result.kernel_us)
      .Number("blocks", result.blocks)
      .Decimal("elapsed_s", result.elapsed_s)
      .Decimal("kernels_per_s", kernels_per_s)
      .Decimal("busy_fraction", busy_fraction)
      .Number("busy_ns", result.busy_ns)
      .Number("alloc_bytes", result.alloc_bytes);
  if (result.error.empty()) {
    json.Text("status", "ok");
  } else {
    json.Text("status", result.out_of_memory ? "oom" : "error").Text("error", result.error).Text("call", result.call);
  }
  json.Close();
  return line;
}

}  // namespace vgpu::tenant

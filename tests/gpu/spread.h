// The spread of a sample, for the GPU probes (launch_ab.cc, gated_pair_probe.cu): p10, median and p90.
#pragma once
#include <algorithm>
#include <cstddef>
#include <vector>

struct Spread {
  double median, p10, p90;
};

inline Spread Of(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const auto at = [&](double q) {
    return values[static_cast<std::size_t>(q * static_cast<double>(values.size() - 1))];
  };
  return {at(0.5), at(0.1), at(0.9)};
}

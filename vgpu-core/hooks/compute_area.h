// What a container's region holds in each device's compute area (region::Device::compute; docs/region.md, layout
// version 4): the limiter's budget, shared by the container's processes; after it, used in the area of the
// container's first device only, time division's turn cell (the container's id and its one account); last, on
// every device, the turn its processes take there (policy::PackSiblingTurn; zero in a region made before it was
// added, which reads as nobody holding it).
#pragma once

#include <cstddef>

#include "vgpu/policy/limiter.h"
#include "vgpu/policy/time_division.h"
#include "vgpu/region/region.h"

namespace vgpu::hooks {

struct ComputeArea {
  policy::BudgetCell budget;
  policy::TurnCell turn;
  std::uint64_t sibling_turn;
};

static_assert(sizeof(ComputeArea) <= sizeof(region::Device::compute), "the compute area must fit the region");
static_assert(offsetof(ComputeArea, turn) == (sizeof(policy::BudgetCell) + 7) / 8 * 8,
              "layout version 4 puts the turn cell at the budget's size rounded up to 8 bytes");
static_assert(offsetof(ComputeArea, sibling_turn) == sizeof(region::Device::compute) - 8,
              "the sibling turn is the compute area's last 8 bytes");

inline ComputeArea& ComputeAreaOf(region::Attachment& region, int device) {
  return *static_cast<ComputeArea*>(region.ComputeArea(device));
}

}  // namespace vgpu::hooks

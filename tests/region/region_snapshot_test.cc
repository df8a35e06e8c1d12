// ReadSnapshot: the read-only monitoring view of a region. It counts only live processes' memory (a killed one's
// before anyone reaps it), changes nothing in the file, and refuses missing, truncated and foreign files with a
// message naming the path.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "region_test_support.h"
#include "vgpu/region/layout.h"
#include "vgpu/region/region.h"

namespace vgpu::region {
namespace {

using namespace std::chrono_literals;
using test::kNoLimit;
using test::kUuid;

constexpr std::uint8_t kOtherUuid[16] = {0x47, 0x50, 0x55, 0x2d, 0x76, 0x67, 0x70, 0x75,
                                         0x2d, 0x74, 0x65, 0x73, 0x74, 0x2d, 0x30, 0x32};

std::unique_ptr<Attachment> MustOpen(const std::string& path) {
  std::string error;
  std::unique_ptr<Attachment> attachment(Attachment::Open(path, error));
  EXPECT_NE(attachment, nullptr) << error;
  return attachment;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string SnapshotError(const std::string& path) {
  Snapshot snapshot;
  std::string error;
  EXPECT_FALSE(ReadSnapshot(path, snapshot, error)) << "accepted " << path;
  EXPECT_EQ(error.find('\n'), std::string::npos) << "not one line: " << error;
  EXPECT_NE(error.find(path), std::string::npos) << "the path is not named: " << error;
  return error;
}

TEST(RegionSnapshot, CountsTwoLiveSlotsAndNotADeadOneBeforeAnyReap) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  auto a = MustOpen(path);
  auto b = MustOpen(path);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const int device = a->DeviceIndex(kUuid);
  const int other = a->DeviceIndex(kOtherUuid);
  ASSERT_EQ(device, 0);
  ASSERT_EQ(other, 1);
  a->SetLimitForMonitoring(device, 4096);
  a->SetContextBytes(device, 512);
  ASSERT_TRUE(a->Reserve(device, 100, kNoLimit));
  ASSERT_TRUE(b->Reserve(device, 20, kNoLimit));
  ASSERT_TRUE(b->Reserve(other, 7, kNoLimit));
  // A third process reserves and dies without detaching (as a SIGKILLed tenant does); nobody reaps after it.
  const pid_t dead = test::Spawn([&] {
    std::string error;
    Attachment* c = Attachment::Open(path, error);
    CHILD_CHECK(c != nullptr, 10);
    CHILD_CHECK(c->Reserve(c->DeviceIndex(kUuid), 5000, kNoLimit), 11);
    _exit(0);  // never detaches: the slot stays live in the table
    return 0;
  });
  ASSERT_EQ(test::WaitExit(dead, 10s), 0);
  ASSERT_EQ(a->Used(device), 5120u) << "the dead slot is still counted in the cache: nobody reaped it";
  const std::string before = ReadAll(path);

  Snapshot snapshot;
  std::string error;
  ASSERT_TRUE(ReadSnapshot(path, snapshot, error)) << error;
  EXPECT_EQ(snapshot.version, kRegionVersion);
  ASSERT_EQ(snapshot.devices.size(), 2u);
  EXPECT_EQ(std::memcmp(snapshot.devices[0].uuid, kUuid, 16), 0);
  EXPECT_EQ(std::memcmp(snapshot.devices[1].uuid, kOtherUuid, 16), 0);
  EXPECT_EQ(snapshot.devices[0].used_bytes, 120u) << "the dead process's 5000 bytes must not count";
  EXPECT_EQ(snapshot.devices[0].cached_used_bytes, 5120u) << "the cache counts the dead slot until it is reaped";
  EXPECT_EQ(snapshot.devices[1].cached_used_bytes, 7u);
  EXPECT_EQ(snapshot.lock_repairs, 0u) << "nobody died holding the lock";
  EXPECT_EQ(snapshot.lock_holder_tid, 0) << "nobody holds the lock";
  EXPECT_EQ(snapshot.devices[1].used_bytes, 7u);
  EXPECT_EQ(snapshot.devices[0].limit_bytes, 4096u);
  EXPECT_EQ(snapshot.devices[0].context_bytes, 512u);
  EXPECT_EQ(snapshot.devices[0].compute.size(), sizeof(Device::compute));
  ASSERT_EQ(snapshot.live.size(), 2u);
  for (const SlotSnapshot& slot : snapshot.live) {
    EXPECT_EQ(slot.pid, getpid());
    EXPECT_NE(slot.pid, dead);
    ASSERT_EQ(slot.used_bytes.size(), 2u);
  }
  EXPECT_EQ(snapshot.live[0].used_bytes[0] + snapshot.live[1].used_bytes[0], 120u);
  EXPECT_NE(snapshot.live[0].generation, snapshot.live[1].generation);
  EXPECT_EQ(ReadAll(path), before) << "a snapshot must change nothing (no reap, no slot, no lock)";
  EXPECT_EQ(test::LiveSlots(a->region()), 3) << "the dead slot is left for the reaper";
}

TEST(RegionSnapshot, MonitoringCountersAddUpAcrossAttachmentsAndOutliveThem) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  auto a = MustOpen(path);
  auto b = MustOpen(path);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const int device = a->DeviceIndex(kUuid);
  const int other = b->DeviceIndex(kOtherUuid);
  ASSERT_EQ(device, 0);
  ASSERT_EQ(other, 1);
  // Two threads on each attachment at once: the adds are atomic, none is lost.
  constexpr int kAdds = 200'000;
  std::vector<std::thread> threads;
  for (Attachment* attachment : {a.get(), a.get(), b.get(), b.get()}) {
    threads.emplace_back([attachment, device] {
      for (int i = 0; i < kAdds; ++i) {
        attachment->AddHeldNs(device, 3);
        attachment->CountRefusedAllocation(device);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  b->AddHeldNs(other, 5);
  a->AddHeldNs(-1, 1000);  // bad indexes: nothing, no crash
  a->CountRefusedAllocation(static_cast<int>(kMaxDevices));
  // Another process of the container adds too, and ends.
  const pid_t child = test::Spawn([&] {
    std::string error;
    Attachment* c = Attachment::Open(path, error);
    CHILD_CHECK(c != nullptr, 10);
    c->AddHeldNs(c->DeviceIndex(kUuid), 1'000'000'000);
    c->CountRefusedAllocation(c->DeviceIndex(kUuid));
    _exit(0);
    return 0;
  });
  ASSERT_EQ(test::WaitExit(child, 10s), 0);

  Snapshot first;
  std::string error;
  ASSERT_TRUE(ReadSnapshot(path, first, error)) << error;
  ASSERT_EQ(first.devices.size(), 2u);
  EXPECT_EQ(first.devices[0].held_ns, 4u * kAdds * 3 + 1'000'000'000u);
  EXPECT_EQ(first.devices[0].refused_allocations, 4u * kAdds + 1);
  EXPECT_EQ(first.devices[1].held_ns, 5u);
  EXPECT_EQ(first.devices[1].refused_allocations, 0u);
  // Reads change nothing, and the counters belong to the container's file, not to a process: neither the reap of the
  // dead child nor both attachments detaching takes anything back.
  EXPECT_EQ(a->ReapDead(true), 1u);
  a.reset();
  b.reset();
  Snapshot second;
  ASSERT_TRUE(ReadSnapshot(path, second, error)) << error;
  ASSERT_EQ(second.devices.size(), 2u);
  EXPECT_EQ(second.devices[0].held_ns, first.devices[0].held_ns);
  EXPECT_EQ(second.devices[0].refused_allocations, first.devices[0].refused_allocations);
  EXPECT_EQ(second.devices[1].held_ns, 5u);
  auto again = MustOpen(path);
  ASSERT_NE(again, nullptr);
  again->AddHeldNs(again->DeviceIndex(kOtherUuid), 10);
  ASSERT_TRUE(ReadSnapshot(path, second, error)) << error;
  EXPECT_EQ(second.devices[1].held_ns, 15u) << "a later process adds to what the container's file holds";
}

TEST(RegionSnapshot, ACopyOfTheComputeCellIsRaw) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  auto a = MustOpen(path);
  const int device = a->DeviceIndex(kUuid);
  auto* cell = static_cast<std::uint8_t*>(a->ComputeArea(device));
  ASSERT_NE(cell, nullptr);
  for (std::size_t i = 0; i < sizeof(Device::compute); ++i) cell[i] = static_cast<std::uint8_t>(i * 7);
  Snapshot snapshot;
  std::string error;
  ASSERT_TRUE(ReadSnapshot(path, snapshot, error)) << error;
  ASSERT_EQ(snapshot.devices.size(), 1u);
  ASSERT_EQ(snapshot.devices[0].compute.size(), sizeof(Device::compute));
  EXPECT_EQ(std::memcmp(snapshot.devices[0].compute.data(), cell, sizeof(Device::compute)), 0);
}

TEST(RegionSnapshot, AnEmptyRegionHasNoDeviceAndNoLiveSlot) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  MustOpen(path).reset();  // created, then detached: a valid region nobody uses
  Snapshot snapshot;
  std::string error;
  ASSERT_TRUE(ReadSnapshot(path, snapshot, error)) << error;
  EXPECT_TRUE(snapshot.devices.empty());
  EXPECT_TRUE(snapshot.live.empty());
}

// A killed tenant is the runner's child: until the runner waits for it, it is a zombie that kill(pid, 0) still
// finds. Its liveness byte went with its descriptors, and that is what the snapshot asks.
TEST(RegionSnapshot, AZombieHoldsNothing) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  auto a = MustOpen(path);
  ASSERT_TRUE(a->Reserve(a->DeviceIndex(kUuid), 30, kNoLimit));
  const pid_t zombie = test::Spawn([&] {
    std::string error;
    Attachment* c = Attachment::Open(path, error);
    CHILD_CHECK(c != nullptr, 10);
    CHILD_CHECK(c->Reserve(c->DeviceIndex(kUuid), 900, kNoLimit), 11);
    _exit(0);
    return 0;
  });
  ASSERT_GT(zombie, 0);
  siginfo_t info{};
  ASSERT_EQ(waitid(P_PID, static_cast<id_t>(zombie), &info, WEXITED | WNOWAIT), 0);  // exited, not reaped
  ASSERT_EQ(kill(zombie, 0), 0) << "a zombie is still found by kill(pid, 0)";
  Snapshot snapshot;
  std::string error;
  const bool read = ReadSnapshot(path, snapshot, error);
  EXPECT_EQ(test::WaitExit(zombie, 10s), 0);
  ASSERT_TRUE(read) << error;
  ASSERT_EQ(snapshot.devices.size(), 1u);
  EXPECT_EQ(snapshot.devices[0].used_bytes, 30u);
  EXPECT_EQ(snapshot.live.size(), 1u);
}

// A monitor may have read access only. As root that needs another user: a child drops to nobody first.
TEST(RegionSnapshot, NeedsOnlyReadAccess) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  auto a = MustOpen(path);
  ASSERT_TRUE(a->Reserve(a->DeviceIndex(kUuid), 64, kNoLimit));
  ASSERT_EQ(chmod(path.c_str(), 0444), 0);
  ASSERT_EQ(chmod(folder.path().c_str(), 0755), 0);
  const pid_t reader = test::Spawn([&] {
    if (geteuid() == 0) {
      CHILD_CHECK(setgid(65534) == 0 && setuid(65534) == 0, 10);
    }
    CHILD_CHECK(open(path.c_str(), O_RDWR) < 0, 11);  // the premise: no write access
    Snapshot snapshot;
    std::string error;
    if (!ReadSnapshot(path, snapshot, error)) {
      std::fprintf(stderr, "child: %s\n", error.c_str());
      return 12;
    }
    CHILD_CHECK(snapshot.devices.size() == 1, 13);
    CHILD_CHECK(snapshot.devices[0].used_bytes == 64, 14);
    return 0;
  });
  EXPECT_EQ(test::WaitExit(reader, 10s), 0);
}

TEST(RegionSnapshot, RefusesAMissingFile) {
  test::TempFolder folder;
  const std::string error = SnapshotError(folder.File("no-such-region"));
  EXPECT_NE(error.find("No such file"), std::string::npos) << error;
}

TEST(RegionSnapshot, RefusesATruncatedFile) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  MustOpen(path).reset();
  ASSERT_EQ(truncate(path.c_str(), kFileBytes - sizeof(Region) / 2), 0);
  const std::string error = SnapshotError(path);
  EXPECT_NE(error.find("truncated (" + std::to_string(kFileBytes - sizeof(Region) / 2) + " bytes"), std::string::npos)
      << error;
  EXPECT_EQ(std::filesystem::file_size(path), kFileBytes - sizeof(Region) / 2) << "a reader never re-grows a file";
}

TEST(RegionSnapshot, RefusesAnotherLayoutVersionNamingBoth) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  MustOpen(path).reset();
  const std::uint32_t other = kRegionVersion + 1;
  const int fd = open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(pwrite(fd, &other, sizeof other, kRegionOffset + offsetof(Region, version)),
            static_cast<ssize_t>(sizeof other));
  close(fd);
  const std::string error = SnapshotError(path);
  EXPECT_NE(error.find("layout version " + std::to_string(other)), std::string::npos) << error;
  EXPECT_NE(error.find("reads version " + std::to_string(kRegionVersion)), std::string::npos) << error;
}

TEST(RegionSnapshot, RefusesAFileThatIsNotARegion) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  {
    std::ofstream out(path, std::ios::binary);
    out << std::string(sizeof(Region), 'x');
  }
  const std::string error = SnapshotError(path);
  EXPECT_NE(error.find("not a vgpu region"), std::string::npos) << error;
}

// A FIFO at the path (anyone who can write the folder can plant one) is refused at once: opened for reading without
// O_NONBLOCK it would wait for a writer forever, and the monitor with it (found by tests/fuzz/fuzz_region).
TEST(RegionSnapshot, RefusesAFifoWithoutWaitingForAWriter) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  ASSERT_EQ(mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  const pid_t reader = test::Spawn([&] {
    Snapshot snapshot;
    std::string error;
    if (ReadSnapshot(path, snapshot, error)) return 1;
    return error.find("not a regular file") != std::string::npos ? 0 : 2;
  });
  EXPECT_EQ(test::WaitExit(reader, 10s), 0) << "-1: ReadSnapshot waited on the FIFO";
}

}  // namespace
}  // namespace vgpu::region

// Region tests within one process or a few short children: creation, validation of bad files, the limit
// arithmetic (exact limit, never wrapping), peaks, devices, reaping and its rate limit, a full slot table.
#include <fcntl.h>
#include <signal.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "region_test_support.h"
#include "vgpu/region/hami_v1.h"
#include "vgpu/region/layout.h"
#include "vgpu/region/region.h"

namespace vgpu::region {
namespace {

using namespace std::chrono_literals;
using test::kNoLimit;
using test::kUuid;

std::unique_ptr<Attachment> MustOpen(const std::string& path) {
  std::string error;
  std::unique_ptr<Attachment> attachment(Attachment::Open(path, error));
  EXPECT_NE(attachment, nullptr) << error;
  return attachment;
}

std::string OpenError(const std::string& path) {
  std::string error;
  std::unique_ptr<Attachment> attachment(Attachment::Open(path, error));
  EXPECT_EQ(attachment, nullptr) << "accepted " << path;
  EXPECT_EQ(error.find('\n'), std::string::npos) << "not one line: " << error;
  return error;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Overwrites `bytes` at `offset` of a file (to forge a bad region).
void Patch(const std::string& path, off_t offset, const void* bytes, std::size_t size) {
  const int fd = open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(pwrite(fd, bytes, size, offset), static_cast<ssize_t>(size));
  close(fd);
}

// A valid region at `path` with no process attached.
void MakeRegion(const std::string& path) { ASSERT_NE(MustOpen(path), nullptr); }

// ---- creation --------------------------------------------------------------------------------------------

TEST(RegionOpen, CreatesACompleteRegionReadableByEveryUser) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  auto attachment = MustOpen(path);
  ASSERT_NE(attachment, nullptr);
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(static_cast<std::size_t>(st.st_size), kFileBytes);
  EXPECT_EQ(st.st_mode & 0777, 0666u) << "the mode must not depend on the umask";
  const Region& region = attachment->region();
  EXPECT_EQ(region.magic, kRegionMagic);
  EXPECT_EQ(region.version, kRegionVersion);
  EXPECT_EQ(region.region_bytes, sizeof(Region));
  EXPECT_GT(region.created_ns, 0u);
  EXPECT_GE(attachment->slot(), 0);
  EXPECT_EQ(region.slots[attachment->slot()].state, SlotState::live);
  EXPECT_EQ(region.slots[attachment->slot()].pid, getpid());
  EXPECT_EQ(attachment->path(), path);
  EXPECT_FALSE(test::AnyTemporaryLeft(folder.path()));
}

TEST(RegionOpen, EmptyPathMeansTheDefaultPerUserFile) {
  std::string error;
  std::unique_ptr<Attachment> attachment(Attachment::Open("", error));
  if (attachment == nullptr && error.find("version") != std::string::npos) {
    // A default file left by an older build (another layout version) is refused, rightly; this machine's test
    // run may replace it.
    unlink(("/tmp/vgpu/region." + std::to_string(getuid())).c_str());
    attachment.reset(Attachment::Open("", error));
  }
  ASSERT_NE(attachment, nullptr) << error;
  EXPECT_EQ(attachment->path(), "/tmp/vgpu/region." + std::to_string(getuid()));
  struct stat st {};
  ASSERT_EQ(lstat("/tmp/vgpu", &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  // Others may share the default file: look only at this process's own usage.
  const int device = attachment->DeviceIndex(kUuid);
  ASSERT_GE(device, 0);
  EXPECT_TRUE(attachment->Reserve(device, 7, kNoLimit));
  EXPECT_EQ(attachment->OwnUsed(device), 7u);
  attachment->Release(device, 7);
  EXPECT_EQ(attachment->OwnUsed(device), 0u);
}

TEST(RegionOpen, TwoAttachmentsShareOneRegionAndHaveTheirOwnSlots) {
  test::TempFolder folder;
  auto a = MustOpen(folder.File("region"));
  auto b = MustOpen(folder.File("region"));
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_NE(a->slot(), b->slot());
  ASSERT_TRUE(a->Reserve(0, 100, kNoLimit));
  EXPECT_EQ(b->Used(0), 100u);
  EXPECT_EQ(b->OwnUsed(0), 0u);
}

TEST(RegionOpen, DetachingGivesBackUsageAndFreesTheSlot) {
  test::TempFolder folder;
  auto survivor = MustOpen(folder.File("region"));
  auto leaver = MustOpen(folder.File("region"));
  ASSERT_TRUE(leaver->Reserve(0, 300, kNoLimit));
  const int leaver_slot = leaver->slot();
  leaver.reset();
  EXPECT_EQ(survivor->Used(0), 0u);
  EXPECT_EQ(survivor->region().slots[leaver_slot].state, SlotState::free);
  // The byte was let go with the slot: the next claimant takes it without finding it held.
  auto next = MustOpen(folder.File("region"));
  EXPECT_EQ(next->slot(), leaver_slot);
  EXPECT_EQ(next->region().slots[leaver_slot].pid, getpid());
}

// ---- files that are not ours -----------------------------------------------------------------------------

TEST(RegionOpen, RefusesAFileWithAnotherMagicAndLeavesItAlone) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  {
    std::ofstream out(path, std::ios::binary);
    std::string junk(sizeof(Region), '\0');
    std::memcpy(junk.data(), "NOTVGPU!", 8);
    out << junk;
  }
  const std::string before = ReadAll(path);
  const std::string error = OpenError(path);
  EXPECT_NE(error.find(path), std::string::npos) << error;
  EXPECT_NE(error.find("not a vgpu region"), std::string::npos) << error;
  EXPECT_NE(error.find("VGPUREGN"), std::string::npos) << error;
  EXPECT_NE(error.find("CUDA_DEVICE_MEMORY_SHARED_CACHE"), std::string::npos) << error;
  EXPECT_NE(error.find("never replaced: it is no cache file, and may be someone's data"), std::string::npos) << error;
  EXPECT_EQ(ReadAll(path), before) << "a foreign file must never be repaired";
}

// HAMi-core's part of the file, read at HAMi's offsets written out here (../shared/HAMI-CONTRACT.md), not through
// our hami_v1.h: what HAMi's vGPU monitor would find (docs/hami-cache.md).
template <typename T>
T At(const std::string& bytes, std::size_t offset) {
  T value{};
  std::memcpy(&value, bytes.data() + offset, sizeof value);
  return value;
}
constexpr std::size_t kProcs = 1856, kProcBytes = 1960, kProcStatus = 1928, kUsedTotal = 8 + 32;

TEST(RegionHami, TheFileBeginsWithHamiCoresPartFilledAsItsMonitorReadsIt) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  auto attachment = MustOpen(path);
  ASSERT_NE(attachment, nullptr);
  const int device = attachment->DeviceIndex(kUuid);
  ASSERT_EQ(device, 0);
  attachment->SetLimitForMonitoring(device, 4ull << 30);
  ASSERT_TRUE(attachment->Reserve(device, 3ull << 20, kNoLimit));
  const std::size_t slot = static_cast<std::size_t>(attachment->slot());
  const std::size_t proc = kProcs + slot * kProcBytes;
  std::string bytes = ReadAll(path);
  ASSERT_GE(bytes.size(), 2'008'952u) << "HAMi's monitor refuses a v1 file shorter than this";
  EXPECT_EQ(At<std::int32_t>(bytes, 0), 19920718) << "HAMi-core's magic";
  EXPECT_EQ(At<std::uint32_t>(bytes, 4), 1u) << "major version";
  EXPECT_EQ(At<std::uint64_t>(bytes, 56), 1u) << "device count";
  const std::string uuid(bytes.data() + 64, 40);
  EXPECT_EQ(uuid.substr(0, 4), "GPU-") << uuid;
  EXPECT_EQ(uuid[12], '-') << uuid;
  EXPECT_EQ(bytes[64 + 40], '\0');
  EXPECT_EQ(At<std::uint64_t>(bytes, 1600), 4ull << 30) << "limit[0]";
  EXPECT_GE(At<std::int32_t>(bytes, 2'008'896), static_cast<std::int32_t>(slot) + 1) << "proc_num";
  EXPECT_EQ(At<std::int32_t>(bytes, proc), getpid()) << "the slot's pid";
  EXPECT_NE(At<std::int32_t>(bytes, proc + kProcStatus), 0) << "a live slot's status";
  EXPECT_EQ(At<std::uint64_t>(bytes, proc + kUsedTotal), 3ull << 20) << "used[0].total";
  attachment->Release(device, 1ull << 20);
  bytes = ReadAll(path);
  EXPECT_EQ(At<std::uint64_t>(bytes, proc + kUsedTotal), 2ull << 20) << "used[0].total after a release";

  // A process that dies without detaching: counted until it is reaped, then its slot's status goes to 0.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::string error;
    Attachment* mine = Attachment::Open(path, error);
    const int d = mine != nullptr ? mine->DeviceIndex(kUuid) : -1;
    _exit(d == 0 && mine->Reserve(d, 5ull << 20, kNoLimit) ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  bytes = ReadAll(path);
  std::size_t dead = 0;
  for (std::size_t s = 0; s < 1024; ++s) {
    if (At<std::int32_t>(bytes, kProcs + s * kProcBytes) == child) dead = kProcs + s * kProcBytes;
  }
  ASSERT_NE(dead, 0u) << "the child's slot in HAMi's part";
  EXPECT_EQ(At<std::uint64_t>(bytes, dead + kUsedTotal), 5ull << 20);
  EXPECT_EQ(attachment->ReapDead(true), 1u);
  bytes = ReadAll(path);
  EXPECT_EQ(At<std::int32_t>(bytes, dead + kProcStatus), 0) << "a reaped slot still counts for HAMi's monitor";
  EXPECT_EQ(At<std::uint64_t>(bytes, dead + kUsedTotal), 0u);
  attachment.reset();
  bytes = ReadAll(path);
  EXPECT_EQ(At<std::int32_t>(bytes, proc + kProcStatus), 0) << "a detached slot still counts for HAMi's monitor";
}

// ---- files of another layout, replaced once unused (docs/hami-cache.md, "Bad input") ------------------------

// Opens `path`, expecting whatever was there to be replaced by a fresh region: returns the note saying what was.
std::string OpenReplacing(const std::string& path) {
  std::string error, note;
  std::unique_ptr<Attachment> attachment(Attachment::Open(path, error, &note));
  EXPECT_NE(attachment, nullptr) << error;
  EXPECT_EQ(std::filesystem::file_size(path), kFileBytes);
  if (attachment != nullptr) {
    EXPECT_EQ(attachment->region().version, kRegionVersion);
  }
  EXPECT_NE(note.find(path), std::string::npos) << note;
  return note;
}

// HAMi-core's own cache file (v1.2), one counted slot naming `pid`.
void WriteHamiCoreFile(const std::string& path, std::int32_t pid) {
  std::string file(sizeof(hami::SharedRegion), '\0');
  const auto put = [&](std::size_t offset, auto value) { std::memcpy(file.data() + offset, &value, sizeof value); };
  put(offsetof(hami::SharedRegion, initialized_flag), hami::kMagic);
  put(offsetof(hami::SharedRegion, major_version), hami::kMajorVersion);
  put(offsetof(hami::SharedRegion, minor_version), hami::kMinorVersion);
  put(offsetof(hami::SharedRegion, proc_num), std::int32_t{1});
  put(offsetof(hami::SharedRegion, procs) + offsetof(hami::ProcSlot, pid), pid);
  put(offsetof(hami::SharedRegion, procs) + offsetof(hami::ProcSlot, status), std::int32_t{1});
  std::ofstream(path, std::ios::binary) << file;
}

// A child that lives until killed, and one that has ended (its pid names nobody).
pid_t LivingChild() {
  const pid_t child = fork();
  if (child == 0) {
    pause();
    _exit(0);
  }
  return child;
}
pid_t EndedChild() {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);
  return child;
}

TEST(RegionOpen, KeepsHamiCoresOwnCacheFileWhileAProcessItNamesLivesNamingIt) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  const pid_t living = LivingChild();
  WriteHamiCoreFile(path, living);
  const std::string before = ReadAll(path);
  const std::string error = OpenError(path);
  kill(living, SIGKILL);
  waitpid(living, nullptr, 0);
  EXPECT_NE(error.find(path), std::string::npos) << error;
  EXPECT_NE(error.find("a HAMi-core cache file (v1.2, 2008952 bytes), not libvgpu's"), std::string::npos) << error;
  EXPECT_NE(error.find("not replaced: process " + std::to_string(living) + " named in it lives"), std::string::npos)
      << error;
  EXPECT_EQ(ReadAll(path), before);
}

TEST(RegionOpen, ReplacesHamiCoresOwnCacheFileOnceNoProcessItNamesLives) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  WriteHamiCoreFile(path, EndedChild());
  EXPECT_NE(OpenReplacing(path).find("replaced a HAMi-core cache file (2008952 bytes) that no process used"),
            std::string::npos);
}

// A region of layout version 4: ours at offset 0, its liveness bytes at region_bytes + slot.
void WriteVersion4Region(const std::string& path, std::uint32_t region_bytes) {
  std::string file(region_bytes, '\0');
  const std::uint32_t version = 4;
  std::memcpy(file.data(), "VGPUREGN", 8);
  std::memcpy(file.data() + 8, &version, 4);
  std::memcpy(file.data() + 12, &region_bytes, 4);
  std::ofstream(path, std::ios::binary) << file;
}

TEST(RegionOpen, ReplacesAnOlderRegionOnlyOnceNoProcessOfItsVersionHoldsItsLivenessLock) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  const std::uint32_t region_bytes = 1'000'000;
  WriteVersion4Region(path, region_bytes);
  const std::string before = ReadAll(path);
  const int holder = open(path.c_str(), O_RDWR);  // a version-4 process in slot 5
  ASSERT_GE(holder, 0);
  struct flock lock {};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  lock.l_start = region_bytes + 5;
  lock.l_len = 1;
  ASSERT_EQ(fcntl(holder, F_OFD_SETLK, &lock), 0);
  const std::string error = OpenError(path);
  EXPECT_NE(error.find("an older vgpu region (layout version 4)"), std::string::npos) << error;
  EXPECT_NE(error.find("reads version " + std::to_string(kRegionVersion)), std::string::npos) << error;
  EXPECT_NE(error.find("a process of that version holds one of its liveness locks"), std::string::npos) << error;
  EXPECT_EQ(ReadAll(path), before);
  close(holder);  // the version-4 process ends
  EXPECT_NE(OpenReplacing(path).find("replaced a vgpu region of layout version 4"), std::string::npos);
}

TEST(RegionOpen, RefusesAnotherLayoutVersionNamingBoth) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  MakeRegion(path);
  const std::uint32_t other = kRegionVersion + 1;
  Patch(path, kRegionOffset + offsetof(Region, version), &other, sizeof other);
  const std::string error = OpenError(path);
  EXPECT_NE(error.find(path), std::string::npos) << error;
  EXPECT_NE(error.find("layout version " + std::to_string(other)), std::string::npos) << error;
  EXPECT_NE(error.find("reads version " + std::to_string(kRegionVersion)), std::string::npos) << error;
  EXPECT_NE(error.find("never replaced: a newer libvgpu may be using it"), std::string::npos) << error;
}

TEST(RegionOpen, KeepsARegionOfAnotherDeclaredSizeWhileInUseThenReplacesIt) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  std::unique_ptr<Attachment> user = MustOpen(path);
  const std::uint32_t other = sizeof(Region) - 64;
  Patch(path, kRegionOffset + offsetof(Region, region_bytes), &other, sizeof other);
  const std::string error = OpenError(path);
  EXPECT_NE(error.find("declares " + std::to_string(other) + " bytes"), std::string::npos) << error;
  EXPECT_NE(error.find(std::to_string(sizeof(Region))), std::string::npos) << error;
  EXPECT_NE(error.find("not replaced: a process holds one of its liveness locks (it is in use)"), std::string::npos)
      << error;
  user.reset();
  EXPECT_NE(OpenReplacing(path).find("a vgpu region cut short or of another size"), std::string::npos);
}

TEST(RegionOpen, ReplacesATruncatedRegionNobodyUses) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  MakeRegion(path);
  ASSERT_EQ(truncate(path.c_str(), kFileBytes - sizeof(Region) / 2), 0);
  EXPECT_NE(OpenReplacing(path).find("a vgpu region cut short or of another size (" +
                                     std::to_string(kFileBytes - sizeof(Region) / 2) + " bytes)"),
            std::string::npos);
}

TEST(RegionOpen, ReplacesAnEmptyFile) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  { std::ofstream out(path); }
  EXPECT_NE(OpenReplacing(path).find("replaced an empty file"), std::string::npos);
}

TEST(RegionOpen, NeverReplacesThroughASymbolicLink) {
  test::TempFolder folder;
  const std::string target = folder.File("hami.cache"), path = folder.File("region");
  WriteHamiCoreFile(target, EndedChild());
  ASSERT_EQ(symlink(target.c_str(), path.c_str()), 0);
  const std::string before = ReadAll(target);
  const std::string error = OpenError(path);
  EXPECT_NE(error.find("never replaced: the path is not a regular file of its own"), std::string::npos) << error;
  EXPECT_EQ(ReadAll(target), before);
  EXPECT_TRUE(std::filesystem::is_symlink(path));
}

TEST(RegionOpen, RefusesAFolderAndAMissingFolder) {
  test::TempFolder folder;
  ASSERT_EQ(mkdir(folder.File("a-folder").c_str(), 0700), 0);
  std::string error = OpenError(folder.File("a-folder"));
  EXPECT_NE(error.find("a-folder"), std::string::npos) << error;
  error = OpenError(folder.File("missing/region"));
  EXPECT_NE(error.find("missing/region"), std::string::npos) << error;
  EXPECT_NE(error.find("No such file or directory"), std::string::npos) << error;
}

// ---- the limit -------------------------------------------------------------------------------------------

TEST(RegionReserve, UpToTheLimitExactlyAndNotOneByteMore) {
  test::TempFolder folder;
  auto a = MustOpen(folder.File("region"));
  auto b = MustOpen(folder.File("region"));
  const int device = a->DeviceIndex(kUuid);
  ASSERT_EQ(device, 0);
  EXPECT_TRUE(a->Reserve(device, 600, 1000));
  EXPECT_TRUE(b->Reserve(device, 400, 1000));
  EXPECT_EQ(a->Used(device), 1000u);
  EXPECT_FALSE(a->Reserve(device, 1, 1000));
  EXPECT_FALSE(b->Reserve(device, 1, 1000));
  EXPECT_EQ(a->Used(device), 1000u) << "a refusal changes nothing";
  EXPECT_EQ(a->OwnUsed(device), 600u);
  EXPECT_EQ(b->OwnUsed(device), 400u);
  a->Release(device, 1);
  EXPECT_TRUE(b->Reserve(device, 1, 1000));
  EXPECT_FALSE(a->Reserve(device, 1, 1000));
  EXPECT_EQ(a->Used(device), 1000u);
}

TEST(RegionReserve, NeverWrapsNearTwoToTheSixtyFour) {
  test::TempFolder folder;
  auto a = MustOpen(folder.File("region"));
  EXPECT_FALSE(a->Reserve(0, 11, 10)) << "a request larger than the limit";
  EXPECT_FALSE(a->Reserve(0, 1, 0)) << "limit 0 admits nothing";
  EXPECT_TRUE(a->Reserve(0, 0, 0)) << "zero bytes always fit";
  EXPECT_TRUE(a->Reserve(0, 10, kNoLimit));
  EXPECT_FALSE(a->Reserve(0, kNoLimit, kNoLimit)) << "10 + (2^64-1) must not wrap into a small number";
  EXPECT_FALSE(a->Reserve(0, kNoLimit - 9, kNoLimit));
  EXPECT_TRUE(a->Reserve(0, kNoLimit - 10, kNoLimit));
  EXPECT_EQ(a->Used(0), kNoLimit);
  a->Release(0, kNoLimit);
  EXPECT_EQ(a->Used(0), 0u);
}

TEST(RegionRelease, IsClampedToWhatThisProcessHolds) {
  test::TempFolder folder;
  auto a = MustOpen(folder.File("region"));
  auto b = MustOpen(folder.File("region"));
  ASSERT_TRUE(a->Reserve(0, 100, kNoLimit));
  ASSERT_TRUE(b->Reserve(0, 50, kNoLimit));
  b->Release(0, 80);  // more than b holds: b goes to 0, a's 100 stay
  EXPECT_EQ(b->OwnUsed(0), 0u);
  EXPECT_EQ(a->Used(0), 100u);
  b->Release(0, 1);
  EXPECT_EQ(a->Used(0), 100u);
  a->Release(0, 1000);
  EXPECT_EQ(a->Used(0), 0u);
  EXPECT_EQ(a->OwnUsed(0), 0u);
}

TEST(RegionRelease, NeverWrapsWhenTheTotalWasScribbledLow) {
  test::TempFolder folder;
  auto a = MustOpen(folder.File("region"));
  ASSERT_TRUE(a->Reserve(0, 100, kNoLimit));
  // Anyone in the container can write the file: a total below the slots must not wrap to 16 EB on release.
  const_cast<Region&>(a->region()).devices[0].used_bytes = 10;
  a->Release(0, 100);
  EXPECT_EQ(a->Used(0), 0u);
}

// ---- a region file rewritten by a container process (docs/threat-model.md) ------------------------------------

// Zeroes what the file says `attachment`'s process and the container hold on device 0, as a process of the
// container that writes the region file could.
void ZeroUsage(const Attachment& attachment) {
  Region& region = const_cast<Region&>(attachment.region());
  region.devices[0].used_bytes = 0;
  region.slots[attachment.slot()].used_bytes[0] = 0;
}

TEST(RegionTamper, ARewrittenSlotIsPutBackWithTheTotalAtTheNextCall) {
  test::TempFolder folder;
  auto a = MustOpen(folder.File("region"));
  ASSERT_TRUE(a->Reserve(0, 100, kNoLimit));
  ZeroUsage(*a);
  ASSERT_TRUE(a->Reserve(0, 1, kNoLimit));
  EXPECT_EQ(a->OwnUsed(0), 101u);
  EXPECT_EQ(a->Used(0), 101u);
  EXPECT_EQ(a->TamperedCount(), 1u);
  ZeroUsage(*a);
  a->Release(0, 1);
  EXPECT_EQ(a->OwnUsed(0), 100u);
  EXPECT_EQ(a->Used(0), 100u);
  EXPECT_EQ(a->TamperedCount(), 2u);
}

TEST(RegionTamper, AProcessCannotPassTheLimitByRewritingTheFile) {
  test::TempFolder folder;
  auto a = MustOpen(folder.File("region"));
  ASSERT_TRUE(a->Reserve(0, 800, 1000));
  ZeroUsage(*a);
  EXPECT_FALSE(a->Reserve(0, 300, 1000));
  EXPECT_TRUE(a->Reserve(0, 200, 1000));
  EXPECT_EQ(a->OwnUsed(0), 1000u);
  EXPECT_EQ(a->Used(0), 1000u);
}

// Not held by the region (docs/threat-model.md): a process that rewrites the file between another process's calls
// lets a third reserve what the second holds, until the second's next call puts its figure back. The node monitor
// holds it (docs/node-monitor.md; tests/reliability/test_bypass.py::test_two_colluding_processes_do_not_raise_the_limit):
// disabled here, where there is no monitor, as the record of what the region alone cannot do.
TEST(RegionTamper, KnownGapTwoProcessesCannotPassTheLimitTogetherByRewritingTheFile) {
  test::TempFolder folder;
  auto a = MustOpen(folder.File("region"));
  auto b = MustOpen(folder.File("region"));
  ASSERT_TRUE(a->Reserve(0, 800, 1000));
  ZeroUsage(*a);
  EXPECT_FALSE(b->Reserve(0, 800, 1000));
}

TEST(RegionReserve, TracksThePeakOfOwnUsage) {
  test::TempFolder folder;
  auto a = MustOpen(folder.File("region"));
  ASSERT_TRUE(a->Reserve(2, 100, kNoLimit));
  ASSERT_TRUE(a->Reserve(2, 200, kNoLimit));
  a->Release(2, 250);
  ASSERT_TRUE(a->Reserve(2, 10, kNoLimit));
  const Slot& slot = a->region().slots[a->slot()];
  EXPECT_EQ(slot.peak_bytes[2], 300u);
  EXPECT_EQ(slot.used_bytes[2], 60u);
  EXPECT_EQ(slot.peak_bytes[1], 0u);
}

TEST(RegionReserve, RefusesDevicesOutOfRange) {
  test::TempFolder folder;
  auto a = MustOpen(folder.File("region"));
  EXPECT_FALSE(a->Reserve(-1, 1, kNoLimit));
  EXPECT_FALSE(a->Reserve(static_cast<int>(kMaxDevices), 1, kNoLimit));
  a->Release(-1, 1);
  a->Release(static_cast<int>(kMaxDevices), 1);
  EXPECT_EQ(a->Used(-1), 0u);
  EXPECT_EQ(a->Used(static_cast<int>(kMaxDevices)), 0u);
  EXPECT_EQ(a->OwnUsed(static_cast<int>(kMaxDevices)), 0u);
  EXPECT_EQ(a->ContextBytes(-1), 0u);
  a->SetContextBytes(-1, 5);
  a->SetLimitForMonitoring(static_cast<int>(kMaxDevices), 5);
}

// ---- devices ---------------------------------------------------------------------------------------------

TEST(RegionDevices, AreKeyedByUuidAcrossProcessesAndTheTableIsBounded) {
  test::TempFolder folder;
  auto a = MustOpen(folder.File("region"));
  auto b = MustOpen(folder.File("region"));
  std::uint8_t uuid[16];
  std::memcpy(uuid, kUuid, sizeof uuid);
  for (int i = 0; i < static_cast<int>(kMaxDevices); ++i) {
    uuid[15] = static_cast<std::uint8_t>(i);
    EXPECT_EQ(a->DeviceIndex(uuid), i);
  }
  for (int i = static_cast<int>(kMaxDevices) - 1; i >= 0; --i) {
    uuid[15] = static_cast<std::uint8_t>(i);
    EXPECT_EQ(b->DeviceIndex(uuid), i) << "another process names the same GPU the same way";
  }
  uuid[15] = 0xff;
  EXPECT_EQ(b->DeviceIndex(uuid), -1);
  EXPECT_EQ(a->region().device_count, kMaxDevices);
}

TEST(RegionDevices, ContextBytesAndLimitAreSharedForMonitoring) {
  test::TempFolder folder;
  auto a = MustOpen(folder.File("region"));
  auto b = MustOpen(folder.File("region"));
  const int device = a->DeviceIndex(kUuid);
  a->SetContextBytes(device, 300u << 20);
  a->SetLimitForMonitoring(device, 4ull << 30);
  EXPECT_EQ(b->ContextBytes(device), 300u << 20);
  EXPECT_EQ(b->region().devices[device].limit_bytes, 4ull << 30);
}

// ---- reaping ---------------------------------------------------------------------------------------------

TEST(RegionReap, ASequentialProcessSeesZeroAfterOneExitedWithoutReleasing) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  const pid_t first = test::Spawn([&] {
    Attachment* attachment = test::OpenOrNull(path);
    CHILD_CHECK(attachment != nullptr, 1);
    CHILD_CHECK(attachment->Reserve(0, 500, 1000), 2);
    return 0;  // exits holding 500, as a crashed or careless process would
  });
  ASSERT_EQ(test::WaitExit(first, 10s), 0);
  const pid_t second = test::Spawn([&] {
    Attachment* attachment = test::OpenOrNull(path);
    CHILD_CHECK(attachment != nullptr, 1);
    CHILD_CHECK(attachment->Used(0) == 0, 2);
    CHILD_CHECK(attachment->Reserve(0, 1000, 1000), 3);
    return 0;
  });
  ASSERT_EQ(test::WaitExit(second, 10s), 0);
  auto third = MustOpen(path);
  EXPECT_EQ(third->Used(0), 0u);
  EXPECT_EQ(test::LiveSlots(third->region()), 1);
}

TEST(RegionReap, ARefusalReapsTheDeadBeforeSayingNo) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  auto survivor = MustOpen(path);
  const pid_t hog = test::Spawn([&] {
    Attachment* attachment = test::OpenOrNull(path);
    CHILD_CHECK(attachment != nullptr, 1);
    CHILD_CHECK(attachment->Reserve(0, 1000, 1000), 2);
    return 0;
  });
  ASSERT_EQ(test::WaitExit(hog, 10s), 0);
  // The hog's attach reaped a moment ago, so an unforced reap is not due; the refusal must force one.
  EXPECT_EQ(survivor->Used(0), 1000u);
  EXPECT_TRUE(survivor->Reserve(0, 1, 1000));
  EXPECT_EQ(survivor->Used(0), 1u);
}

TEST(RegionReap, IsRateLimitedToEvery100msUnlessForced) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  auto survivor = MustOpen(path);
  survivor->ReapDead(true);
  const auto reaped_at = std::chrono::steady_clock::now();
  const pid_t dead = test::Spawn([&] {
    Attachment* attachment = test::OpenOrNull(path);
    CHILD_CHECK(attachment != nullptr, 1);
    CHILD_CHECK(attachment->Reserve(0, 5, kNoLimit), 2);
    return 0;
  });
  ASSERT_EQ(test::WaitExit(dead, 10s), 0);
  if (std::chrono::steady_clock::now() - reaped_at < 80ms) {
    EXPECT_EQ(survivor->ReapDead(false), 0u) << "not due yet";
    EXPECT_EQ(survivor->Used(0), 5u);
  }
  std::this_thread::sleep_for(110ms);
  EXPECT_EQ(survivor->ReapDead(false), 1u) << "due after 100 ms";
  EXPECT_EQ(survivor->Used(0), 0u);
  EXPECT_EQ(survivor->ReapDead(true), 0u);
}

TEST(RegionReap, NeverReapsALiveProcess) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  test::Pipe ready, finish;
  const pid_t alive = test::Spawn([&] {
    finish.CloseWrite();
    Attachment* attachment = test::OpenOrNull(path);
    CHILD_CHECK(attachment != nullptr, 1);
    CHILD_CHECK(attachment->Reserve(0, 42, kNoLimit), 2);
    CHILD_CHECK(write(ready.write_end, "r", 1) == 1, 3);
    finish.WaitForClose();
    return attachment->OwnUsed(0) == 42 ? 0 : 4;
  });
  finish.CloseRead();
  ASSERT_TRUE(ready.ReadBytes(1, 10s));
  auto observer = MustOpen(path);
  EXPECT_EQ(observer->ReapDead(true), 0u);
  EXPECT_EQ(observer->Used(0), 42u);
  finish.CloseWrite();
  EXPECT_EQ(test::WaitExit(alive, 10s), 0);
  EXPECT_EQ(observer->ReapDead(true), 1u);
  EXPECT_EQ(observer->Used(0), 0u);
}

TEST(RegionReap, AFullSlotTableFailsClosedWithAMessage) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  MakeRegion(path);
  // Play 1024 live processes: mark every slot live and hold every liveness byte from one description.
  const int holder = open(path.c_str(), O_RDWR);
  ASSERT_GE(holder, 0);
  struct flock all {};
  all.l_type = F_WRLCK;
  all.l_whence = SEEK_SET;
  all.l_start = static_cast<off_t>(kLivenessBase);
  all.l_len = kMaxSlots;
  ASSERT_EQ(fcntl(holder, F_OFD_SETLK, &all), 0);
  void* mapped = mmap(nullptr, kFileBytes, PROT_READ | PROT_WRITE, MAP_SHARED, holder, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  auto* region = reinterpret_cast<Region*>(static_cast<char*>(mapped) + kRegionOffset);
  for (Slot& slot : region->slots) {
    slot.state = SlotState::live;
    slot.pid = 1;
  }
  const std::string error = OpenError(path);
  EXPECT_NE(error.find(path), std::string::npos) << error;
  EXPECT_NE(error.find("all 1024 process slots"), std::string::npos) << error;
  // When those processes are gone, the next attach reaps them all and gets a slot.
  munmap(mapped, kFileBytes);
  close(holder);
  auto attachment = MustOpen(path);
  ASSERT_NE(attachment, nullptr);
  EXPECT_EQ(test::LiveSlots(attachment->region()), 1);
}

TEST(RegionReap, AFreeSlotWhoseByteIsStillHeldIsLeftToItsHolder) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  auto first = MustOpen(path);
  const int taken = first->slot();
  // Someone scribbles the table: the live process's slot reads free.
  const_cast<Region&>(first->region()).slots[taken].state = SlotState::free;
  auto second = MustOpen(path);
  EXPECT_NE(second->slot(), taken) << "the byte is held: the slot still belongs to a live process";
  EXPECT_EQ(second->region().slots[taken].state, SlotState::live);
  // The first process notices its slot is no longer its own and claims a fresh one rather than writing into
  // one that may be someone else's.
  EXPECT_TRUE(first->Reserve(0, 9, kNoLimit));
  EXPECT_NE(first->slot(), taken);
  EXPECT_NE(first->slot(), second->slot());
  EXPECT_EQ(first->OwnUsed(0), 9u);
  EXPECT_EQ(second->ReapDead(true), 1u) << "the abandoned slot's byte was let go";
  EXPECT_EQ(second->Used(0), 9u);
}

// ---- figures ---------------------------------------------------------------------------------------------

TEST(RegionFigures, ReserveReleaseAndAttachCost) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  auto a = MustOpen(path);
  constexpr int kPairs = 200'000;
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kPairs; ++i) {
    if (!a->Reserve(0, 4096, kNoLimit)) FAIL() << "reserve " << i;
    a->Release(0, 4096);
  }
  const double pair_ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / kPairs;
  std::uint64_t sink = 0;
  start = std::chrono::steady_clock::now();
  for (int i = 0; i < kPairs; ++i) sink += a->Used(0);
  const double used_ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / kPairs;
  EXPECT_EQ(sink, 0u);
  // Attach with 200 other live attachments to probe (the forced reap at attach visits each).
  std::vector<std::unique_ptr<Attachment>> others;
  for (int i = 0; i < 200; ++i) others.push_back(MustOpen(path));
  constexpr int kAttaches = 200;
  start = std::chrono::steady_clock::now();
  for (int i = 0; i < kAttaches; ++i) MustOpen(path);
  const double attach_us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / kAttaches;
  std::printf(
      "[ figures  ] Reserve+Release pair %.0f ns, Used() %.1f ns, attach+detach with 200 live slots "
      "%.1f us\n",
      pair_ns, used_ns, attach_us);
  RecordProperty("reserve_release_pair_ns", static_cast<int>(pair_ns));
  RecordProperty("attach_us", static_cast<int>(attach_us));
  EXPECT_LT(pair_ns, 50'000.0) << "pathologically slow";
  EXPECT_LT(attach_us, 50'000.0) << "pathologically slow";
}

}  // namespace
}  // namespace vgpu::region

// libFuzzer target: the container region's loader (vgpu-core/region, docs/region.md) on files of any content, size
// and kind: Attachment::Open (what libvgpu.so does in every process) and ReadSnapshot (what monitors do: the runner's
// sampler, `vgpu smi`, the Python binding).
//
// An input is   flags (1 byte) | size (1 byte) | payload (the rest)
// and becomes one thing at a fresh path in a private folder. A file there is HAMi-core's part as the real code makes
// it (docs/hami-cache.md: kRegionOffset bytes) followed by the region image the input describes (below); a file of
// at most 31 bytes is the first bytes of HAMi-core's part alone:
//   flags bits 0-1  the file's bytes beyond the payload: 0 or 3 a valid region made by the real code at start-up
//                   (Attachment::Open on a new path), 1 zeros, 2 0xff bytes;
//   flags bit 2     the robust lock left locked by a dead owner (its word FUTEX_OWNER_DIED), so that attaching
//                   takes EOWNERDEAD and runs the repair;
//   flags bits 3-5  what is at the path: 0-3 a regular file, 4 a FIFO, 5 a folder, 6 a symbolic link to the file,
//                   7 a dangling symbolic link;
//   size            the file's length, by its low 3 bits: 0-2 sizeof(Region); 3 longer, sizeof(Region) + 1 +
//                   16 * (size >> 3); 4 the payload's length; 5 just short, sizeof(Region) - 1 - 64 * (size >> 3);
//                   6 and 7 at most 31 bytes (size >> 3): nothing, or part of the 16-byte header;
//   payload         written at offset 0 over the base: the header, the device table, the first slots.
// The 64 bytes of the pthread mutex are always the real code's (with bit 2, its word says "owner died"): a mutex
// scribbled by a container user can make an attach wait its 10 s and fail closed (docs/threat-model.md, the region
// file is writable), which a fuzzer could only report as a timeout.
//
// Invariants:
//   - a file is accepted (by Open and by ReadSnapshot alike) exactly when it is a regular file at least
//     sizeof(Region) long whose magic, version and region_bytes are this build's; ReadSnapshot refuses anything else
//     with a one-line message naming the path; Open replaces by a fresh region a regular file (not a link) that is
//     empty or begins with HAMi-core's magic and major version 1 but holds no newer region of ours (nobody uses
//     it: docs/hami-cache.md, "Bad input"), saying so, and refuses anything else as ReadSnapshot does; a refused
//     file is left byte for byte as it was, and no attach leaves anything else in the folder;
//   - ReadSnapshot of an accepted file reports its device table and lock counters as written (in-use entries among
//     the first min(device_count, 16)) and no live slot (nobody holds a liveness byte);
//   - Open of an accepted file claims one slot (live, our pid, a fresh generation) and frees every other (their
//     owners are dead); each device total becomes the written total less the reaped live slots' usage (clamped), or,
//     after a dead owner's repair, the sum of nothing: 0, with lock_repairs one higher;
//   - DeviceIndex, Reserve and Release then do exactly what region.h says (add or find the UUID, admit iff
//     used + bytes <= limit without wrapping, give back exactly), a snapshot taken meanwhile shows our slot alone
//     with our usage; our slot rewritten behind our back (to a value from the input) is noticed and put back by
//     Release, the total moved by the difference; detaching frees the slot.
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "vgpu/region/hami_v1.h"
#include "vgpu/region/region.h"

namespace {

using vgpu::region::Attachment;
using vgpu::region::Device;
using vgpu::region::kMaxDevices;
using vgpu::region::kMaxSlots;
using vgpu::region::Region;
using vgpu::region::Slot;
using vgpu::region::SlotState;
using vgpu::region::Snapshot;

[[noreturn]] void Fail(const char* what, const std::string& detail = {}) {
  std::fprintf(stderr, "fuzz_region: invariant broken: %s%s%s%s\n", what, detail.empty() ? "" : " [", detail.c_str(),
               detail.empty() ? "" : "]");
  std::abort();
}

#define CHECK(condition, ...)                          \
  do {                                                 \
    if (!(condition)) Fail(#condition, ##__VA_ARGS__); \
  } while (false)

constexpr std::size_t kRegionBytes = sizeof(Region);
constexpr std::size_t kLockOffset = offsetof(Region, lock_storage);
constexpr std::size_t kLockBytes = sizeof(Region::lock_storage);
constexpr int kOwnerDied = 0x40000000;  // glibc's FUTEX_OWNER_DIED in a robust mutex's lock word

std::string g_folder;
std::vector<unsigned char> g_prefix;    // HAMi-core's part of a file as the real code makes it (kRegionOffset bytes)
std::vector<unsigned char> g_template;  // the region after it
bool g_owner_died_works = false;

enum class Kind { regular, fifo, folder, symlink, dangling };

std::string Describe(int error) { return std::strerror(error); }

void WriteAll(int fd, const unsigned char* data, std::size_t size) {
  std::size_t done = 0;
  while (done < size) {
    const ssize_t wrote = write(fd, data + done, size - done);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) Fail("cannot write the fuzzed file", Describe(errno));
    done += static_cast<std::size_t>(wrote);
  }
}

bool ReadAll(const std::string& path, std::vector<unsigned char>& out) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return false;
  out.clear();
  unsigned char buffer[65536];
  for (;;) {
    const ssize_t got = read(fd, buffer, sizeof buffer);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    out.insert(out.end(), buffer, buffer + got);
  }
  close(fd);
  return true;
}

std::vector<std::string> FolderEntries() {
  std::vector<std::string> names;
  DIR* dir = opendir(g_folder.c_str());
  if (dir == nullptr) Fail("cannot list the private folder", Describe(errno));
  while (const dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(dir);
  std::sort(names.begin(), names.end());
  return names;
}

// A message printed once by the shim or a monitor: one line, naming the file.
void CheckRefusal(const std::string& error, const std::string& path) {
  CHECK(!error.empty());
  CHECK(error.find('\n') == std::string::npos, error);
  CHECK(error.find(path) != std::string::npos, error);
}

// The bytes as a Region (zeros past a short file's end), in one of two buffers kept between inputs: big fresh
// allocations cost more page faults than the code under test.
const Region& RegionOf(const std::vector<unsigned char>& image, int buffer, std::size_t offset = 0) {
  static Region* const regions = new Region[2];
  Region& region = regions[buffer];
  std::memset(static_cast<void*>(&region), 0, sizeof region);
  if (image.size() > offset) {
    std::memcpy(static_cast<void*>(&region), image.data() + offset, std::min(image.size() - offset, kRegionBytes));
  }
  return region;
}

// The devices a monitor must report: the in-use entries among the first min(device_count, 16), as written.
void CheckDevices(const Snapshot& snapshot, const Region& region) {
  CHECK(snapshot.version == vgpu::region::kRegionVersion);
  CHECK(snapshot.lock_repairs == region.lock_repairs);
  std::uint32_t lock_word = 0;
  std::memcpy(&lock_word, region.lock_storage, sizeof lock_word);
  CHECK(snapshot.lock_holder_tid == static_cast<std::int32_t>(lock_word & 0x3fffffffu));
  const std::uint32_t count = std::min(region.device_count, kMaxDevices);
  std::size_t next = 0;
  for (std::uint32_t d = 0; d < count; ++d) {
    const Device& device = region.devices[d];
    if (device.in_use == 0) continue;
    CHECK(next < snapshot.devices.size(), "a device in use is missing from the snapshot");
    const auto& view = snapshot.devices[next++];
    CHECK(std::memcmp(view.uuid, device.uuid, sizeof view.uuid) == 0);
    CHECK(view.limit_bytes == device.limit_bytes && view.context_bytes == device.context_bytes &&
          view.cached_used_bytes == device.used_bytes);
    CHECK(view.compute.size() == sizeof device.compute &&
          std::memcmp(view.compute.data(), device.compute, sizeof device.compute) == 0);
  }
  CHECK(next == snapshot.devices.size(), "the snapshot has devices that are not in use");
}

void CheckSnapshotSums(const Snapshot& snapshot) {
  CHECK(snapshot.live.size() <= kMaxSlots && snapshot.devices.size() <= kMaxDevices);
  for (std::size_t d = 0; d < snapshot.devices.size(); ++d) {
    std::uint64_t sum = 0;
    for (const auto& slot : snapshot.live) {
      CHECK(slot.used_bytes.size() == snapshot.devices.size());
      sum = sum > UINT64_MAX - slot.used_bytes[d] ? UINT64_MAX : sum + slot.used_bytes[d];
    }
    CHECK(snapshot.devices[d].used_bytes == sum);
  }
}

std::uint64_t Word(const std::uint8_t* data, std::size_t size, std::size_t from_end, std::uint64_t otherwise) {
  if (size < from_end + 2) return otherwise;
  std::uint64_t value = 0;
  std::memcpy(&value, data + size - from_end, sizeof value);
  return value;
}

// The attached life: Open's claim and reap, then DeviceIndex, Reserve, a snapshot, Release, detaching.
void Attached(Attachment& attachment, const std::string& path, const Region& written, bool owner_died,
              const std::uint8_t* data, std::size_t size) {
  const Region& region = attachment.region();
  CHECK(region.magic == vgpu::region::kRegionMagic && region.version == vgpu::region::kRegionVersion &&
        region.region_bytes == kRegionBytes);
  const int mine = attachment.slot();
  CHECK(mine >= 0 && mine < static_cast<int>(kMaxSlots));
  const Slot& slot = region.slots[mine];
  CHECK(slot.state == SlotState::live && slot.pid == static_cast<std::int32_t>(getpid()));
  CHECK(slot.generation == region.next_generation, "the claim did not take a fresh generation");
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) CHECK(slot.used_bytes[d] == 0 && slot.peak_bytes[d] == 0);
  for (std::uint32_t i = 0; i < kMaxSlots; ++i) {
    if (static_cast<int>(i) != mine) CHECK(region.slots[i].state == SlotState::free, "a dead process's slot survived");
  }

  // Each device total: the written one less what the reaped live slots held (clamped), in slot order; after a
  // repair (a dead lock owner), recomputed from the live slots, all of which were then reaped: 0 unless it saturated.
  std::vector<const Slot*> live;
  for (const Slot& other : written.slots) {
    if (other.state == SlotState::live) live.push_back(&other);
  }
  std::uint64_t expected[kMaxDevices];
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
    bool saturated = false;
    expected[d] = owner_died ? 0 : written.devices[d].used_bytes;
    if (owner_died) {
      for (const Slot* other : live) {
        if (expected[d] > UINT64_MAX - other->used_bytes[d]) saturated = true;
        expected[d] = saturated ? UINT64_MAX : expected[d] + other->used_bytes[d];
      }
    }
    for (const Slot* other : live) expected[d] -= std::min(expected[d], other->used_bytes[d]);
    if (saturated) continue;
    CHECK(attachment.Used(static_cast<int>(d)) == expected[d], "device " + std::to_string(d));
    if (owner_died) CHECK(expected[d] == 0);
  }
  if (owner_died) CHECK(region.device_count <= kMaxDevices, "the repair left device_count past the table");
  CHECK(region.lock_repairs == written.lock_repairs + (owner_died ? 1u : 0u), "lock_repairs miscounted");

  // DeviceIndex: finds the UUID among the first min(device_count, 16) entries, else adds it if there is room.
  std::uint8_t uuid[16] = {'f', 'u', 'z', 'z'};
  if (size >= 2 + 16) std::memcpy(uuid, data + size - 16, 16);
  const std::uint32_t count = std::min(region.device_count, kMaxDevices);
  int expected_index = count == kMaxDevices ? -1 : static_cast<int>(count);
  for (std::uint32_t d = 0; d < count; ++d) {
    if (std::memcmp(region.devices[d].uuid, uuid, 16) == 0) {
      expected_index = static_cast<int>(d);
      break;
    }
  }
  const int index = attachment.DeviceIndex(uuid);
  CHECK(index == expected_index, std::to_string(index) + " vs " + std::to_string(expected_index));
  if (index >= 0) {
    CHECK(std::memcmp(region.devices[index].uuid, uuid, 16) == 0 &&
          region.device_count >= static_cast<std::uint32_t>(index) + 1);
  }

  // Reserve and Release on that device (or another one when the table is full), bytes and limit from the input.
  const int device = index >= 0 ? index : static_cast<int>(data[0] % kMaxDevices);
  const std::uint64_t bytes = Word(data, size, 24, 1 << 20);
  const std::uint64_t limit = Word(data, size, 32, UINT64_MAX);
  const std::uint64_t used = attachment.Used(device);
  const bool fits = bytes == 0 || (bytes <= limit && used <= limit - bytes);
  const bool reserved = attachment.Reserve(device, bytes, limit);
  CHECK(reserved == fits, "Reserve(" + std::to_string(bytes) + ", limit " + std::to_string(limit) + ") with " +
                              std::to_string(used) + " used");
  if (reserved) {
    CHECK(attachment.OwnUsed(device) == bytes && attachment.Used(device) == used + bytes);
  } else {
    CHECK(attachment.OwnUsed(device) == 0 && attachment.Used(device) == used);
  }

  // A monitor meanwhile: our slot alone is live, with our usage.
  Snapshot snapshot;
  std::string error;
  CHECK(vgpu::region::ReadSnapshot(path, snapshot, error), "a snapshot of an attached region failed: " + error);
  CheckSnapshotSums(snapshot);
  CheckDevices(snapshot, region);
  CHECK(snapshot.live.size() == 1, std::to_string(snapshot.live.size()) + " live slots");
  CHECK(snapshot.live[0].pid == static_cast<std::int32_t>(getpid()) &&
        snapshot.live[0].generation == region.slots[mine].generation);

  // A container process rewrites our slot (the region file is theirs to write, docs/threat-model.md): Release puts
  // our own figure back first, moving the total by the difference, then gives back what we hold.
  std::uint64_t total = used + (reserved ? bytes : 0);
  if (reserved && bytes != 0) {
    const std::uint64_t tamper = Word(data, size, 40, bytes / 2);
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    CHECK(fd >= 0);
    const off_t at = static_cast<off_t>(vgpu::region::kRegionOffset + offsetof(Region, slots) +
                                        static_cast<std::size_t>(mine) * sizeof(Slot) + offsetof(Slot, used_bytes) +
                                        static_cast<std::size_t>(device) * 8);
    CHECK(pwrite(fd, &tamper, sizeof tamper, at) == static_cast<ssize_t>(sizeof tamper));
    close(fd);
    if (tamper != bytes) {
      total = bytes >= tamper ? (total > UINT64_MAX - (bytes - tamper) ? UINT64_MAX : total + (bytes - tamper))
                              : total - std::min(total, tamper - bytes);
    }
    attachment.Release(device, bytes);
    CHECK(attachment.TamperedCount() == (tamper != bytes ? 1u : 0u), "a rewritten slot was not noticed");
    total -= std::min(total, bytes);
  } else {
    attachment.Release(device, bytes);
    CHECK(attachment.TamperedCount() == 0);
  }
  CHECK(attachment.OwnUsed(device) == 0, std::to_string(attachment.OwnUsed(device)));
  CHECK(attachment.Used(device) == total, std::to_string(attachment.Used(device)) + " vs " + std::to_string(total));
}

template <typename T>
T FieldOf(const std::vector<unsigned char>& bytes, std::size_t offset) {
  T value{};
  if (offset + sizeof value <= bytes.size()) std::memcpy(&value, bytes.data() + offset, sizeof value);
  return value;
}

// Whether Open replaces a file it does not accept (docs/hami-cache.md, "Bad input"): a regular file at the path (not
// a link) that is empty, or begins with HAMi-core's magic and major version 1 and holds no region of a newer version.
// (Nobody holds a liveness lock here, and HAMi's part as the real code writes it names no process.)
bool Replaceable(Kind kind, const std::vector<unsigned char>& contents) {
  if (kind != Kind::regular) return false;
  if (contents.empty()) return true;
  if (contents.size() < 8 || FieldOf<std::int32_t>(contents, 0) != vgpu::region::hami::kMagic ||
      FieldOf<std::uint32_t>(contents, 4) != vgpu::region::hami::kMajorVersion) {
    return false;
  }
  const std::size_t region = vgpu::region::kRegionOffset;
  return !(FieldOf<std::uint64_t>(contents, region) == vgpu::region::kRegionMagic &&
           FieldOf<std::uint32_t>(contents, region + offsetof(Region, version)) > vgpu::region::kRegionVersion);
}

// Step 2 of an input: Open accepts a valid file (and its invariants hold, Attached), replaces a replaceable one by a
// fresh region (nothing of the old file left, no temporary beside it), and refuses anything else, leaving it as it was.
void CheckAttach(const std::string& path, const std::string& file, Kind kind,
                 const std::vector<unsigned char>& contents, bool valid, const std::vector<std::string>& entries_before,
                 const Region& written, bool owner_died, const std::uint8_t* data, std::size_t size) {
  const bool replaceable = !valid && Replaceable(kind, contents);
  std::string error, note;
  Attachment* attachment = Attachment::Open(path, error, &note);
  CHECK((attachment != nullptr) == (valid || replaceable),
        attachment != nullptr ? "Open took a file it must refuse" : "Open refused a file it must take: " + error);
  CHECK(note.empty() == !replaceable, "Open's note does not say whether it replaced the file: '" + note + "'");
  static std::vector<unsigned char> after;
  if (attachment == nullptr) {
    CheckRefusal(error, path);
    // Refused means untouched: the same bytes, and nothing new in the folder (no temporary left behind).
    if (kind == Kind::regular || kind == Kind::symlink) {
      CHECK(ReadAll(file, after) && after == contents, "a refused file was changed");
    }
    CHECK(FolderEntries() == entries_before, "a refused attach left files behind");
    return;
  }
  const int mine = attachment->slot();
  if (replaceable) {
    CHECK(attachment->region().device_count == 0, "a replaced file kept the old file's devices");
  } else {
    Attached(*attachment, path, written, owner_died, data, size);
  }
  delete attachment;
  CHECK(ReadAll(file, after) && after.size() == (replaceable ? vgpu::region::kFileBytes : contents.size()));
  CHECK(RegionOf(after, 1, vgpu::region::kRegionOffset).slots[mine].state == SlotState::free,
        "detaching did not free the slot");
  CHECK(FolderEntries() == entries_before, "an attach left files behind");
  Snapshot snapshot;
  std::string snapshot_error;
  CHECK(vgpu::region::ReadSnapshot(path, snapshot, snapshot_error) && snapshot.live.empty(), snapshot_error);
}

void Remove(const std::string& path, Kind kind) {
  if (kind == Kind::folder) {
    rmdir(path.c_str());
  } else {
    unlink(path.c_str());
  }
  unlink((g_folder + "/target").c_str());
}

void OneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return;
  const unsigned flags = data[0];
  const unsigned size_code = data[1];
  const std::uint8_t* payload = data + 2;
  const std::size_t payload_size = size - 2;
  const bool owner_died = (flags & 4) != 0 && g_owner_died_works;
  static const Kind kKinds[] = {Kind::regular, Kind::regular, Kind::regular, Kind::regular,
                                Kind::fifo,    Kind::folder,  Kind::symlink, Kind::dangling};
  const Kind kind = kKinds[(flags >> 3) & 7];

  std::size_t length = kRegionBytes;
  switch (size_code & 7) {
    case 3:
      length = kRegionBytes + 1 + 16 * (size_code >> 3);
      break;
    case 4:
      length = payload_size;
      break;
    case 5:
      length = kRegionBytes - 1 - 64 * (size_code >> 3);
      break;
    case 6:
    case 7:
      length = size_code >> 3;
      break;
    default:
      break;
  }
  static std::vector<unsigned char> image;
  image.assign(length, 0);
  const unsigned base = flags & 3;
  const std::size_t based = std::min(length, kRegionBytes);
  if (base == 2) {
    std::memset(image.data(), 0xff, based);
  } else if (base != 1 && based > 0) {
    std::memcpy(image.data(), g_template.data(), based);
  }
  if (length > 0 && payload_size > 0) std::memcpy(image.data(), payload, std::min(length, payload_size));
  for (std::size_t i = kLockOffset; i < std::min(length, kLockOffset + kLockBytes); ++i) image[i] = g_template[i];
  if (owner_died && length >= kLockOffset + sizeof(int)) {
    std::memcpy(image.data() + kLockOffset, &kOwnerDied, sizeof(int));
  }

  // The file: HAMi-core's part, then the image (a tiny file: the part's first bytes alone).
  static std::vector<unsigned char> contents;
  const bool tiny = (size_code & 7) >= 6;
  contents.assign(g_prefix.begin(),
                  g_prefix.begin() + static_cast<long>(tiny ? std::min(length, g_prefix.size()) : g_prefix.size()));
  if (!tiny) contents.insert(contents.end(), image.begin(), image.end());

  const std::string path = g_folder + "/region";
  const std::string target = g_folder + "/target";
  const std::string& file = kind == Kind::symlink ? target : path;
  switch (kind) {
    case Kind::fifo:
      if (mkfifo(path.c_str(), 0600) != 0) Fail("mkfifo", Describe(errno));
      break;
    case Kind::folder:
      if (mkdir(path.c_str(), 0700) != 0) Fail("mkdir", Describe(errno));
      break;
    case Kind::dangling:
      if (symlink(target.c_str(), path.c_str()) != 0) Fail("symlink", Describe(errno));
      break;
    case Kind::symlink:
      if (symlink(target.c_str(), path.c_str()) != 0) Fail("symlink", Describe(errno));
      [[fallthrough]];
    case Kind::regular: {
      const int fd = open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      if (fd < 0) Fail("cannot create the fuzzed file", Describe(errno));
      WriteAll(fd, contents.data(), contents.size());
      close(fd);
      break;
    }
  }
  const std::vector<std::string> entries_before = FolderEntries();

  const bool is_file = kind == Kind::regular || kind == Kind::symlink;
  bool valid = is_file && !tiny && length >= kRegionBytes;
  if (valid) {
    std::uint64_t magic = 0;
    std::uint32_t version = 0, region_bytes = 0;
    std::memcpy(&magic, image.data() + offsetof(Region, magic), sizeof magic);
    std::memcpy(&version, image.data() + offsetof(Region, version), sizeof version);
    std::memcpy(&region_bytes, image.data() + offsetof(Region, region_bytes), sizeof region_bytes);
    valid =
        magic == vgpu::region::kRegionMagic && version == vgpu::region::kRegionVersion && region_bytes == kRegionBytes;
  }
  const Region& written = RegionOf(image, 0);

  // 1. A monitor's read-only snapshot.
  {
    Snapshot snapshot;
    snapshot.version = 12345;
    std::string error;
    const bool read = vgpu::region::ReadSnapshot(path, snapshot, error);
    CHECK(read == valid,
          read ? "ReadSnapshot took a file it must refuse" : "ReadSnapshot refused a valid file: " + error);
    if (read) {
      CheckDevices(snapshot, written);
      CheckSnapshotSums(snapshot);
      CHECK(snapshot.live.empty(), "a slot with no live owner counted as live");
    } else {
      CheckRefusal(error, path);
      CHECK(snapshot.version == 12345, "a refused snapshot changed `out`");
    }
  }

  // 2. A process attaching, as libvgpu.so does.
  CheckAttach(path, file, kind, contents, valid, entries_before, written, owner_died, data, size);
  Remove(path, kind);
}

// Writes the seed corpus (tests/fuzz/corpus/region) from the real code's region: VGPU_FUZZ_REGION_SEEDS=DIR.
void WriteSeeds(const std::string& dir) {
  const auto put = [&](const std::string& name, unsigned flags, unsigned size_code,
                       const std::vector<unsigned char>& payload) {
    std::vector<unsigned char> input{static_cast<unsigned char>(flags), static_cast<unsigned char>(size_code)};
    input.insert(input.end(), payload.begin(), payload.end());
    const std::string path = dir + "/" + name;
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) Fail("cannot write a seed", path);
    WriteAll(fd, input.data(), input.size());
    close(fd);
  };
  const auto header = [&](std::size_t bytes) {
    return std::vector<unsigned char>(g_template.begin(), g_template.begin() + static_cast<long>(bytes));
  };
  const auto set32 = [](std::vector<unsigned char>& p, std::size_t at, std::uint32_t v) { std::memcpy(&p[at], &v, 4); };
  const auto set64 = [](std::vector<unsigned char>& p, std::size_t at, std::uint64_t v) { std::memcpy(&p[at], &v, 8); };
  const std::size_t devices = offsetof(Region, devices);
  const std::size_t slots = offsetof(Region, slots);

  put("valid", 0, 0, {});                       // the real code's file, exactly
  put("valid-larger", 0, 3 | (4 << 3), {});     // longer than a region: accepted
  put("valid-header-only", 1, 0, header(128));  // the real header, zeros after it: accepted
  put("owner-died", 4, 0, {});
  put("fifo", 4 << 3, 0, {});
  put("folder", 5 << 3, 0, {});
  put("symlink", 6 << 3, 0, {});
  put("dangling-symlink", 7 << 3, 0, {});
  put("empty", 0, 6, {});
  put("header-15-bytes", 0, 6 | (15 << 3), {});
  put("header-16-bytes", 0, 6 | (16 << 3), {});
  put("truncated-by-1", 0, 5, {});
  put("truncated-4k", 0, 5 | (64 << 3), {});
  put("truncated-payload", 0, 4, header(200));
  put("zeros", 1, 0, {});
  put("ones", 2, 0, {});
  {
    auto p = header(16);
    set32(p, offsetof(Region, version), vgpu::region::kRegionVersion - 1);
    put("wrong-version-old", 0, 0, p);
    set32(p, offsetof(Region, version), vgpu::region::kRegionVersion + 1);
    put("wrong-version-new", 0, 0, p);
  }
  {
    auto p = header(16);
    set32(p, offsetof(Region, region_bytes), static_cast<std::uint32_t>(kRegionBytes) - 8);
    put("wrong-region-bytes", 0, 0, p);
    p = header(16);
    p[0] ^= 0x20;
    put("wrong-magic", 0, 0, p);
  }
  {
    // Three devices in use (one not), totals and limits, device_count 3; then 17 and ~0.
    auto p = header(devices + 4 * sizeof(Device));
    set32(p, offsetof(Region, device_count), 4);
    for (std::uint32_t d = 0; d < 4; ++d) {
      const std::size_t at = devices + d * sizeof(Device);
      for (int k = 0; k < 16; ++k) p[at + k] = static_cast<unsigned char>(0x10 * d + k);
      set32(p, at + offsetof(Device, in_use), d == 2 ? 0 : 1);
      set64(p, at + offsetof(Device, used_bytes), (d + 1) << 20);
      set64(p, at + offsetof(Device, context_bytes), 518u << 20);
      set64(p, at + offsetof(Device, limit_bytes), 4ull << 30);
    }
    put("devices", 0, 0, p);
    set32(p, offsetof(Region, device_count), 17);
    put("device-count-17", 0, 0, p);
    set32(p, offsetof(Region, device_count), 0xffffffffu);
    put("device-count-max", 0, 0, p);
  }
  {
    // Slots left by dead processes: live with usage, claiming, a scribbled state, a pid of -1; device totals that
    // agree with them, then ones that do not.
    auto p = header(slots + 4 * sizeof(Slot));
    set32(p, offsetof(Region, device_count), 2);
    set64(p, offsetof(Region, next_generation), 7);
    for (std::uint32_t d = 0; d < 2; ++d) {
      const std::size_t at = devices + d * sizeof(Device);
      p[at] = static_cast<unsigned char>(d + 1);
      set32(p, at + offsetof(Device, in_use), 1);
      set64(p, at + offsetof(Device, used_bytes), d == 0 ? 3u << 20 : 1u << 20);
    }
    const std::uint32_t states[] = {2, 2, 1, 7};
    const std::int32_t pids[] = {1, -1, 999999, 0};
    for (std::uint32_t s = 0; s < 4; ++s) {
      const std::size_t at = slots + s * sizeof(Slot);
      set32(p, at + offsetof(Slot, state), states[s]);
      set32(p, at + offsetof(Slot, pid), static_cast<std::uint32_t>(pids[s]));
      set64(p, at + offsetof(Slot, generation), s + 1);
      set64(p, at + offsetof(Slot, used_bytes), s < 2 ? (s + 1) << 20 : 5u << 20);
      set64(p, at + offsetof(Slot, used_bytes) + 8, s == 0 ? 1u << 20 : 0);
    }
    put("dead-slots", 0, 0, p);
    put("dead-slots-owner-died", 4, 0, p);
    set64(p, devices + offsetof(Device, used_bytes), 1);
    set64(p, slots + offsetof(Slot, used_bytes), UINT64_MAX);
    put("dead-slots-overflowing", 0, 0, p);
    put("dead-slots-overflowing-owner-died", 4, 0, p);
    set64(p, offsetof(Region, next_generation), UINT64_MAX);
    put("generation-wraps", 0, 0, p);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // $TMPDIR, else /dev/shm (a 290 KiB file written per input on a disk file system makes the run wait for the disk),
  // else /tmp.
  const char* base = std::getenv("TMPDIR");
  const std::string scratch = base != nullptr && base[0] == '/'      ? base
                              : access("/dev/shm", W_OK | X_OK) == 0 ? "/dev/shm"
                                                                     : "/tmp";
  std::string pattern = scratch + "/vgpu-fuzz-region.XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) Fail("mkdtemp", Describe(errno));
  g_folder = pattern;

  // The real code's region file, the base of most inputs.
  const std::string path = g_folder + "/template";
  std::string error;
  Attachment* attachment = Attachment::Open(path, error);
  if (attachment == nullptr) Fail("cannot make the template region", error);
  delete attachment;
  if (!ReadAll(path, g_template) || g_template.size() != vgpu::region::kFileBytes) {
    Fail("cannot read the template region");
  }
  g_prefix.assign(g_template.begin(), g_template.begin() + static_cast<long>(vgpu::region::kRegionOffset));
  g_template.erase(g_template.begin(), g_template.begin() + static_cast<long>(vgpu::region::kRegionOffset));
  unlink(path.c_str());

  // A robust mutex whose word says "owner died" must lock with EOWNERDEAD (glibc's layout: the word comes first).
  alignas(64) unsigned char storage[kLockBytes];
  std::memcpy(storage, g_template.data() + kLockOffset, kLockBytes);
  std::memcpy(storage, &kOwnerDied, sizeof(int));
  auto* mutex = reinterpret_cast<pthread_mutex_t*>(storage);
  if (pthread_mutex_trylock(mutex) == EOWNERDEAD) {
    g_owner_died_works = true;
    pthread_mutex_consistent(mutex);
    pthread_mutex_unlock(mutex);
  } else {
    std::fprintf(stderr, "fuzz_region: this libc's robust mutex layout is not glibc's; flags bit 2 is ignored\n");
  }

  if (const char* seeds = std::getenv("VGPU_FUZZ_REGION_SEEDS")) {
    WriteSeeds(seeds);
    rmdir(g_folder.c_str());
    std::exit(0);
  }
  std::atexit([] { rmdir(g_folder.c_str()); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  OneInput(data, size);
  return 0;
}

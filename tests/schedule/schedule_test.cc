// The schedule file: created complete, bad files refused with one line, members joined, found again, aged out
// and left; several processes joining at once get one entry per container; a process killed holding the lock
// leaves it usable.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <utility>

#include "vgpu/schedule/schedule.h"

namespace vgpu::schedule {
namespace {

constexpr std::uint64_t kBase = 20'000'000;
constexpr std::uint64_t kMost = 640'000'000;
constexpr std::uint64_t kSecond = 1'000'000'000;

class ScheduleFile : public ::testing::Test {
 protected:
  void SetUp() override {
    folder_ =
        std::filesystem::temp_directory_path() / ("vgpu-schedule-test-" + std::to_string(getpid()) + "-" +
                                                  ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(folder_);
    std::filesystem::create_directories(folder_);
    path_ = (folder_ / "vgpu-schedule").string();
  }
  void TearDown() override { std::filesystem::remove_all(folder_); }

  std::unique_ptr<Board> MustOpen() {
    std::string error;
    auto board = Board::Open(path_, kBase, kMost, error);
    EXPECT_NE(board, nullptr) << error;
    return board;
  }
  std::string OpenError() {
    std::string error;
    auto board = Board::Open(path_, kBase, kMost, error);
    EXPECT_EQ(board, nullptr);
    EXPECT_EQ(error.find('\n'), std::string::npos) << error;
    EXPECT_NE(error.find(path_), std::string::npos) << error;
    return error;
  }
  void WriteFile(const std::string& bytes) {
    const int fd = open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0666);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    close(fd);
  }

  std::filesystem::path folder_;
  std::string path_;
};

const std::uint8_t kUuidA[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
const std::uint8_t kUuidB[16] = {16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1};

TEST_F(ScheduleFile, IsCreatedCompleteWithItsCreatorsCycleAndReadableByAll) {
  auto board = MustOpen();
  ASSERT_NE(board, nullptr);
  EXPECT_EQ(board->header().magic, kScheduleMagic);
  EXPECT_EQ(board->header().version, kScheduleVersion);
  EXPECT_EQ(board->header().base_cycle_ns, kBase);
  EXPECT_EQ(board->header().cycle_max_ns, kMost);
  EXPECT_EQ(std::filesystem::file_size(path_), sizeof(Header));
  EXPECT_EQ(std::filesystem::status(path_).permissions() & std::filesystem::perms::all, std::filesystem::perms(0666))
      << "containers of other users must map it";
  std::string error;
  auto second = Board::Open(path_, 5 * kBase, kMost, error);  // a later opener's settings change nothing
  ASSERT_NE(second, nullptr) << error;
  EXPECT_EQ(second->header().base_cycle_ns, kBase);
  for (const auto& entry : std::filesystem::directory_iterator(folder_)) {
    EXPECT_EQ(entry.path().filename(), "vgpu-schedule") << "a temporary file was left behind";
  }
}

TEST_F(ScheduleFile, OfAnotherKindIsRefusedNamingItAndWhatWasFound) {
  WriteFile(std::string(4, 'x'));
  EXPECT_NE(OpenError().find("truncated"), std::string::npos);
  WriteFile(std::string(sizeof(Header), 'x'));
  EXPECT_NE(OpenError().find("not a vgpu schedule file"), std::string::npos);
  Header newer{};
  newer.magic = kScheduleMagic;
  newer.version = 2;
  newer.file_bytes = sizeof(Header) + 64;
  WriteFile(std::string(reinterpret_cast<const char*>(&newer), sizeof(newer)) + std::string(64, '\0'));
  const std::string error = OpenError();
  EXPECT_NE(error.find("version 2"), std::string::npos) << error;
  EXPECT_NE(error.find("VGPU_SCHEDULE_FILE"), std::string::npos) << "says what to do: " << error;
  Header cut{};
  cut.magic = kScheduleMagic;
  cut.version = kScheduleVersion;
  cut.file_bytes = sizeof(Header);
  WriteFile(std::string(reinterpret_cast<const char*>(&cut), sizeof(cut) / 2));
  EXPECT_NE(OpenError().find("version 1"), std::string::npos) << "a truncated version 1 file is not mapped";
}

// A file whose cycle no plan accepts (written by something else, or by a liar) is refused when opened: every member
// would otherwise find no plan on each refresh and take no turns.
TEST_F(ScheduleFile, WithACycleNoPlanAcceptsIsRefusedNamingTheCycleAndWhatIsAccepted) {
  for (const auto& [base, most] : {std::pair<std::uint64_t, std::uint64_t>{1, kMost},
                                   {kBase, 20'000'000'000ull},
                                   {kMost, kBase},
                                   {20'000'000'000ull, 20'000'000'000ull}}) {
    Header lying{};
    lying.magic = kScheduleMagic;
    lying.version = kScheduleVersion;
    lying.file_bytes = sizeof(Header);
    lying.base_cycle_ns = base;
    lying.cycle_max_ns = most;
    WriteFile(std::string(reinterpret_cast<const char*>(&lying), sizeof(lying)));
    const std::string error = OpenError();
    EXPECT_NE(error.find("has a cycle of " + std::to_string(base) + " ns at most " + std::to_string(most)),
              std::string::npos)
        << error;
    EXPECT_NE(error.find("accepted: a base of at least 100000 ns"), std::string::npos) << error;
  }
}

TEST_F(ScheduleFile, NamesEachGpuOnceWhoeverAsks) {
  auto first = MustOpen();
  auto second = MustOpen();
  EXPECT_EQ(first->GpuIndex(kUuidA), 0);
  EXPECT_EQ(second->GpuIndex(kUuidB), 1);
  EXPECT_EQ(second->GpuIndex(kUuidA), 0);
  EXPECT_EQ(first->GpuIndex(kUuidB), 1);
  std::uint8_t uuid[16] = {};
  for (std::uint32_t g = 2; g < kMaxGpus; ++g) {
    uuid[0] = static_cast<std::uint8_t>(100 + g);
    EXPECT_EQ(first->GpuIndex(uuid), static_cast<int>(g));
  }
  uuid[0] = 200;
  EXPECT_EQ(first->GpuIndex(uuid), -1) << "the table is full";
}

TEST_F(ScheduleFile, AContainersProcessesShareOneEntryAndMembersAreOrderedById) {
  auto board = MustOpen();
  std::string error;
  const int b = board->Join(9, 700, 0b1, kSecond, error);
  const int a = board->Join(4, 300, 0b11, kSecond, error);
  ASSERT_GE(a, 0) << error;
  ASSERT_GE(b, 0) << error;
  EXPECT_NE(a, b);
  auto other_process = MustOpen();
  EXPECT_EQ(other_process->Join(9, 700, 0b1, kSecond + 5, error), b) << "the container's entry, found again";
  const Members seen = ReadMembers(board->header(), kSecond + 10);
  ASSERT_EQ(seen.members.size(), 2u);
  EXPECT_EQ(seen.members[0].id, 4u);
  EXPECT_EQ(seen.members[0].share_permille, 300u);
  EXPECT_EQ(seen.members[0].gpus, 0b11u);
  EXPECT_EQ(seen.members[1].id, 9u);
  EXPECT_EQ(seen.entries[0], static_cast<std::uint32_t>(a));
  policy::WindowPlan plan;
  EXPECT_EQ(plan.Build(seen.members, kBase), "") << "what it reads builds a plan";
}

// A region (and the id in it) reused by a container with other limits: its entry, found again, says the new share.
// (On an H100, two containers 30/70 started on the regions of a 50/50 pair before them ran 50/50.)
TEST_F(ScheduleFile, AContainerJoiningAgainWithAnotherShareHasItsEntrySayIt) {
  auto board = MustOpen();
  std::string error;
  const int first = board->Join(5, 500, 0b1, kSecond, error);
  const int again = board->Join(5, 300, 0b11, 3 * kSecond, error);
  EXPECT_EQ(again, first);
  const Members seen = ReadMembers(board->header(), 3 * kSecond);
  ASSERT_EQ(seen.members.size(), 1u);
  EXPECT_EQ(seen.members[0].share_permille, 300u);
  EXPECT_EQ(seen.members[0].gpus, 0b11u);
}

TEST_F(ScheduleFile, AMemberWithoutAHeartbeatForASecondIsNoMemberAndItsEntryIsTakenOver) {
  auto board = MustOpen();
  std::string error;
  const int old = board->Join(1, 500, 0b1, kSecond, error);
  ASSERT_GE(old, 0);
  EXPECT_EQ(ReadMembers(board->header(), 2 * kSecond - 1).members.size(), 1u);
  EXPECT_EQ(ReadMembers(board->header(), 2 * kSecond).members.size(), 0u) << "aged out";
  Store(board->entry(old).gpu[0].busy_until_ns, 5 * kSecond);
  const int taken = board->Join(2, 400, 0b1, 3 * kSecond, error);
  EXPECT_EQ(taken, old) << "a stale entry is reused";
  EXPECT_EQ(Load(board->entry(taken).gpu[0].busy_until_ns), 0u) << "nothing of the old member's state survives";
  const Members seen = ReadMembers(board->header(), 3 * kSecond);
  ASSERT_EQ(seen.members.size(), 1u);
  EXPECT_EQ(seen.members[0].id, 2u);
  board->Leave(taken, 1);  // not its entry any more: nothing happens
  EXPECT_EQ(ReadMembers(board->header(), 3 * kSecond).members.size(), 1u);
  board->Leave(taken, 2);
  EXPECT_EQ(ReadMembers(board->header(), 3 * kSecond).members.size(), 0u);
}

TEST_F(ScheduleFile, AFullTableRefusesAnotherContainerNamingTheFile) {
  auto board = MustOpen();
  std::string error;
  for (std::uint64_t id = 1; id <= kMaxEntries; ++id) ASSERT_GE(board->Join(id, 10, 1, kSecond, error), 0) << error;
  EXPECT_EQ(board->Join(kMaxEntries + 1, 10, 1, kSecond, error), -1);
  EXPECT_NE(error.find(path_), std::string::npos) << error;
  EXPECT_GE(board->Join(kMaxEntries + 1, 10, 1, 3 * kSecond, error), 0) << "once the others aged out";
}

TEST_F(ScheduleFile, EntriesWithImpossibleValuesAreLeftOutOfThePlan) {
  auto board = MustOpen();
  std::string error;
  const int e = board->Join(3, 500, 0b1, kSecond, error);
  ASSERT_GE(e, 0);
  board->entry(e).share_permille = 5000;  // a liar, or a torn write
  EXPECT_EQ(ReadMembers(board->header(), kSecond).members.size(), 0u);
  board->entry(e).share_permille = 500;
  Store(board->entry(e).gpus, 0);
  EXPECT_EQ(ReadMembers(board->header(), kSecond).members.size(), 0u);
}

TEST(PublishedOf, WorkIsInFlightUntilItsExpectedEndAndALaunchWaitsUntilItsLook) {
  GpuState state{};
  state.busy_until_ns = 100;
  state.waiting_until_ns = 50;
  state.released_until_ns = 80;
  state.repaid_until_ns = 70;
  policy::Published p = PublishedOf(state, 60);
  EXPECT_EQ(p.in_flight, 1u);
  EXPECT_EQ(p.waiting, 0u);
  EXPECT_EQ(p.released_until_ns, 80u);
  EXPECT_EQ(p.repaid_until_ns, 70u);
  p = PublishedOf(state, 100);
  EXPECT_EQ(p.in_flight, 0u) << "a holder that died is not waited for past its expected end";
  EXPECT_EQ(PublishedOf(state, 49).waiting, 1u);
}

// declined_until_ns was reserved (zero) before 63c1e82 (2026-11-28): zero reads as nothing declined, so files written by
// older shims read right; it is read only for an entry on that one GPU (members spanning GPUs never decline).
TEST(PublishedOf, TheRestOfAWindowIsDeclinedUntilItsEndForAnEntryOnThatGpuOnly) {
  Entry entry{};
  entry.gpus = 1u << 2;
  EXPECT_EQ(PublishedOf(entry, 2, 60).declined_until_ns, 0u) << "reserved, zero: nothing declined";
  entry.declined_until_ns = 100;
  EXPECT_EQ(PublishedOf(entry, 2, 60).declined_until_ns, 100u);
  EXPECT_EQ(PublishedOf(entry, 2, 100).declined_until_ns, 0u) << "over";
  entry.gpus = (1u << 2) | 1u;
  EXPECT_EQ(PublishedOf(entry, 2, 60).declined_until_ns, 0u) << "an entry spanning GPUs";
  entry.gpu[2].busy_until_ns = 90;
  EXPECT_EQ(PublishedOf(entry, 2, 60).in_flight, 1u) << "the GPU's own fields as PublishedOf(GpuState)";
  EXPECT_EQ(PublishedOf(entry, 2, 60).work_end_ns, 90u) << "prompt service: how long it has been idle";
}

// Prompt service: a member on one GPU asking to cut in (Entry::cut_in_until_ns, reserved and zero in files of shims
// before it) is seen by the others on that GPU until the ask runs out; an entry spanning GPUs never cuts in.
TEST(PublishedOf, AnAskToCutInIsSeenUntilItRunsOutForAnEntryOnThatGpuOnly) {
  Entry entry{};
  entry.gpus = 1u << 2;
  EXPECT_EQ(PublishedOf(entry, 2, 60).cut_in_until_ns, 0u) << "reserved, zero: no ask";
  entry.cut_in_until_ns = 100;
  EXPECT_EQ(PublishedOf(entry, 2, 60).cut_in_until_ns, 100u);
  EXPECT_EQ(PublishedOf(entry, 2, 100).cut_in_until_ns, 0u) << "run out";
  entry.gpus = (1u << 2) | 1u;
  EXPECT_EQ(PublishedOf(entry, 2, 60).cut_in_until_ns, 0u) << "an entry spanning GPUs";
}

TEST(RaiseTo, KeepsTheLargerValue) {
  std::uint64_t field = 10;
  RaiseTo(field, 5);
  EXPECT_EQ(field, 10u);
  RaiseTo(field, 12);
  EXPECT_EQ(field, 12u);
}

// Processes of 8 containers (3 each) join at once from a cold start: the file is made once, each container gets
// one entry, no two containers share one.
TEST_F(ScheduleFile, ProcessesJoiningAtOnceGetOneEntryPerContainer) {
  constexpr int kContainers = 8;
  constexpr int kEach = 3;
  std::vector<pid_t> children;
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  for (int c = 0; c < kContainers * kEach; ++c) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      std::string error;
      auto board = Board::Open(path_, kBase, kMost, error);
      const int entry = board ? board->Join(100 + c / kEach, 100, 1, kSecond, error) : -1;
      const int message[2] = {c / kEach, entry};
      (void)!write(fds[1], message, sizeof(message));
      _exit(entry >= 0 ? 0 : 1);
    }
    children.push_back(pid);
  }
  close(fds[1]);
  std::vector<std::set<int>> entries(kContainers);
  int message[2];
  while (read(fds[0], message, sizeof(message)) == static_cast<ssize_t>(sizeof(message))) {
    entries[static_cast<std::size_t>(message[0])].insert(message[1]);
  }
  close(fds[0]);
  for (const pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  std::set<int> all;
  for (const auto& container : entries) {
    EXPECT_EQ(container.size(), 1u) << "a container's processes share one entry";
    all.insert(container.begin(), container.end());
  }
  EXPECT_EQ(all.size(), static_cast<std::size_t>(kContainers));
  auto board = MustOpen();
  EXPECT_EQ(ReadMembers(board->header(), kSecond).members.size(), static_cast<std::size_t>(kContainers));
}

// A process killed while it holds the membership lock: the next joiner inherits it (EOWNERDEAD), counts the repair
// and goes on.
TEST_F(ScheduleFile, AProcessKilledHoldingTheLockLeavesItUsable) {
  auto board = MustOpen();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto* mutex = reinterpret_cast<pthread_mutex_t*>(const_cast<unsigned char*>(board->header().lock_storage));
    pthread_mutex_lock(mutex);
    raise(SIGKILL);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status));
  std::string error;
  EXPECT_GE(board->Join(7, 250, 1, kSecond, error), 0) << error;
  EXPECT_EQ(board->header().lock_repairs, 1u);
  EXPECT_GE(board->Join(8, 250, 1, kSecond, error), 0) << error;
}

}  // namespace
}  // namespace vgpu::schedule

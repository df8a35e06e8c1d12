// The verdict's text format (docs/node-monitor.md, "The verdict"): what the monitor writes, the shim reads back
// exactly; what is not a verdict is refused with a message naming the line, the problem and an example.
#include "vgpu/verdict/verdict.h"

#include <gtest/gtest.h>

#include <string>

namespace vgpu::verdict {
namespace {

constexpr const char* kGpu = "GPU-5f0c1a2b-3c4d-5e6f-7a8b-9c0d1e2f3a4b";
constexpr const char* kOtherGpu = "GPU-77aa1a2b-3c4d-5e6f-7a8b-9c0d1e2f3a4b";

Verdict Sample() {
  Verdict v;
  v.seq = 42;
  v.stamp_ns = 1'795'420'000'123'456'789ull;
  v.devices.push_back({kGpu, 4ull << 30, (4ull << 30) + 1, 300, 512});
  v.devices.push_back({kOtherGpu, 0, 0, 0, 0});
  v.processes.push_back({7, kGpu, 2ull << 30, 480});
  v.processes.push_back({9, kGpu, (2ull << 30) + 1, 32});
  return v;
}

std::string ParseError(const std::string& text) {
  Verdict out;
  out.seq = 99;
  std::string error;
  EXPECT_FALSE(Parse(text, out, error)) << text;
  EXPECT_EQ(out.seq, 99u) << "a failed parse must leave its output alone";
  return error;
}

const std::string kHead = "vgpu-verdict 1\nseq 1\nstamp_ns 2\n";
const std::string kDevice = std::string("device ") + kGpu + " memory_limit=10 memory_used=5 sm_limit=300 sm_used=100\n";

TEST(Verdict, WhatIsWrittenIsReadBackExactly) {
  const Verdict written = Sample();
  Verdict read;
  std::string error;
  ASSERT_TRUE(Parse(Format(written), read, error)) << error;
  EXPECT_EQ(read.seq, 42u);
  EXPECT_EQ(read.stamp_ns, written.stamp_ns);
  ASSERT_EQ(read.devices.size(), 2u);
  EXPECT_EQ(read.devices[0].uuid, kGpu);
  EXPECT_EQ(read.devices[0].memory_used, (4ull << 30) + 1);
  EXPECT_TRUE(read.devices[0].MemoryOver());
  EXPECT_FALSE(read.devices[1].MemoryOver()) << "no limit is never over";
  EXPECT_EQ(read.devices[0].sm_used, 512u);
  ASSERT_EQ(read.processes.size(), 2u);
  EXPECT_EQ(read.FindProcess(9, kGpu)->memory_used, (2ull << 30) + 1);
  EXPECT_EQ(read.FindProcess(9, kOtherGpu), nullptr);
  EXPECT_EQ(Format(read), Format(written));
}

TEST(Verdict, AnEmptyVerdictHasItsHeaderSeqAndStampOnly) {
  Verdict v;
  v.seq = 1;
  v.stamp_ns = 2;
  EXPECT_EQ(Format(v), kHead);
  Verdict read;
  std::string error;
  EXPECT_TRUE(Parse(kHead, read, error)) << error;
  EXPECT_TRUE(read.devices.empty());
}

TEST(Verdict, MemoryIsOverOnlyPastTheLimit) {
  Device d{kGpu, 100, 100, 0, 0};
  EXPECT_FALSE(d.MemoryOver());
  d.memory_used = 101;
  EXPECT_TRUE(d.MemoryOver());
}

TEST(Verdict, ATextCutShortOrWithoutItsHeaderIsRefused) {
  EXPECT_NE(ParseError("").find("newline"), std::string::npos);
  EXPECT_NE(ParseError(kHead.substr(0, kHead.size() - 1)).find("newline"), std::string::npos);
  EXPECT_NE(ParseError("seq 1\nstamp_ns 2\n").find("line 1"), std::string::npos);
  EXPECT_NE(ParseError("vgpu-verdict 2\nseq 1\nstamp_ns 2\n").find("version 1"), std::string::npos);
  EXPECT_NE(ParseError("vgpu-verdict 1\nseq 1\n").find("no stamp_ns"), std::string::npos);
  EXPECT_NE(ParseError("vgpu-verdict 1\nstamp_ns 1\n").find("no seq"), std::string::npos);
}

TEST(Verdict, NumbersAreDecimalWithoutSignsOrSpacesAndBelowTwoToTheSixtyFour) {
  for (const char* seq : {"-1", "+1", "01", "1.5", "0x10", "18446744073709551616", "", " 1"}) {
    const std::string error = ParseError(std::string("vgpu-verdict 1\nseq ") + seq + "\nstamp_ns 2\n");
    EXPECT_NE(error.find("line 2"), std::string::npos) << seq << ": " << error;
  }
  Verdict read;
  std::string error;
  EXPECT_TRUE(Parse("vgpu-verdict 1\nseq 18446744073709551615\nstamp_ns 0\n", read, error)) << error;
  EXPECT_EQ(read.seq, UINT64_MAX);
}

TEST(Verdict, LinesAreWordsSeparatedBySingleSpaces) {
  EXPECT_NE(ParseError("vgpu-verdict 1\nseq  1\nstamp_ns 2\n").find("single spaces"), std::string::npos);
  EXPECT_NE(ParseError("vgpu-verdict 1\nseq 1 \nstamp_ns 2\n").find("single spaces"), std::string::npos);
  EXPECT_NE(ParseError("vgpu-verdict 1\nseq 1\r\nstamp_ns 2\n").find("line 2"), std::string::npos);
  EXPECT_NE(ParseError(kHead + "\n").find("line 4"), std::string::npos) << "no blank lines";
}

TEST(Verdict, SeqAndStampAreGivenOnce) {
  EXPECT_NE(ParseError(kHead + "seq 3\n").find("seq is given twice"), std::string::npos);
  EXPECT_NE(ParseError(kHead + "stamp_ns 3\n").find("stamp_ns is given twice"), std::string::npos);
}

TEST(Verdict, ADeviceLineNamesAUuidAndEachOfItsFourFiguresOnce) {
  EXPECT_NE(ParseError(kHead + "device gpu0 memory_limit=1 memory_used=1 sm_limit=1 sm_used=1\n").find("device UUID"),
            std::string::npos);
  const std::string prefix = kHead + "device " + kGpu;
  EXPECT_NE(ParseError(prefix + " memory_limit=1 memory_used=1 sm_limit=1\n").find("needs 4"), std::string::npos);
  EXPECT_NE(ParseError(prefix + " memory_limit=1 memory_limit=1 sm_limit=1 sm_used=1\n").find("twice"),
            std::string::npos);
  EXPECT_NE(ParseError(prefix + " memory_limit=1 memory_used=1 sm_limit=1 colour=1\n").find("'colour=1'"),
            std::string::npos);
  EXPECT_NE(ParseError(prefix + " memory_limit=1 memory_used=x sm_limit=1 sm_used=1\n").find("memory_used 'x'"),
            std::string::npos);
  EXPECT_NE(ParseError(prefix + " memory_limit=1 memory_used=1 sm_limit=1001 sm_used=1\n").find("permille"),
            std::string::npos);
  EXPECT_NE(ParseError(kHead + kDevice + kDevice).find("listed twice"), std::string::npos);
}

TEST(Verdict, AProcessLineNamesAPidAndADeviceListedAbove) {
  const std::string process = std::string("process 7 device=") + kGpu + " memory_used=1 sm_used=2\n";
  Verdict read;
  std::string error;
  EXPECT_TRUE(Parse(kHead + kDevice + process, read, error)) << error;
  EXPECT_NE(ParseError(kHead + process).find("no device line above"), std::string::npos);
  EXPECT_NE(ParseError(kHead + kDevice + process + process).find("listed twice"), std::string::npos);
  EXPECT_NE(ParseError(kHead + kDevice + "process 0 device=" + kGpu + " memory_used=1 sm_used=2\n").find("pid"),
            std::string::npos);
  EXPECT_NE(
      ParseError(kHead + kDevice + "process 4294967296 device=" + kGpu + " memory_used=1 sm_used=2\n").find("pid"),
      std::string::npos);
  EXPECT_NE(ParseError(kHead + kDevice + "process 7 device=GPU-x memory_used=1 sm_used=2\n").find("device UUID"),
            std::string::npos);
}

TEST(Verdict, AnUnknownLineIsRefusedNamingIt) {
  const std::string error = ParseError(kHead + "limit 5\n");
  EXPECT_NE(error.find("line 4"), std::string::npos) << error;
  EXPECT_NE(error.find("'limit'"), std::string::npos) << error;
  EXPECT_NE(error.find("e.g."), std::string::npos) << error;
}

TEST(Verdict, MessagesShowWhatTheFileSaidOnOneLine) {
  const std::string error = ParseError(kHead + "\x01\x7f' x\n");
  EXPECT_EQ(error.find('\n'), std::string::npos);
  EXPECT_NE(error.find("\\x01"), std::string::npos) << error;
}

TEST(Verdict, MoreThanAVerdictHoldsIsRefused) {
  std::string text = kHead;
  for (std::size_t i = 0; i <= kMaxDevices; ++i) {
    char uuid[48];
    std::snprintf(uuid, sizeof uuid, "GPU-%08zx-0000-0000-0000-000000000000", i);
    text += std::string("device ") + uuid + " memory_limit=1 memory_used=1 sm_limit=1 sm_used=1\n";
  }
  EXPECT_NE(ParseError(text).find("more than"), std::string::npos);
  EXPECT_NE(ParseError(std::string(kMaxBytes + 1, 'x')).find("bytes"), std::string::npos);
}

TEST(Verdict, IsFreshWithinASecondEitherWay) {
  const std::uint64_t now = 10'000'000'000ull;
  EXPECT_TRUE(IsFresh(now, now));
  EXPECT_TRUE(IsFresh(now - kFreshNs, now));
  EXPECT_FALSE(IsFresh(now - kFreshNs - 1, now));
  EXPECT_TRUE(IsFresh(now + kFreshNs, now));
  EXPECT_FALSE(IsFresh(now + kFreshNs + 1, now)) << "a verdict from the future is not used";
  EXPECT_FALSE(IsFresh(0, now));
}

TEST(Verdict, DeviceUuidsHaveNvmlsForm) {
  EXPECT_TRUE(IsDeviceUuid(kGpu));
  EXPECT_TRUE(IsDeviceUuid("MIG-5f0c1a2b-3c4d-5e6f-7a8b-9c0d1e2f3a4b"));
  for (const char* bad : {"", "GPU-", "GPU-5f0c1a2b3c4d5e6f7a8b9c0d1e2f3a4b", "GPU-5f0c1a2b-3c4d-5e6f-7a8b-9c0d1e2f3a4",
                          "GPU-5f0c1a2b-3c4d-5e6f-7a8b-9c0d1e2f3a4bb", "gpu-5f0c1a2b-3c4d-5e6f-7a8b-9c0d1e2f3a4b",
                          "GPU-5f0c1a2g-3c4d-5e6f-7a8b-9c0d1e2f3a4b"}) {
    EXPECT_FALSE(IsDeviceUuid(bad)) << bad;
  }
}

TEST(Verdict, UuidTextIsNvmlsFormOfCudasBytes) {
  const unsigned char bytes[16] = {0x5f, 0x0c, 0x1a, 0x2b, 0x3c, 0x4d, 0x5e, 0x6f,
                                   0x7a, 0x8b, 0x9c, 0x0d, 0x1e, 0x2f, 0x3a, 0x4b};
  EXPECT_EQ(UuidText(bytes), kGpu);
}

}  // namespace
}  // namespace vgpu::verdict

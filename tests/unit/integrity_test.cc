// The CUDA runtime's integrity check (fakecuda/driver/integrity.h): MD2 and HMAC-MD2 against their standards' vectors
// and an independent implementation's, and the answer's fixed forms.
#include "integrity.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

namespace fakecuda::driver::integrity {
namespace {

std::string Hex(const Digest& digest) {
  std::string text;
  char byte[3];
  for (const std::uint8_t b : digest) {
    std::snprintf(byte, sizeof byte, "%02x", b);
    text += byte;
  }
  return text;
}

Digest Md2Of(const std::string& text) {
  return Md2(std::span(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()));
}

// RFC 1319, appendix A.5.
TEST(Integrity, Md2GivesTheStandardsTestVectors) {
  EXPECT_EQ(Hex(Md2Of("")), "8350e5a3e24c153df2275c9f80692773");
  EXPECT_EQ(Hex(Md2Of("a")), "32ec01ec4a6dac72c0ab96fb34c0b5d1");
  EXPECT_EQ(Hex(Md2Of("abc")), "da853b0d3f88d99b30283a69e6ded6bb");
  EXPECT_EQ(Hex(Md2Of("message digest")), "ab4f496bfb2a530b219ff33031fe06b0");
  EXPECT_EQ(Hex(Md2Of("abcdefghijklmnopqrstuvwxyz")), "4e8ddff3650292ab5a4108c3aa47940b");
  EXPECT_EQ(Hex(Md2Of("12345678901234567890123456789012345678901234567890123456789012345678901234567890")),
            "d5976f79d83d3a0dc9806c3c66f3efd8");
}

// Inputs a public implementation of the runtime's side uses in its own tests (ZLUDA's dark_api), and the answers an
// independent HMAC-MD2 gives for them, with no device and with one.
Inputs ReferenceInputs() {
  Inputs in;
  in.driver_version = 0x2f30;
  in.version = 12082;
  in.pid = 0x002fa423;
  in.thread = 0xf79c1000;
  in.runtime_table = 0x00007ffff6958240;
  in.integrity_table = 0x00007ffff6958220;
  in.integrity_function = 0x00007ffff2aaf4a0;
  in.unix_seconds = 0x682b9cee;
  return in;
}

TEST(Integrity, TheAnswerIsHmacMd2OfWhatBothSidesSee) {
  Inputs in = ReferenceInputs();
  ASSERT_EQ(Message(in).size(), 48u);
  EXPECT_EQ(Hex(Answer(in)), "0779ef5e4ffa2dd207527503d1907bfa");
  Device device;
  device.uuid = {0x9a, 0xfe, 0x2b, 0x8a, 0xac, 0x25, 0x2d, 0x38, 0xea, 0x37, 0xae, 0xc5, 0x6d, 0x71, 0x32, 0x5f};
  device.pci_bus = 2;
  in.devices.push_back(device);
  ASSERT_EQ(Message(in).size(), 48u + 28u);
  EXPECT_EQ(Hex(Answer(in)), "4448a171b026cef76c8c3e39051b02dd");
}

TEST(Integrity, EveryInputChangesTheAnswer) {
  const Digest reference = Answer(ReferenceInputs());
  const std::vector<void (*)(Inputs&)> changes = {[](Inputs& in) { ++in.driver_version; },
                                                  [](Inputs& in) { in.version += 10; },
                                                  [](Inputs& in) { ++in.pid; },
                                                  [](Inputs& in) { ++in.thread; },
                                                  [](Inputs& in) { in.runtime_table += 8; },
                                                  [](Inputs& in) { in.integrity_table += 8; },
                                                  [](Inputs& in) { in.integrity_function++; },
                                                  [](Inputs& in) { ++in.unix_seconds; },
                                                  [](Inputs& in) { in.devices.emplace_back(); }};
  for (std::size_t i = 0; i < changes.size(); ++i) {
    Inputs in = ReferenceInputs();
    changes[i](in);
    EXPECT_NE(Answer(in), reference) << "change " << i;
  }
}

// The runtime's first two calls (its version + 0 and + 1) get fixed answers, whatever the rest.
TEST(Integrity, VersionsEndingInZeroOrOneGetFixedAnswers) {
  Inputs in = ReferenceInputs();
  in.version = 13000;
  EXPECT_EQ(Hex(Answer(in)), "5c67cb031c184133e8d14c1faa83d38e");
  in.version = 13001;
  EXPECT_EQ(Hex(Answer(in)), "5c67cb031c184118e8d14c1faa83d38e");
  in.pid = 1;
  EXPECT_EQ(Hex(Answer(in)), "5c67cb031c184118e8d14c1faa83d38e");
}

}  // namespace
}  // namespace fakecuda::driver::integrity

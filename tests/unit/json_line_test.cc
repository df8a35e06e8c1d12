// vgpu/base/json_line.h: the bytes each writer of a JSON line has always written.
#include "vgpu/base/json_line.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

namespace {

using vgpu::base::Controls;
using vgpu::base::JsonLine;

TEST(JsonLine, EscapesControlsInEitherForm) {
  const std::string text = "a\"b\\c\n\t\r\x01\x7f\xc3\xa9\xff";
  std::string short_forms;
  vgpu::base::AppendJsonString(short_forms, text);
  EXPECT_EQ(short_forms, "\"a\\\"b\\\\c\\n\\t\\r\\u0001\\u007f\xc3\xa9\xff\"");
  std::string unicode;
  vgpu::base::AppendJsonString(unicode, text, Controls::unicode);
  EXPECT_EQ(unicode, "\"a\\\"b\\\\c\\u000a\\u0009\\u000d\\u0001\\u007f\xc3\xa9\xff\"");
}

TEST(JsonLine, AppendsFieldsInOrder) {
  std::string out = "x";
  JsonLine(out).Begin("kernel").Text("tenant", "a").Number("pid", 1000).Signed("code", -9).End();
  JsonLine(out).Begin().Numbers("devices", {0, 2}).Numbers("none", {}).Close();
  EXPECT_EQ(out, "x{\"ev\":\"kernel\",\"tenant\":\"a\",\"pid\":1000,\"code\":-9}\n{\"devices\":[0,2],\"none\":[]}");
  EXPECT_EQ(JsonLine("end", Controls::unicode).Number("t_ns", 5).Done(), "{\"ev\":\"end\",\"t_ns\":5}\n");
}

TEST(JsonLine, DecimalsHaveNineSignificantDigitsAndNoNonFinite) {
  std::string out;
  JsonLine(out).Begin().Decimal("a", 2.5034234233423).Decimal("b", 0).Decimal("c", NAN).Decimal("d", 1e-9).Close();
  JsonLine(out).Begin().Decimal("e", INFINITY).Decimal("f", 1234567891.0).Close();
  EXPECT_EQ(out, "{\"a\":2.50342342,\"b\":0,\"c\":0,\"d\":1e-09}{\"e\":0,\"f\":1.23456789e+09}");
}

}  // namespace

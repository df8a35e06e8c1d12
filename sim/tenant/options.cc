// Strict parsing of vgpu-tenant's command line: a value that does not read exactly as documented is refused.
#include "options.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <limits>
#include <string>
#include <system_error>

#include "vgpu/base/duration.h"

namespace vgpu::tenant {
namespace {

// Bounds keep every derived quantity (nanoseconds, deadlines, ring sizes)
// far from overflow and every resource the program creates small.
constexpr std::uint64_t kMaxDevice = 1023;
constexpr std::uint64_t kMaxKernelUs = 3'600'000'000;  // one hour
constexpr std::uint64_t kMaxBlocks = 2'147'483'647;    // gridDim.x limit of every GPU since Kepler
constexpr std::uint64_t kMaxThreads = 1024;            // blockDim limit of every GPU since Fermi
constexpr std::uint64_t kMaxKernelCount = 1'000'000'000'000;
constexpr double kMaxSeconds = 1'000'000;  // eleven and a half days
constexpr double kMinRateHz = 0.001;
constexpr double kMaxRateHz = 1'000'000;
constexpr std::uint64_t kMaxDepth = 1024;
constexpr std::uint64_t kMaxStreams = 64;
constexpr std::uint64_t kMaxPhases = 1000;
constexpr std::uint64_t kMaxPhaseSizes = 1024;
constexpr std::uint64_t kMaxKernelNs = kMaxKernelUs * 1000;
constexpr std::uint64_t kMaxPhaseNs = 1'000'000'000'000'000;  // kMaxSeconds
constexpr std::uint64_t kMaxReportMs = 3'600'000;             // an hour
constexpr double kMaxJitterPercent = 99.9;
constexpr std::uint64_t kMaxChurnThreads = 64;
constexpr std::uint64_t kMaxRanks = 8;  // one per device: fakecuda's kMaxDevices
constexpr std::uint64_t kMaxGroup = 1'000'000'000;
constexpr std::uint64_t kMaxChurnHold = 4096;
constexpr std::uint64_t kChurnStep = 4096;
constexpr std::uint64_t kMaxChurnBytes = 1ull << 40;

// Quotes a value for a message, so that an empty or odd value stays visible.
std::string Quoted(std::string_view text) {
  std::string quoted = "\"";
  for (const char character : text) {
    const auto byte = static_cast<unsigned char>(character);
    if (character == '"' || character == '\\') {
      quoted += '\\';
      quoted += character;
    } else if (byte < 0x20 || byte == 0x7f) {
      constexpr std::string_view kHexDigits = "0123456789abcdef";
      quoted += "\\x";
      quoted += kHexDigits[byte >> 4];
      quoted += kHexDigits[byte & 0xf];
    } else {
      quoted += character;
    }
  }
  quoted += '"';
  return quoted;
}

bool IsDigit(char character) { return character >= '0' && character <= '9'; }

// "010" is 8 to C's strtol and 10 to from_chars; refusing it means nobody gets the one they did not mean.
bool HasLeadingZero(std::string_view text) { return text.size() > 1 && text[0] == '0' && IsDigit(text[1]); }

struct FlagSpec {
  std::string_view name;
  std::string_view value_name;
  std::string_view example_value;
  std::string_view help;
  // Parses value into options; returns "" or what was wrong with the value
  // (the caller adds the flag, the value and the example).
  std::string (*apply)(std::string_view value, Options& options);
  // May be given more than once (each value applied in order).
  bool repeatable = false;
};

// Parses a whole number in [minimum, maximum]; "" or the problem.
std::string ReadWholeNumber(std::string_view value, std::uint64_t minimum, std::uint64_t maximum,
                            std::uint64_t* result) {
  std::string problem;
  const std::optional<std::uint64_t> number = ParseWholeNumber(value, &problem);
  if (!number) {
    return problem + "; expected a whole number from " + std::to_string(minimum) + " to " + std::to_string(maximum);
  }
  if (*number < minimum || *number > maximum) {
    return "is out of range; expected a whole number from " + std::to_string(minimum) + " to " +
           std::to_string(maximum);
  }
  *result = *number;
  return {};
}

std::string FormatDecimal(double value) {
  std::array<char, 32> buffer{};
  const auto [end, error] =
      std::to_chars(buffer.data(), buffer.data() + buffer.size(), value, std::chars_format::fixed);
  return error == std::errc{} ? std::string(buffer.data(), end) : std::string("?");
}

// Parses a decimal number in (0, maximum] or [minimum, maximum]; "" or the problem.
std::string ReadPositiveDecimal(std::string_view value, double minimum, double maximum, double* result) {
  const std::string expected =
      minimum > 0 ? "; expected a number from " + FormatDecimal(minimum) + " to " + FormatDecimal(maximum)
                  : "; expected a number above 0, up to " + FormatDecimal(maximum);
  std::string problem;
  const std::optional<double> number = ParseDecimal(value, &problem);
  if (!number) {
    return problem + expected;
  }
  if (!(*number > 0) || *number < minimum || *number > maximum) {
    return "is out of range" + expected;
  }
  *result = *number;
  return {};
}

template <typename Integer>
std::string ReadInto(std::string_view value, std::uint64_t minimum, std::uint64_t maximum, Integer* field) {
  static_assert(std::numeric_limits<Integer>::is_integer);
  std::uint64_t number = 0;
  std::string problem = ReadWholeNumber(value, minimum, maximum, &number);
  if (problem.empty()) {
    *field = static_cast<Integer>(number);  // maximum fits Integer: checked by the table's bounds
  }
  return problem;
}

constexpr std::array kFlags = {
    FlagSpec{"--device", "N", "0", "device ordinal, as cuDeviceGet numbers them (default 0)",
             [](std::string_view value, Options& options) { return ReadInto(value, 0, kMaxDevice, &options.device); }},
    FlagSpec{"--alloc", "BYTES", "2g",
             "allocate and zero this much device memory before launching (default 0); bytes or a\n"
             "        suffix k, m, g, t or Ki, Mi, Gi, Ti, all powers of 1024 (1g = 1024m = 1Gi)",
             [](std::string_view value, Options& options) {
               std::string problem;
               const std::optional<std::uint64_t> bytes = ParseSizeBytes(value, &problem);
               if (!bytes) {
                 return problem + "; expected bytes or a whole number with a suffix k, m, g, t, Ki, Mi, Gi, Ti";
               }
               options.alloc_bytes = *bytes;
               return std::string();
             }},
    FlagSpec{
        "--kernel-us", "D", "1000",
        "run time of each kernel in microseconds, if it had the GPU to itself (default 1000)",
        [](std::string_view value, Options& options) { return ReadInto(value, 0, kMaxKernelUs, &options.kernel_us); }},
    FlagSpec{"--blocks", "B", "132", "blocks per kernel (default 1)",
             [](std::string_view value, Options& options) { return ReadInto(value, 1, kMaxBlocks, &options.blocks); }},
    FlagSpec{
        "--threads", "T", "128", "threads per block (default 32: one warp)",
        [](std::string_view value, Options& options) { return ReadInto(value, 1, kMaxThreads, &options.threads); }},
    FlagSpec{"--kernels", "K", "1000",
             "launch K kernels, then wait for them and stop (default 1000 when --seconds is absent)",
             [](std::string_view value, Options& options) {
               std::uint64_t count = 0;
               std::string problem = ReadWholeNumber(value, 0, kMaxKernelCount, &count);
               if (problem.empty()) {
                 options.kernel_count = count;
               }
               return problem;
             }},
    FlagSpec{"--seconds", "S", "2.5", "launch for S seconds, then wait for what is in flight and stop",
             [](std::string_view value, Options& options) {
               double seconds = 0;
               std::string problem = ReadPositiveDecimal(value, 0, kMaxSeconds, &seconds);
               if (problem.empty()) {
                 options.seconds = seconds;
               }
               return problem;
             }},
    FlagSpec{"--rate", "HZ", "200",
             "open loop: launch at HZ kernels per second on a fixed schedule; a launch that finds\n"
             "        its stream full (see --depth) waits, and later ones catch up with the schedule\n"
             "        (default: closed loop, launch whenever a stream has room)",
             [](std::string_view value, Options& options) {
               double rate_hz = 0;
               std::string problem = ReadPositiveDecimal(value, kMinRateHz, kMaxRateHz, &rate_hz);
               if (problem.empty()) {
                 options.rate_hz = rate_hz;
               }
               return problem;
             }},
    FlagSpec{"--depth", "Q", "2", "at most Q kernels in flight per stream (default 2)",
             [](std::string_view value, Options& options) { return ReadInto(value, 1, kMaxDepth, &options.depth); }},
    FlagSpec{
        "--streams", "N", "4", "streams to launch on, round robin (default 1)",
        [](std::string_view value, Options& options) { return ReadInto(value, 1, kMaxStreams, &options.streams); }},
    FlagSpec{"--phase", "SPEC", "kernels=5us|1ms,for=2s,depth=4",
             "a phase of the run, repeatable, run in order: key=value pairs joined by commas, either\n"
             "        kernels=D[|D...] (durations with a unit ns, us, ms or s; several: each kernel drawn\n"
             "        uniformly from them), for=DURATION (default: until --seconds ends), depth=N\n"
             "        (default --depth), rate=HZ (default 0: closed loop), blocks=B (default --blocks),\n"
             "        jitter=P (percent below 100: each kernel's duration varies uniformly by +/- P %),\n"
             "        collective=D and ranks=N (after every `every=K` kernels, default 1, one collective kernel\n"
             "        of D in group=G, default 1, of N ranks, one per device: fakecuda makes it wait for the\n"
             "        other ranks' to start, as an all_reduce does; a real GPU runs it as a spin of D);\n"
             "        or idle=DURATION: launch nothing for that long. A phase ends by launching no more;\n"
             "        its kernels in flight count against the next phase's depth. Replaces --kernel-us\n"
             "        and --rate; after the last phase the tenant idles until --seconds ends",
             [](std::string_view value, Options& options) {
               if (options.phases.size() == kMaxPhases) {
                 return "is one phase too many; expected at most " + std::to_string(kMaxPhases) + " phases";
               }
               Phase phase;
               std::string problem = ParsePhase(value, &phase);
               if (problem.empty()) {
                 options.phases.push_back(std::move(phase));
               }
               return problem;
             },
             true},
    FlagSpec{"--repeat", "", "",
             "run the phases again from the first, until --seconds ends (needs --phase and --seconds)",
             [](std::string_view, Options& options) {
               options.repeat = true;
               return std::string();
             }},
    FlagSpec{"--seed", "N", "1", "seed of the kernel size and jitter draws (default 1)",
             [](std::string_view value, Options& options) {
               return ReadInto(value, 0, std::numeric_limits<std::uint64_t>::max(), &options.seed);
             }},
    FlagSpec{"--report-ms", "N", "100",
             "every N ms print a progress line {\"ev\":\"report\",\"t_ns\":..,\"kernels\":..,\"busy_ns\":..}:\n"
             "        CLOCK_MONOTONIC, kernels seen complete, the sum of their durations (and once more\n"
             "        when the last kernel has finished, before the result line)",
             [](std::string_view value, Options& options) {
               std::uint64_t report_ms = 0;
               std::string problem = ReadWholeNumber(value, 1, kMaxReportMs, &report_ms);
               if (problem.empty()) {
                 options.report_ms = report_ms;
               }
               return problem;
             }},
    FlagSpec{"--churn", "SPEC", "threads=2,max=4Mi,hold=8",
             "besides the kernels, threads allocate and free device memory as fast as they can\n"
             "        (cuMemAlloc_v2 / cuMemFree_v2): key=value pairs joined by commas, all optional,\n"
             "        threads=N (default 1), min=SIZE and max=SIZE (each block a multiple of 4 KiB drawn\n"
             "        uniformly between them; default 4Ki, 4Mi), hold=K (blocks a thread holds at most,\n"
             "        default 8: each step allocates or frees a random held block, even odds below K).\n"
             "        CUDA_ERROR_OUT_OF_MEMORY is counted, not fatal. stdin then takes one word a line:\n"
             "        pause (every churn thread stops between two calls, then a line\n"
             "        {\"ev\":\"churn\",\"state\":\"paused\",\"held_bytes\":..,\"blocks\":..,\"allocs\":..,\n"
             "        \"frees\":..,\"oom\":..,\"max_call_us\":..}: held_bytes is what the blocks take now),\n"
             "        resume (the same line, \"running\"), stop (ends the run as --seconds would; the\n"
             "        blocks are freed and a last line says \"stopped\"). End of input changes nothing",
             [](std::string_view value, Options& options) {
               Churn churn;
               std::string problem = ParseChurn(value, &churn);
               if (problem.empty()) {
                 options.churn = churn;
               }
               return problem;
             }},
    FlagSpec{"--ptx", "FILE", "spin.ptx", "load the kernel vgpu_spin from this PTX file instead of the embedded one",
             [](std::string_view value, Options& options) {
               if (value.empty()) {
                 return std::string("is empty; expected the path of a PTX file");
               }
               options.ptx_path = std::string(value);
               return std::string();
             }},
};

const FlagSpec* FindFlag(std::string_view name) {
  for (const FlagSpec& flag : kFlags) {
    if (flag.name == name) {
      return &flag;
    }
  }
  return nullptr;
}

// What a number's start says against it (empty, a sign, a leading zero), or nullptr.
const char* StartProblem(std::string_view text) {
  if (text.empty()) return "is empty";
  if (text[0] == '-') return "is negative";
  if (HasLeadingZero(text)) return "has a leading zero (octal to some tools, decimal to others, so refused)";
  return nullptr;
}

// Whether std::from_chars read all of `text`; if not, *problem says why.
bool Converted(std::string_view text, const std::from_chars_result& result, const char* not_a_number,
               const char* out_of_range, std::string* problem) {
  if (result.ec == std::errc::invalid_argument) {
    *problem = not_a_number;
  } else if (result.ec == std::errc::result_out_of_range) {
    *problem = out_of_range;
  } else if (result.ptr != text.data() + text.size()) {
    *problem = "has trailing characters " + Quoted(text.substr(static_cast<std::size_t>(result.ptr - text.data())));
  } else {
    return true;
  }
  return false;
}

}  // namespace

std::optional<std::uint64_t> ParseWholeNumber(std::string_view text, std::string* problem) {
  if (const char* refused = StartProblem(text)) {
    *problem = refused;
    return std::nullopt;
  }
  std::uint64_t value = 0;
  const std::from_chars_result result = std::from_chars(text.data(), text.data() + text.size(), value, 10);
  if (!Converted(text, result, "is not a whole number", "is too large (more than 18446744073709551615)", problem)) {
    return std::nullopt;
  }
  return value;
}

std::optional<std::uint64_t> ParseSizeBytes(std::string_view text, std::string* problem) {
  std::size_t digit_count = 0;
  while (digit_count < text.size() && IsDigit(text[digit_count])) {
    ++digit_count;
  }
  const std::string_view digits = text.substr(0, digit_count);
  const std::string_view suffix = text.substr(digit_count);
  if (digits.empty()) {
    // Let the number parser say what is wrong with the start ("is negative", "is empty", ...).
    const std::optional<std::uint64_t> ignored = ParseWholeNumber(text, problem);
    if (ignored) {
      *problem = "is not a size";  // unreachable: a number starts with a digit
    }
    return std::nullopt;
  }
  const std::optional<std::uint64_t> count = ParseWholeNumber(digits, problem);
  if (!count) {
    return std::nullopt;
  }
  struct Suffix {
    std::string_view text;
    unsigned shift;
  };
  constexpr std::array kSuffixes = {
      Suffix{"", 0},   Suffix{"k", 10},  Suffix{"K", 10},  Suffix{"Ki", 10}, Suffix{"m", 20},
      Suffix{"M", 20}, Suffix{"Mi", 20}, Suffix{"g", 30},  Suffix{"G", 30},  Suffix{"Gi", 30},
      Suffix{"t", 40}, Suffix{"T", 40},  Suffix{"Ti", 40},
  };
  for (const Suffix& candidate : kSuffixes) {
    if (candidate.text == suffix) {
      if (*count > (std::numeric_limits<std::uint64_t>::max() >> candidate.shift)) {
        *problem = "is too large (more than 18446744073709551615 bytes)";
        return std::nullopt;
      }
      return *count << candidate.shift;
    }
  }
  *problem = "has an unknown suffix " + Quoted(suffix);
  return std::nullopt;
}

std::optional<double> ParseDecimal(std::string_view text, std::string* problem) {
  if (const char* refused = StartProblem(text)) {
    *problem = refused;
    return std::nullopt;
  }
  double value = 0;
  const std::from_chars_result result =
      std::from_chars(text.data(), text.data() + text.size(), value, std::chars_format::general);
  if (!Converted(text, result, "is not a number", "is out of the range of a double", problem)) return std::nullopt;
  if (!std::isfinite(value)) {
    *problem = "is not a finite number";
    return std::nullopt;
  }
  return value;
}

std::optional<std::uint64_t> ParseDurationNs(std::string_view text, std::string* problem) {
  std::size_t unit_start = text.size();
  while (unit_start > 0 && ((text[unit_start - 1] >= 'a' && text[unit_start - 1] <= 'z') ||
                            (text[unit_start - 1] >= 'A' && text[unit_start - 1] <= 'Z'))) {
    --unit_start;
  }
  const std::string_view number = text.substr(0, unit_start);
  const std::string_view unit = text.substr(unit_start);
  if (unit.empty()) {
    *problem = text.empty() ? "is empty" : "has no unit";
    return std::nullopt;
  }
  if (unit != "ns" && unit != "us" && unit != "ms" && unit != "s") {
    *problem = "has an unknown unit " + Quoted(unit);
    return std::nullopt;
  }
  if (!number.empty() && number[0] == '-') {
    *problem = "is negative";
    return std::nullopt;
  }
  // The scenario file's grammar (vgpu/base/duration.h): exact, no exponent; "010ms" is ten (no tool reads a
  // duration as octal).
  std::uint64_t ns = 0;
  switch (base::ParseDuration(text, ns)) {
    case base::DurationStatus::ok:
      return ns;
    case base::DurationStatus::finer_than_ns:
      *problem = "is not a whole number of nanoseconds";
      return std::nullopt;
    case base::DurationStatus::too_large:
      *problem = "is too long";
      return std::nullopt;
    default:  // the unit is one of the four, so the number is not digits with an optional fraction
      *problem = "is not a decimal number (digits with an optional fraction, e.g. 1.5)";
      return std::nullopt;
  }
}

namespace {

constexpr std::string_view kDurationExpected = "expected a number with a unit ns, us, ms or s";

// A duration in [1 ns, maximum_ns] (maximum_text says it for people); "" or the problem, naming the key.
std::string ReadDuration(std::string_view key, std::string_view value, std::uint64_t maximum_ns,
                         std::string_view maximum_text, std::uint64_t* result) {
  constexpr std::uint64_t minimum_ns = 1;
  std::string problem;
  const std::optional<std::uint64_t> ns = ParseDurationNs(value, &problem);
  const std::string range = " from 1ns to " + std::string(maximum_text);
  if (!ns) {
    return "has " + std::string(key) + "=" + Quoted(value) + ", which " + problem + "; " +
           std::string(kDurationExpected) + range;
  }
  if (*ns < minimum_ns || *ns > maximum_ns) {
    return "has " + std::string(key) + "=" + Quoted(value) + ", which is out of range; " +
           std::string(kDurationExpected) + range;
  }
  *result = *ns;
  return {};
}

// Splits `text` (empty: no pairs) into key=value pairs joined by commas and hands each to `take(key, value)`, which
// returns "" or a problem. "" or the first problem: a pair without =, a key given twice, or what `take` said.
template <typename Take>
std::string ForEachPair(std::string_view text, std::string_view keys, std::vector<std::string_view>& seen_keys,
                        Take&& take) {
  std::size_t position = 0;
  while (!text.empty() && position <= text.size()) {
    const std::size_t comma = std::min(text.find(',', position), text.size());
    const std::string_view item = text.substr(position, comma - position);
    position = comma + 1;
    const std::size_t equals = item.find('=');
    if (equals == std::string_view::npos) {
      return "has " + Quoted(item) + " without =; expected key=value pairs joined by commas, keys " + std::string(keys);
    }
    const std::string_view key = item.substr(0, equals);
    for (const std::string_view earlier : seen_keys) {
      if (earlier == key) {
        return "gives " + std::string(key) + "= twice; expected each key once";
      }
    }
    seen_keys.push_back(key);
    if (std::string problem = take(key, item.substr(equals + 1)); !problem.empty()) {
      return problem;
    }
  }
  return {};
}

// One of a phase's collective keys (collective=, ranks=, every=, group=).
std::string ParseCollectiveKey(std::string_view key, std::string_view value, Phase* phase) {
  std::string problem;
  if (key == "collective") {
    return ReadDuration(key, value, kMaxKernelNs, "3600s", &phase->collective_ns);
  }
  if (key == "ranks") {
    problem = ReadInto(value, 2, kMaxRanks, &phase->ranks);
  } else if (key == "every") {
    problem = ReadInto(value, 1, kMaxDepth, &phase->every);
  } else {
    problem = ReadInto(value, 1, kMaxGroup, &phase->group);
  }
  return problem.empty() ? problem : "has " + std::string(key) + "=" + Quoted(value) + ", which " + problem;
}

// A collective needs both collective= and ranks=; group= and every= mean nothing without them.
std::string CheckCollective(const std::vector<std::string_view>& seen_keys, const Phase& phase) {
  const bool optional_keys = std::ranges::any_of(
      seen_keys, [](std::string_view key) { return key == "ranks" || key == "group" || key == "every"; });
  if ((phase.collective_ns > 0) != (phase.ranks > 0) || (optional_keys && phase.collective_ns == 0)) {
    return "has an incomplete collective; expected collective=DURATION and ranks=N (2 .. " + std::to_string(kMaxRanks) +
           ") together, with group= and every= optional, e.g. "
           "kernels=5ms,collective=1ms,ranks=2";
  }
  return {};
}

}  // namespace

std::string ParsePhase(std::string_view text, Phase* phase) {
  constexpr std::string_view kKeys =
      "kernels, for, depth, rate, blocks, jitter, collective, ranks, group, every or idle";
  if (text.empty()) {
    return "is empty; expected key=value pairs joined by commas, with kernels= or idle=";
  }
  std::vector<std::string_view> seen_keys;
  const std::string pairs_problem =
      ForEachPair(text, kKeys, seen_keys, [&](std::string_view key, std::string_view value) -> std::string {
        std::string problem;
        if (key == "kernels") {
          std::size_t start = 0;
          while (start <= value.size()) {
            const std::size_t bar = std::min(value.find('|', start), value.size());
            std::uint64_t size_ns = 0;
            problem = ReadDuration("kernels", value.substr(start, bar - start), kMaxKernelNs, "3600s", &size_ns);
            if (!problem.empty()) {
              return problem + ", several joined by |";
            }
            if (phase->sizes_ns.size() == kMaxPhaseSizes) {
              return "has more than " + std::to_string(kMaxPhaseSizes) + " kernel sizes; expected at most " +
                     std::to_string(kMaxPhaseSizes);
            }
            phase->sizes_ns.push_back(size_ns);
            start = bar + 1;
          }
        } else if (key == "for" || key == "idle") {
          std::uint64_t duration_ns = 0;
          problem = ReadDuration(key, value, kMaxPhaseNs, "1000000s", &duration_ns);
          if (!problem.empty()) {
            return problem;
          }
          phase->for_ns = duration_ns;
          phase->idle = phase->idle || key == "idle";
        } else if (key == "collective" || key == "ranks" || key == "every" || key == "group") {
          return ParseCollectiveKey(key, value, phase);
        } else if (key == "depth" || key == "blocks") {
          std::uint32_t number = 0;
          problem = ReadInto(value, 1, key == "depth" ? kMaxDepth : kMaxBlocks, &number);
          if (!problem.empty()) {
            return "has " + std::string(key) + "=" + Quoted(value) + ", which " + problem;
          }
          (key == "depth" ? phase->depth : phase->blocks) = number;
        } else if (key == "rate") {
          std::string why;
          const std::optional<double> rate = ParseDecimal(value, &why);
          const std::string expected = "; expected 0 (closed loop) or a number from " + FormatDecimal(kMinRateHz) +
                                       " to " + FormatDecimal(kMaxRateHz);
          if (!rate) {
            return "has rate=" + Quoted(value) + ", which " + why + expected;
          }
          if (*rate != 0 && (*rate < kMinRateHz || *rate > kMaxRateHz)) {
            return "has rate=" + Quoted(value) + ", which is out of range" + expected;
          }
          phase->rate_hz = *rate;
        } else if (key == "jitter") {
          const std::string_view number = value.ends_with('%') ? value.substr(0, value.size() - 1) : value;
          std::string why;
          const std::optional<double> percent = ParseDecimal(number, &why);
          const std::string expected = "; expected a percentage from 0 to " + FormatDecimal(kMaxJitterPercent) +
                                       " (to 0.1 %), with or without %";
          if (!percent) {
            return "has jitter=" + Quoted(value) + ", which " + why + expected;
          }
          if (*percent < 0 || *percent > kMaxJitterPercent) {
            return "has jitter=" + Quoted(value) + ", which is out of range" + expected;
          }
          phase->jitter_permille = static_cast<std::uint32_t>(std::llround(*percent * 10));
        } else {
          return "has an unknown key " + Quoted(key) + "; expected " + std::string(kKeys);
        }
        return {};
      });
  if (!pairs_problem.empty()) {
    return pairs_problem;
  }
  const bool has_kernels = !phase->sizes_ns.empty();
  if (phase->idle && seen_keys.size() > 1) {
    return "mixes idle= with other keys; expected idle=DURATION alone, or kernels= with its keys";
  }
  if (!phase->idle && !has_kernels) {
    return "has neither kernels= nor idle=; expected one of them, e.g. kernels=1ms or idle=1s";
  }
  return CheckCollective(seen_keys, *phase);
}

std::string ParseChurn(std::string_view text, Churn* churn) {
  constexpr std::string_view kKeys = "threads, min, max or hold";
  std::vector<std::string_view> seen_keys;
  const std::string pairs_problem =
      ForEachPair(text, kKeys, seen_keys, [&](std::string_view key, std::string_view value) -> std::string {
        std::string problem;
        if (key == "threads" || key == "hold") {
          problem = key == "threads" ? ReadInto(value, 1, kMaxChurnThreads, &churn->threads)
                                     : ReadInto(value, 1, kMaxChurnHold, &churn->hold);
        } else if (key == "min" || key == "max") {
          const std::optional<std::uint64_t> bytes = ParseSizeBytes(value, &problem);
          if (!bytes) {
            problem += "; expected bytes or a whole number with a suffix k, m, g, t, Ki, Mi, Gi, Ti";
          } else if (*bytes < kChurnStep || *bytes > kMaxChurnBytes) {
            problem = "is out of range; expected a size from 4Ki to 1Ti";
          } else {
            (key == "min" ? churn->min_bytes : churn->max_bytes) = *bytes;
          }
        } else {
          return "has an unknown key " + Quoted(key) + "; expected " + std::string(kKeys);
        }
        if (!problem.empty()) {
          return "has " + std::string(key) + "=" + Quoted(value) + ", which " + problem;
        }
        return {};
      });
  if (!pairs_problem.empty()) {
    return pairs_problem;
  }
  if (churn->min_bytes > churn->max_bytes) {
    return "has min above max; expected min <= max";
  }
  return {};
}

CommandLine ParseCommandLine(std::span<const char* const> args) {
  CommandLine command_line;
  std::array<bool, kFlags.size()> seen{};
  for (std::size_t index = 0; index < args.size(); ++index) {
    const std::string_view argument = args[index] != nullptr ? args[index] : "";
    if (argument == "--help" || argument == "-h") {
      command_line.help_requested = true;
      return command_line;
    }
    if (!argument.starts_with("--")) {
      command_line.error = "unexpected argument " + Quoted(argument) + "; options start with --";
      return command_line;
    }
    const std::size_t equals = argument.find('=');
    const std::string_view name = argument.substr(0, equals);
    const FlagSpec* flag = FindFlag(name);
    if (flag == nullptr) {
      command_line.error = "unknown option " + Quoted(name);
      return command_line;
    }
    const std::size_t flag_index = static_cast<std::size_t>(flag - kFlags.data());
    if (seen[flag_index] && !flag->repeatable) {
      command_line.error = std::string(flag->name) + " is given twice; give it once, e.g. " + std::string(flag->name) +
                           " " + std::string(flag->example_value);
      return command_line;
    }
    seen[flag_index] = true;
    std::string_view value;
    if (flag->value_name.empty()) {
      if (equals != std::string_view::npos) {
        command_line.error = std::string(flag->name) + " takes no value, got " + Quoted(argument.substr(equals + 1)) +
                             "; give it alone, e.g. " + std::string(flag->name);
        return command_line;
      }
    } else if (equals != std::string_view::npos) {
      value = argument.substr(equals + 1);
    } else if (index + 1 < args.size() && args[index + 1] != nullptr &&
               !std::string_view(args[index + 1]).starts_with("--")) {
      value = args[++index];
    } else {
      command_line.error = std::string(flag->name) + " needs a value " + std::string(flag->value_name) + ", e.g. " +
                           std::string(flag->name) + " " + std::string(flag->example_value);
      return command_line;
    }
    const std::string problem = flag->apply(value, command_line.options);
    if (!problem.empty()) {
      command_line.error = std::string(flag->name) + " " + Quoted(value) + " " + problem + ", e.g. " +
                           std::string(flag->name) + " " + std::string(flag->example_value);
      return command_line;
    }
  }
  const Options& options = command_line.options;
  const auto given = [&seen](std::string_view name) {
    return seen[static_cast<std::size_t>(FindFlag(name) - kFlags.data())];
  };
  if (options.kernel_count && options.seconds) {
    command_line.error = "--kernels and --seconds exclude each other; give one, e.g. --seconds 2.5";
  } else if (!options.phases.empty() && (given("--kernel-us") || given("--rate"))) {
    command_line.error = std::string(given("--kernel-us") ? "--kernel-us" : "--rate") +
                         " and --phase exclude each other; give the kernels and the rate in each phase, "
                         "e.g. --phase kernels=1ms,rate=200";
  } else if (options.repeat && (options.phases.empty() || !options.seconds)) {
    command_line.error =
        "--repeat loops the phases until --seconds ends; give --phase and --seconds too, "
        "e.g. --phase kernels=1ms,for=1s --phase idle=1s --repeat --seconds 10";
  } else if (!options.phases.empty() && !options.seconds && !options.kernel_count) {
    for (const Phase& phase : options.phases) {
      if (!phase.idle && !phase.for_ns) {
        command_line.error =
            "--phase without for= runs until --seconds ends, but neither --seconds nor "
            "--kernels is given; give for=DURATION or --seconds S, e.g. "
            "--phase kernels=1ms,for=2s";
        break;
      }
    }
  }
  return command_line;
}

std::string UsageText() {
  std::string usage =
      "usage: vgpu-tenant [--device N] [--alloc BYTES] [--kernel-us D] [--blocks B] [--threads T]\n"
      "                   [--kernels K | --seconds S] [--rate HZ] [--depth Q] [--streams N] [--ptx FILE]\n"
      "                   [--phase SPEC]... [--repeat] [--seed N] [--report-ms N] [--churn SPEC]\n"
      "\n"
      "A GPU workload on the CUDA Driver API: launches the spin kernel vgpu_spin, each launch\n"
      "taking D microseconds of GPU time (the blocks spin for D divided by the number of waves\n"
      "in which the GPU can run B blocks), and prints one JSON line on stdout:\n"
      "  {\"pid\":..,\"device\":..,\"kernels\":..,\"kernel_us\":..,\"blocks\":..,\"elapsed_s\":..,\n"
      "   \"kernels_per_s\":..,\"busy_fraction\":..,\"busy_ns\":..,\"alloc_bytes\":..,\"status\":\"ok\"}\n"
      "elapsed_s runs from the first launch until the last kernel has finished; busy_fraction\n"
      "is kernels x D / elapsed (above 1 when kernels on several streams overlap); busy_ns is\n"
      "the sum of the durations of the kernels seen complete. With --phase, kernel_us is 0,\n"
      "blocks is --blocks and busy_fraction is busy_ns / elapsed.\n"
      "\n"
      "options (--name VALUE or --name=VALUE):\n";
  for (const FlagSpec& flag : kFlags) {
    usage += "  ";
    usage += flag.name;
    if (!flag.value_name.empty()) {
      usage += ' ';
      usage += flag.value_name;
    }
    usage += "\n        ";
    usage += flag.help;
    usage += '\n';
  }
  usage +=
      "  --help\n"
      "        print this text\n"
      "\n"
      "exit status: 0 done; 2 bad arguments (message on stderr); 3 a CUDA call failed (the JSON\n"
      "line then has \"status\":\"error\" with \"error\", the CUresult name, and \"call\", the function;\n"
      "\"status\":\"oom\" when it was --alloc's cuMemAlloc_v2 with CUDA_ERROR_OUT_OF_MEMORY, and\n"
      "alloc_bytes is then the size asked for).\n";
  return usage;
}

}  // namespace vgpu::tenant

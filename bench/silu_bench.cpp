// epcomm_silu_bench: every fused SiLU / SwiGLU kernel of epcomm/silu.h on one GPU, timed against
// its memory floor: floor = (bytes read + bytes written) / the device's copy rate (docs/results/2026-11-20_h200x8_anchors.md: 4260
// GB/s device-to-device on one H200; --copy-gbps), ratio = median / floor.
//
// Shapes. I = 2048 (DeepSeek-V3's expert intermediate size) and 2880 (gpt-oss), wherever the
// kernel's value group divides I (FP8's 128 does not divide 2880); 32768 routed rows (a prefill
// rank: 4096 tokens x top-8) and 1024 (a decode rank: 128 x 8) in G = 32 groups of random sizes
// within about 25% of the mean; FP8's groups padded to a multiple of 4, as its dispatch pads them.
// max_rows is the row count itself, so every output byte is one the kernel writes. Inputs are
// random bf16, never zero (reference::make_tokens), one set shared by every case.
//
// Bytes. Read: rows x 2I x 2 (gate and up; FP8's padding rows count, since without src_info they
// are ordinary rows). Written: bf16 rows x I x 2; FP8 codes rows x I + fp32 scales rows x I/128
// x 4; MXFP4 codes rows x I/2 + e8m0 scales rows x I/32; NVFP4 codes rows x I/2 + the whole
// swizzled scale array (written on every call) + scales_offsets G x 4. row_offsets and the
// global scales (a few hundred bytes) are not counted.
//
// Timing (docs/results/method.md): an event pair around each call, warm-up calls first, the L2 flushed by a
// memset of 4x its size before each timed call, outside the event pair; median, min and max.
//
// Check: each case's output once, bit for bit, as the first check of tests/gpu/test_silu.cu does:
// z evaluated on the device (reference::silu_values_device: the device's expf, which may differ
// from the host's in the last bit), encoded by the CPU reference's encoders
// (reference::quantize_grouped_rows; float_to_bf16 for bf16), must equal every code, scale and
// scales_offsets entry. The outputs are poisoned first, so a byte left unwritten fails too. The
// comparisons run on host threads after all timing, so that they cannot delay a launch.
//
// Exit status: 0 every check passed, 1 a check failed, 2 an error stopped the run.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "epcomm/bf16.h"
#include "epcomm/formats/reference_codecs.h"
#include "epcomm/formats/reference_silu.h"
#include "epcomm/formats/scale_layouts.h"
#include "epcomm/reference.h"
#include "epcomm/silu.h"
#include "json.h"
#include "timing.h"

namespace epbench {
namespace {

namespace ref = epcomm::reference;
using ref::QuantFormat;
using ref::QuantOutputShape;

constexpr int kDevice = 0;
constexpr int32_t kGroups = 32;
constexpr int32_t kInters[] = {2048, 2880};
constexpr int64_t kRoutedRows[] = {32768, 1024};
// |z| < 4 for |gate|, |up| < 2, so amax * gs stays under NVFP4's 448 * 6.
constexpr float kNvfp4GlobalScale = 448.0f * 6.0f / 4.0f;
const epcomm::SwigluClamp kGptOssClamp{7.0f, 1.702f};

const char* kUsage = R"(usage: epcomm_silu_bench [options]
Times every fused SiLU / SwiGLU kernel (epcomm/silu.h) on GPU 0 against its memory floor,
(bytes read + bytes written) / copy rate, and checks each output against the CPU reference.

  --iters N         timed iterations (default 100)
  --warmup N        warm-up iterations (default 10)
  --copy-gbps R     the device's measured copy rate in GB/s (default 4260, H200, docs/results/2026-11-20_h200x8_anchors.md)
  --json FILE       write every figure, with the GPU and commit, to FILE
)";

struct Options {
  int iters = 100;
  int warmup = 10;
  double copy_gbps = 4260;
  std::string json_path;
};

Options parse_options(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) throw std::invalid_argument("unknown option or no value: '" + flag + "'");
    const std::string value = argv[++i];
    if (flag == "--iters") {
      opt.iters = parse_int(flag, value, 1);
    } else if (flag == "--warmup") {
      opt.warmup = parse_int(flag, value, 0);
    } else if (flag == "--copy-gbps") {
      char* end = nullptr;
      opt.copy_gbps = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !(opt.copy_gbps > 0))
        throw std::invalid_argument("--copy-gbps: expected a positive number, got '" + value + "'");
    } else if (flag == "--json") {
      opt.json_path = value;
    } else {
      throw std::invalid_argument("unknown option '" + flag + "' (see --help)");
    }
  }
  return opt;
}

// One entry point of epcomm/silu.h as the bench calls it.
struct Kernel {
  const char* name;
  std::optional<QuantFormat> format;  // none: bf16 output
  bool interleaved = false;
  const epcomm::SwigluClamp* clamp = nullptr;
};
const Kernel kKernels[] = {
    {"bf16", std::nullopt},                                       // silu_bf16
    {"fp8", QuantFormat::kFp8Blockwise},                          // silu_fp8, no src_info
    {"nvfp4", QuantFormat::kNvfp4},                               // silu_nvfp4
    {"nvfp4 interleaved", QuantFormat::kNvfp4, true},             // silu_nvfp4, interleaved
    {"mxfp4", QuantFormat::kMxfp4},                               // silu_mxfp4
    {"mxfp4 swiglu", QuantFormat::kMxfp4, false, &kGptOssClamp},  // silu_mxfp4, gpt-oss clamp
};

// I must be a multiple of this (silu.h): one 16-byte vector for bf16, else the scale group.
int32_t value_group(const Kernel& k) {
  return k.format ? QuantOutputShape{*k.format, 0, 0, 0}.group() : 8;
}

// `rows` rows in kGroups groups, each of rows / kGroups x [0.75, 1.25) rows (then normalised).
std::vector<int32_t> group_counts(int64_t rows, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> weight(0.75, 1.25);
  std::vector<double> w(kGroups);
  double sum = 0;
  for (double& v : w) {
    v = weight(rng);
    sum += v;
  }
  std::vector<int32_t> counts(kGroups);
  int64_t total = 0;
  for (int32_t g = 0; g < kGroups; ++g) {
    counts[size_t(g)] = int32_t(double(rows) * w[size_t(g)] / sum);
    total += counts[size_t(g)];
  }
  counts[0] += int32_t(rows - total);  // the rounding remainder, fewer than kGroups rows
  return counts;
}

// One kernel's outputs for one case; what the host downloads of them has the same fields.
template <template <class> class Array>
struct Outputs {
  Array<uint8_t> codes;            // bf16: the [rows, I] output
  Array<uint8_t> scales;           // FP8: fp32
  Array<uint32_t> scales_offsets;  // NVFP4 only
};
template <class T>
using HostArray = std::vector<T>;

struct Case {
  const Kernel* kernel;
  int32_t inter;
  std::vector<uint32_t> row_offsets;  // [kGroups + 1], FP8's padding included
  int64_t rows() const { return int64_t(row_offsets.back()); }
  ref::GateUpLayout layout() const {
    return kernel->interleaved ? ref::GateUpLayout::kInterleaved : ref::GateUpLayout::kSplit;
  }
  std::optional<QuantOutputShape> shape() const {
    if (!kernel->format) return std::nullopt;
    return QuantOutputShape{*kernel->format, inter, kGroups, rows()};
  }
  int64_t bytes_read() const { return rows() * 2 * inter * 2; }
};

Outputs<DeviceArray> allocate(const Case& c) {
  const std::optional<QuantOutputShape> s = c.shape();
  if (!s) return {DeviceArray<uint8_t>(kDevice, size_t(c.rows() * c.inter * 2)), {}, {}};
  return {DeviceArray<uint8_t>(kDevice, size_t(s->codes_size())),
          DeviceArray<uint8_t>(kDevice, size_t(s->layout().scales_bytes())),
          DeviceArray<uint32_t>(kDevice, s->swizzled() ? size_t(kGroups) : 0)};
}

void poison(const Outputs<DeviceArray>& out, cudaStream_t stream) {
  const auto fill = [&](void* p, size_t bytes) {
    if (bytes > 0) CHECK_CUDA(cudaMemsetAsync(p, 0xff, bytes, stream));
  };
  fill(out.codes.get(), out.codes.size());
  fill(out.scales.get(), out.scales.size());
  fill(out.scales_offsets.get(), out.scales_offsets.size() * sizeof(uint32_t));
}

void launch(const Case& c, const epcomm::SiluInput& in, const Outputs<DeviceArray>& out,
            const float* global_scales, cudaStream_t stream) {
  const Kernel& k = *c.kernel;
  if (!k.format) return epcomm::silu_bf16(in, out.codes.get(), stream);
  switch (*k.format) {
    case QuantFormat::kFp8Blockwise:
      return epcomm::silu_fp8(in, {out.codes.get(), reinterpret_cast<float*>(out.scales.get())},
                              stream);
    case QuantFormat::kNvfp4:
      return epcomm::silu_nvfp4(in, {out.codes.get(), out.scales.get(), out.scales_offsets.get()},
                                global_scales, k.interleaved, stream);
    default:
      return epcomm::silu_mxfp4(in, {out.codes.get(), out.scales.get()}, k.clamp, stream);
  }
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

// "" when got and want are equal, else how many entries differ and the first.
template <class T>
std::string compare(const char* what, const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size())
    return std::string(what) + ": " + std::to_string(got.size()) + " entries, the reference " +
           std::to_string(want.size()) + "; ";
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(got[i] == want[i]) && bad++ == 0) first = i;
  if (bad == 0) return "";
  return std::string(what) + ": " + std::to_string(bad) + " of " + std::to_string(got.size()) +
         " differ, first [" + std::to_string(first) + "] got " + num(double(got[first])) +
         ", reference " + num(double(want[first])) + "; ";
}

template <class T>
std::vector<T> reinterpret(const std::vector<uint8_t>& bytes) {
  std::vector<T> v(bytes.size() / sizeof(T));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(T));
  return v;
}

// The check described at the top, given the device's z of the case's rows: "" on a pass, else
// what differs.
std::string check(const Case& c, const std::vector<float>& z, const Outputs<HostArray>& got) {
  const std::optional<QuantOutputShape> shape = c.shape();
  if (!shape) {
    std::vector<uint16_t> want(z.size());
    std::transform(z.begin(), z.end(), want.begin(), epcomm::float_to_bf16);
    return compare("values", reinterpret<uint16_t>(got.codes), want);
  }
  const bool nvfp4 = shape->format == QuantFormat::kNvfp4;
  const ref::QuantizedRows want = ref::quantize_grouped_rows(
      *shape, z.data(), c.row_offsets,
      nvfp4 ? std::vector<float>(kGroups, kNvfp4GlobalScale) : std::vector<float>(), nullptr);
  std::string err = compare("codes", got.codes, want.codes);
  if (shape->format == QuantFormat::kFp8Blockwise) {
    err += compare("scales", reinterpret<float>(got.scales), want.fp8_scales);
  } else {
    err += compare("scales", got.scales, want.scales);
  }
  return err + compare("scales_offsets", got.scales_offsets, want.scales_offsets);
}

struct Result {
  std::string kernel;
  int32_t inter = 0;
  int64_t rows = 0;
  std::string skipped;  // why it did not run; empty if it ran
  double bytes_read = 0, bytes_written = 0;
  Stats stats;
  double floor_us = 0;
  std::string check;  // empty: passed
  double bytes() const { return bytes_read + bytes_written; }
  double ratio() const { return stats.median_us / floor_us; }
  double gbps() const { return bytes() / stats.median_us * 1e-3; }  // bytes/us -> GB/s
};

Stats time_calls(const std::function<void()>& call, cudaStream_t stream, L2Flush& flush,
                 Events& events, const Options& opt) {
  for (int i = 0; i < opt.warmup; ++i)
    call();
  for (int i = 0; i < opt.iters; ++i) {
    flush.run(0, stream);
    events.record(2 * i, stream);
    call();
    events.record(2 * i + 1, stream);
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<float> us(size_t(opt.iters));
  for (int i = 0; i < opt.iters; ++i)
    us[size_t(i)] = events.elapsed_us(2 * i, 2 * i + 1);
  return summarize(us);
}

void print_table(const std::vector<Result>& results) {
  std::printf("%-18s %5s %6s %9s %9s %9s %9s %9s %6s %7s  %s\n", "kernel", "I", "rows", "MB",
              "median", "min", "max", "floor", "ratio", "GB/s", "check");
  for (const Result& r : results) {
    std::printf("%-18s %5d %6lld ", r.kernel.c_str(), r.inter, static_cast<long long>(r.rows));
    if (!r.skipped.empty()) {
      std::printf("skipped: %s\n", r.skipped.c_str());
      continue;
    }
    std::printf("%9.2f %9.1f %9.1f %9.1f %9.1f %6.2f %7.0f  %s\n", r.bytes() / 1e6,
                r.stats.median_us, r.stats.min_us, r.stats.max_us, r.floor_us, r.ratio(), r.gbps(),
                r.check.empty() ? "PASS" : ("FAIL: " + r.check).c_str());
  }
}

void write_json(const std::string& path, const std::string& gpu, const Options& opt,
                size_t flush_bytes, const std::vector<Result>& results) {
  std::ofstream os(path);
  if (!os) throw std::runtime_error("cannot write " + path);
  JsonWriter j(os);
  j.begin_object();
  j.value("gpu", gpu);
  j.value("commit", git_commit());
  j.value("date", utc_now());
  j.value("iters", opt.iters);
  j.value("warmup", opt.warmup);
  j.value("timing", "an event pair per call; the L2 flushed by a memset before each timed call");
  j.value("l2_flush_bytes", double(flush_bytes));
  j.value("copy_gbps", opt.copy_gbps);
  j.value("floor_definition", "(bytes_read + bytes_written) / copy_gbps");
  j.begin_array("results");
  for (const Result& r : results) {
    j.begin_object();
    j.value("kernel", r.kernel);
    j.value("intermediate", r.inter);
    j.value("rows", double(r.rows));
    j.value("groups", kGroups);
    j.value("ran", r.skipped.empty());
    if (!r.skipped.empty()) {
      j.value("skipped", r.skipped);
    } else {
      j.value("bytes_read", r.bytes_read);
      j.value("bytes_written", r.bytes_written);
      j.value("median_us", r.stats.median_us);
      j.value("min_us", r.stats.min_us);
      j.value("max_us", r.stats.max_us);
      j.value("floor_us", r.floor_us);
      j.value("ratio", r.ratio());
      j.value("gbps", r.gbps());
      j.value("check_pass", r.check.empty());
      if (!r.check.empty()) j.value("check_detail", r.check);
    }
    j.end_object();
  }
  j.end_array();
  j.end_object();
  os << '\n';
  if (!os) throw std::runtime_error("error writing " + path);
}

int run(const Options& opt) {
  set_device(kDevice);
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, kDevice));
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  epcomm::load_silu_kernels();
  L2Flush flush(std::vector<int>{kDevice});
  Events events(kDevice, 2 * opt.iters);
  std::printf(
      "epcomm_silu_bench  %s  commit %s  %s\n%d timed iterations after %d warm-up; L2 flushed by "
      "a %.0f MiB memset before every timed call. floor = bytes / %.0f GB/s; ratio = median / "
      "floor; times in us.\n\n",
      prop.name, git_commit().c_str(), utc_now().c_str(), opt.iters, opt.warmup,
      double(flush.bytes()) / (1 << 20), opt.copy_gbps);
  std::fflush(stdout);

  // One input for every case: the largest [rows, 2I] (FP8's padding needs at most 3 rows a group).
  std::mt19937_64 rng(2024);
  const DeviceArray<uint16_t> d_x(
      kDevice, ref::make_tokens((kRoutedRows[0] + 3 * kGroups) * 2 * kInters[1], rng));
  const DeviceArray<float> d_global_scales(kDevice, std::vector<float>(kGroups, kNvfp4GlobalScale));

  std::vector<Result> results;
  std::vector<std::function<std::string()>> checks;  // one per result that ran
  for (int64_t routed : kRoutedRows) {
    const std::vector<int32_t> counts = group_counts(routed, rng);
    for (int32_t inter : kInters) {
      for (const Kernel& k : kKernels) {
        Result r;
        r.kernel = k.name;
        r.inter = inter;
        r.rows = routed;
        if (inter % value_group(k) != 0) {
          r.skipped = "I is not a multiple of " + std::to_string(value_group(k));
          results.push_back(r);
          continue;
        }
        Case c{&k, inter, std::vector<uint32_t>(kGroups + 1)};
        const std::optional<QuantOutputShape> shape = c.shape();
        epcomm::padded_row_offsets(counts.data(), kGroups, shape ? shape->row_align() : 1,
                                   c.row_offsets.data());
        r.rows = c.rows();
        const DeviceArray<uint32_t> d_offsets(kDevice, c.row_offsets);
        const Outputs<DeviceArray> out = allocate(c);
        epcomm::SiluInput in;
        in.x = d_x.get();
        in.row_offsets = d_offsets.get();
        in.groups = kGroups;
        in.intermediate = inter;
        in.max_rows = c.rows();
        const auto call = [&] { launch(c, in, out, d_global_scales.get(), stream); };

        // The checked call, on poisoned outputs, and the device's z of the same rows.
        poison(out, stream);
        call();
        const DeviceArray<float> d_z(kDevice, size_t(c.rows() * inter));
        ref::silu_values_device(d_x.get(), c.rows(), inter, c.layout(), k.clamp, d_z.get(), stream);
        CHECK_CUDA(cudaStreamSynchronize(stream));
        Outputs<HostArray> got{out.codes.download(out.codes.size()),
                               out.scales.download(out.scales.size()),
                               out.scales_offsets.download(out.scales_offsets.size())};
        checks.push_back(
            [c, z = d_z.download(d_z.size()), got = std::move(got)] { return check(c, z, got); });

        r.stats = time_calls(call, stream, flush, events, opt);
        r.bytes_read = double(c.bytes_read());
        r.bytes_written = double(out.codes.size() + out.scales.size() +
                                 out.scales_offsets.size() * sizeof(uint32_t));
        r.floor_us = r.bytes() / (opt.copy_gbps * 1e3);  // GB/s = 1e3 bytes/us
        results.push_back(r);
      }
    }
  }
  CHECK_CUDA(cudaStreamDestroy(stream));

  std::vector<std::future<std::string>> verdicts;
  for (auto& job : checks)
    verdicts.push_back(std::async(std::launch::async, std::move(job)));
  bool failed = false;
  size_t next = 0;
  for (Result& r : results) {
    if (!r.skipped.empty()) continue;
    r.check = verdicts[next++].get();
    failed = failed || !r.check.empty();
  }
  print_table(results);
  if (!opt.json_path.empty()) {
    write_json(opt.json_path, prop.name, opt, flush.bytes(), results);
    std::fprintf(stderr, "[epcomm_silu_bench] wrote %s\n", opt.json_path.c_str());
  }
  std::printf("\n%s\n", failed ? "FAIL: a check failed" : "all checks passed");
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace epbench

int main(int argc, char** argv) {
  try {
    return epbench::run(epbench::parse_options(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\nepcomm_silu_bench: error: %s\n", e.what());
    return 2;
  }
}

// parse_activity_buffer on activity buffers laid out with CUPTI's own record structs and walked by libcupti's own
// cuptiActivityGetNextRecord. The walker steps by each kind's record size in the loaded CUPTI, so it is the oracle
// for the layout: a struct of another version would misplace every later record. It needs neither driver nor GPU
// (checked with CUDA 13.0's libcupti, API 130001, on a machine with neither), so these run everywhere CUDA builds.
// CUDA builds only: they need CUPTI's headers.
#include <catch2/catch.hpp>
#include <cupti_activity.h>
#include <cupti_version.h>
#include <dlfcn.h>

#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "profiler/cupti_parse.h"

namespace {

sbp::CuptiNextRecordFn libcupti_walker() {
  // libtorch_cpu NEEDs libcupti.so.<major>, so this returns the copy already in the process.
  static const sbp::CuptiNextRecordFn next = [] {
    const std::string soname = "libcupti.so." + std::to_string(CUPTI_API_VERSION / 10000);
    void* library = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
    return library ? reinterpret_cast<sbp::CuptiNextRecordFn>(dlsym(library, "cuptiActivityGetNextRecord"))
                   : nullptr;
  }();
  return next;
}

// An activity buffer as CUPTI hands it over: records back to back, each its struct's size, 8-byte aligned.
class ActivityBuffer {
 public:
  template <typename Record>
  ActivityBuffer& add(const Record& record) {
    static_assert(sizeof(Record) % sizeof(std::uint64_t) == 0, "CUPTI pads every record to 8 bytes");
    const std::size_t at = words_.size();
    words_.resize(at + sizeof(Record) / sizeof(std::uint64_t));
    std::memcpy(&words_[at], &record, sizeof(Record));
    return *this;
  }
  const std::uint8_t* data() const { return reinterpret_cast<const std::uint8_t*>(words_.data()); }
  std::size_t valid_size() const { return words_.size() * sizeof(std::uint64_t); }

 private:
  std::vector<std::uint64_t> words_;
};

void parse_into(const ActivityBuffer& buffer, sbp::CuptiRecording& recording) {
  const sbp::CuptiNextRecordFn next = libcupti_walker();
  REQUIRE(next != nullptr);  // libcupti.so.13 ships with the CUDA toolkit and with torch's CUDA wheel
  sbp::parse_activity_buffer(buffer.data(), buffer.valid_size(), next, recording);
}

sbp::CuptiRecording parse(const ActivityBuffer& buffer) {
  sbp::CuptiRecording recording;
  parse_into(buffer, recording);
  return recording;
}

CUpti_ActivityMemory4 memory(CUpti_ActivityMemoryOperationType operation, CUpti_ActivityMemoryKind memory_kind,
                             std::uint64_t address, std::uint64_t bytes, std::uint64_t timestamp,
                             std::uint32_t device = 0) {
  CUpti_ActivityMemory4 m{};
  m.kind = CUPTI_ACTIVITY_KIND_MEMORY2;
  m.memoryOperationType = operation;
  m.memoryKind = memory_kind;
  m.address = address;
  m.bytes = bytes;
  m.timestamp = timestamp;
  m.deviceId = device;
  return m;
}

CUpti_ActivityMemory4 device_alloc(std::uint64_t address, std::uint64_t bytes, std::uint64_t timestamp) {
  return memory(CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_ALLOCATION, CUPTI_ACTIVITY_MEMORY_KIND_DEVICE, address, bytes,
                timestamp);
}

CUpti_ActivityMemcpy6 memcpy_record(CUpti_ActivityMemcpyKind copy_kind, std::uint64_t bytes, std::uint64_t start,
                                    std::uint64_t end, std::uint32_t device = 0) {
  CUpti_ActivityMemcpy6 c{};
  c.kind = CUPTI_ACTIVITY_KIND_MEMCPY;
  c.copyKind = static_cast<std::uint8_t>(copy_kind);
  c.bytes = bytes;
  c.start = start;
  c.end = end;
  c.deviceId = device;
  c.copyCount = 1;
  return c;
}

CUpti_ActivityKernel10 kernel(const char* name, std::uint64_t start, std::uint64_t end, std::uint32_t device = 0) {
  CUpti_ActivityKernel10 k{};
  k.kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
  k.name = name;
  k.start = start;
  k.end = end;
  k.deviceId = device;
  return k;
}

CUpti_ActivityMemoryPool3 pool(CUpti_ActivityMemoryPoolOperationType operation, std::uint64_t address,
                               std::uint64_t size, std::uint64_t timestamp, std::uint32_t device = 0) {
  CUpti_ActivityMemoryPool3 p{};
  p.kind = CUPTI_ACTIVITY_KIND_MEMORY_POOL;
  p.memoryPoolOperationType = operation;
  p.address = address;
  p.size = size;
  p.timestamp = timestamp;
  p.deviceId = device;
  return p;
}

void check_record(const sbp::CuptiRecord& r, const sbp::CuptiRecord& expected) {
  INFO("expected " << sbp::cupti_kind_name(expected.kind) << ' ' << expected.name << " at " << expected.start_ns);
  CHECK(r.kind == expected.kind);
  CHECK(r.name == expected.name);
  CHECK(r.start_ns == expected.start_ns);
  CHECK(r.end_ns == expected.end_ns);
  CHECK(r.bytes == expected.bytes);
  CHECK(r.address == expected.address);
  CHECK(r.device == expected.device);
}

constexpr std::uint64_t kBlock = 0x7f0000000000;
constexpr std::int64_t kMiB = 1 << 20;

// at::native's fill kernel, as CUPTI names it, and what c++filt makes of it.
constexpr const char* kFillKernelMangled =
    "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEENS_6detail5ArrayIPcLi1EEEEEviT0_T1_";
constexpr const char* kFillKernel =
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, 1> >"
    "(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)";

}  // namespace

TEST_CASE("libcupti's own record walker runs without a driver (cupti)", "[cupti]") {
  // Everything below relies on it; if a later CUPTI needs a driver even for this, the tests need their own walker.
  ActivityBuffer buffer;
  buffer.add(device_alloc(kBlock, kMiB, 1000)).add(kernel(kFillKernelMangled, 1100, 1200));
  const sbp::CuptiRecording recording = parse(buffer);
  CHECK(recording.records.size() == 2);
  CHECK(recording.unreadable_buffers == 0);
}

TEST_CASE("cupti parse_activity_buffer reads CUPTI's memory, pool, memcpy and kernel structs", "[cupti]") {
  ActivityBuffer buffer;
  buffer.add(device_alloc(kBlock, kMiB, 1000))
      .add(memcpy_record(CUPTI_ACTIVITY_MEMCPY_KIND_HTOD, 4096, 1100, 1300))
      .add(kernel(kFillKernelMangled, 1400, 2400))
      .add(pool(CUPTI_ACTIVITY_MEMORY_POOL_OPERATION_TYPE_CREATED, 0x5000, 2 * kMiB, 2500, 1))
      .add(pool(CUPTI_ACTIVITY_MEMORY_POOL_OPERATION_TYPE_DESTROYED, 0x5000, 2 * kMiB, 2600, 1))
      .add(memory(CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_RELEASE, CUPTI_ACTIVITY_MEMORY_KIND_DEVICE, kBlock, kMiB, 3000))
      .add(memory(CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_ALLOCATION, CUPTI_ACTIVITY_MEMORY_KIND_PINNED, 0x9000, 65536,
                  3100));
  const sbp::CuptiRecording recording = parse(buffer);
  CHECK(recording.unconverted_records == 0);
  CHECK(recording.unreadable_buffers == 0);
  CHECK(recording.dropped_records == 0);  // the caller's to add, from libcupti
  const std::vector<sbp::CuptiRecord> expected = {
      {sbp::CuptiKind::memory, "device", 1000, 1000, kMiB, static_cast<std::int64_t>(kBlock), 0},  // allocation: +size
      {sbp::CuptiKind::memcpy, "HtoD", 1100, 1300, 4096, 0, 0},
      {sbp::CuptiKind::kernel, kFillKernel, 1400, 2400, 0, 0, 0},
      {sbp::CuptiKind::memory_pool, "created", 2500, 2500, 2 * kMiB, 0x5000, 1},
      {sbp::CuptiKind::memory_pool, "destroyed", 2600, 2600, 0, 0x5000, 1},  // a destroyed pool holds nothing
      {sbp::CuptiKind::memory, "device", 3000, 3000, -kMiB, static_cast<std::int64_t>(kBlock), 0},  // release: -size
      {sbp::CuptiKind::memory, "pinned", 3100, 3100, 65536, 0x9000, 0},
  };
  REQUIRE(recording.records.size() == expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) check_record(recording.records[i], expected[i]);
}

TEST_CASE("cupti memcpy records are named by their copy kind and keep their bytes", "[cupti]") {
  const std::vector<std::pair<CUpti_ActivityMemcpyKind, std::string>> kinds = {
      {CUPTI_ACTIVITY_MEMCPY_KIND_HTOD, "HtoD"}, {CUPTI_ACTIVITY_MEMCPY_KIND_DTOH, "DtoH"},
      {CUPTI_ACTIVITY_MEMCPY_KIND_HTOA, "HtoA"}, {CUPTI_ACTIVITY_MEMCPY_KIND_ATOH, "AtoH"},
      {CUPTI_ACTIVITY_MEMCPY_KIND_ATOA, "AtoA"}, {CUPTI_ACTIVITY_MEMCPY_KIND_ATOD, "AtoD"},
      {CUPTI_ACTIVITY_MEMCPY_KIND_DTOA, "DtoA"}, {CUPTI_ACTIVITY_MEMCPY_KIND_DTOD, "DtoD"},
      {CUPTI_ACTIVITY_MEMCPY_KIND_HTOH, "HtoH"}, {CUPTI_ACTIVITY_MEMCPY_KIND_PTOP, "PtoP"},
      {CUPTI_ACTIVITY_MEMCPY_KIND_UNKNOWN, "unknown"}};
  ActivityBuffer buffer;
  for (std::size_t i = 0; i < kinds.size(); ++i)
    buffer.add(memcpy_record(kinds[i].first, 1000 + i, 100 * i + 10, 100 * i + 50, 2));
  const sbp::CuptiRecording recording = parse(buffer);
  REQUIRE(recording.records.size() == kinds.size());
  for (std::size_t i = 0; i < kinds.size(); ++i)
    check_record(recording.records[i], {sbp::CuptiKind::memcpy, kinds[i].second, 100 * i + 10, 100 * i + 50,
                                        static_cast<std::int64_t>(1000 + i), 0, 2});
}

TEST_CASE("cupti kernel names are demangled, a C name is kept and a missing one is 'unknown'", "[cupti]") {
  ActivityBuffer buffer;
  buffer.add(kernel("_Z6vecAddPfS_S_i", 10, 20)).add(kernel("relu_kernel", 30, 40)).add(kernel(nullptr, 50, 60));
  const sbp::CuptiRecording recording = parse(buffer);
  REQUIRE(recording.records.size() == 3);
  CHECK(recording.records[0].name == "vecAdd(float*, float*, float*, int)");
  CHECK(recording.records[1].name == "relu_kernel");
  CHECK(recording.records[2].name == "unknown");
}

TEST_CASE("cupti records parse_activity_buffer does not convert are counted, and the walk goes on", "[cupti]") {
  CUpti_ActivityMemset4 memset_record{};  // a kind the recorder does not enable; another CUPTI client might
  memset_record.kind = CUPTI_ACTIVITY_KIND_MEMSET;
  memset_record.bytes = 512;
  memset_record.start = 10;
  memset_record.end = 20;
  ActivityBuffer buffer;
  buffer.add(memset_record)
      .add(memory(CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_INVALID, CUPTI_ACTIVITY_MEMORY_KIND_DEVICE, kBlock, kMiB, 30))
      .add(kernel(kFillKernelMangled, 0, 0))                          // untimed: CUPTI ran out of device memory
      .add(memcpy_record(CUPTI_ACTIVITY_MEMCPY_KIND_DTOH, 64, 0, 0))  // untimed
      .add(device_alloc(kBlock, kMiB, 40));
  const sbp::CuptiRecording recording = parse(buffer);
  CHECK(recording.unconverted_records == 4);
  CHECK(recording.unreadable_buffers == 0);
  REQUIRE(recording.records.size() == 1);
  check_record(recording.records[0], {sbp::CuptiKind::memory, "device", 40, 40, kMiB, static_cast<std::int64_t>(kBlock), 0});
}

TEST_CASE("a cupti buffer the walker rejects counts as unreadable and keeps the records before the bad one",
          "[cupti]") {
  CUpti_ActivityMemory4 invalid = device_alloc(kBlock + kMiB, kMiB, 20);
  invalid.kind = CUPTI_ACTIVITY_KIND_INVALID;  // what a torn or foreign record looks like to the walker
  ActivityBuffer buffer;
  buffer.add(device_alloc(kBlock, kMiB, 10)).add(invalid).add(device_alloc(kBlock + 2 * kMiB, kMiB, 30));
  const sbp::CuptiRecording recording = parse(buffer);
  CHECK(recording.unreadable_buffers == 1);
  CHECK(recording.unconverted_records == 0);  // the rest of the buffer cannot be counted, only the buffer
  REQUIRE(recording.records.size() == 1);
  CHECK(recording.records[0].start_ns == 10);
}

TEST_CASE("cupti buffers add up in one recording, and an empty buffer adds nothing", "[cupti]") {
  sbp::CuptiRecording recording;
  ActivityBuffer unused;
  unused.add(device_alloc(kBlock, kMiB, 5));
  REQUIRE(libcupti_walker() != nullptr);
  sbp::parse_activity_buffer(unused.data(), 0, libcupti_walker(), recording);  // CUPTI may complete a buffer unused
  CHECK(recording.records.empty());
  CHECK(recording.unreadable_buffers == 0);  // it ends the normal way

  CUpti_ActivityMemset4 memset_record{};
  memset_record.kind = CUPTI_ACTIVITY_KIND_MEMSET;
  ActivityBuffer first, second;
  first.add(device_alloc(kBlock, kMiB, 10)).add(memset_record);
  second.add(memset_record).add(memory(CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_RELEASE, CUPTI_ACTIVITY_MEMORY_KIND_DEVICE,
                                kBlock, kMiB, 20));
  parse_into(first, recording);
  parse_into(second, recording);
  CHECK(recording.unconverted_records == 2);
  REQUIRE(recording.records.size() == 2);
  CHECK(recording.records[0].bytes == kMiB);
  CHECK(recording.records[1].bytes == -kMiB);
}

TEST_CASE("a cupti buffer becomes the CPU meter's timeline CSV", "[cupti]") {
  // A block from before the recording released first, then an allocation whose copy-in and kernel follow.
  ActivityBuffer buffer;
  buffer.add(memory(CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_RELEASE, CUPTI_ACTIVITY_MEMORY_KIND_DEVICE, 0x1000, 512, 500))
      .add(device_alloc(kBlock, kMiB, 1000))
      .add(memcpy_record(CUPTI_ACTIVITY_MEMCPY_KIND_HTOD, kMiB, 1100, 1900))
      .add(kernel(kFillKernelMangled, 2000, 3000))
      .add(memory(CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_RELEASE, CUPTI_ACTIVITY_MEMORY_KIND_DEVICE, kBlock, kMiB,
                  3500));
  const sbp::CuptiTimeline timeline = sbp::cupti_memory_timeline(parse(buffer).records, 0);
  CHECK(timeline.origin_ns == 500);
  CHECK(timeline.bytes_before == 512);
  std::ostringstream csv;
  sbp::write_timeline_csv(timeline.events, csv);
  CHECK(csv.str() ==
        "seconds,current_bytes,phase,block,delta_bytes\n"
        "0,512,,0,0\n"
        "0,0,,4096,-512\n"
        "5e-07,1048576,,139637976727552,1048576\n"
        "3e-06,0,,139637976727552,-1048576\n");
}

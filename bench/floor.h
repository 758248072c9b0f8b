// --floor: kernels that move exactly the HBM bytes one rank's dispatch and combine must move,
// with the same number of blocks, so each operation's time can be set against a floor measured
// in the same run on the same SMs.
//
// How the bytes are counted (per rank):
//   dispatch  each message (source token, this rank) read once as bf16 (2H bytes), and written
//             to each of its expert-major rows: codes (format_row_bytes) + scales
//             (format_scales_per_row * scale bytes, rounded up to 16).
//   combine   each unmasked (token, k) expert row read once (2H bytes), one bf16 row of 2H
//             written per token (the weighted fp32 sum).
// Nothing else: no headers, no staging buffer, no signals. Each floor comes in several variants
// and the fastest one counts, so that the floor is the best this benchmark can make it:
//   pinned   (pin<threads>x<blocks per SM>u<depth>) a sweep of launch shapes on exactly the
//            given SMs: the grid is blocks-per-SM x every SM of the GPU, blocks on SMs >= N exit
//            at once, and the warps of the others take messages (tokens) one at a time from a
//            counter, so several blocks of up to 1024 threads may share an SM, each lane with
//            <depth> vectors (dispatch) or 8 rows (r4: 4) x <depth> vectors (combine) in
//            flight. One block per SM, as the fixed variants below run, leaves an SM half or a
//            quarter of the loads in flight it can hold.
//   regs     warps move rows through registers: dispatch 1024 threads per block, 8 vectors of a
//            row per lane in flight; combine 512 threads, 2 vectors of each of 8 rows (16
//            vectors per lane: faster than 1024 threads with one vector per row, 806 against
//            1277 us with 8 SMs on one H100).
//   regs-l2  the same, each row first put in flight to L2 whole by a bulk prefetch.
//   tma   bulk copies through shared memory (epcomm/detail/bulk.cuh): one lane per warp drives a
//         ring of slots; dispatch stores each slot to its rows with bulk stores, combine's lanes
//         each load one of the K rows' 1 KB pieces, and the warp sums them from shared memory
//         and stores from registers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

namespace epbench {

struct DispatchFloorArgs {
  const uint16_t* const* src = nullptr;  // [messages] bf16 token rows (2H bytes)
  const int32_t* first = nullptr;        // [messages + 1] message i's rows: rows[first[i]...]
  const int32_t* rows = nullptr;
  int32_t messages = 0;
  int32_t in_bytes = 0;     // 2H
  int32_t code_bytes = 0;   // per row, a multiple of 16
  int32_t scale_bytes = 0;  // per row, a multiple of 16 (0 for bf16)
  char* out = nullptr;      // [rows, code_bytes]
  char* scales = nullptr;   // [rows, scale_bytes]
  unsigned long long* pinned = nullptr;  // [2], zeroed once: the pinned variants' work counters
  int32_t first_sm = 0;  // the pinned variants run on SMs [first_sm, first_sm + sms)
};

struct CombineFloorArgs {
  const uint16_t* const* src = nullptr;  // [T, K] expert rows (2H bytes), null: masked
  const float* weights = nullptr;        // [T, K]
  int32_t tokens = 0, top_k = 0, hidden = 0;
  uint16_t* out = nullptr;  // [T, H]
  unsigned long long* pinned = nullptr;  // [2], zeroed once: the pinned variants' work counters
  int32_t first_sm = 0;  // the pinned variants run on SMs [first_sm, first_sm + sms)
};

struct FloorVariant {
  enum Kind { kRegs, kRegsL2, kTma, kPinned } kind = kRegs;
  int threads = 0, blocks_per_sm = 0, depth = 0;  // kPinned's launch shape
  int rows = 0;  // kPinned combine: 4 for the r4 shapes (4 rows' loads in flight), else 0 (8)
};
// One word, no spaces: "regs", "regs-l2", "tma", "pin1024x2u4", "pin256x2u4r4".
std::string floor_variant_name(const FloorVariant& v);
// Every variant of the dispatch (combine) floor; the pinned sweep too where `pinned` (each rank's
// SM range must lie on the GPU: ranks x SMs <= the GPU's SMs).
std::vector<FloorVariant> floor_variants(bool dispatch, bool pinned);

// Loads the floor kernels on the current device and sizes their shared memory, before any timed
// launch: CUDA loads a kernel at its first launch and waits for the device to go idle to do so,
// which would deadlock behind the benchmark's start gate.
void prepare_floor_kernels(int top_k, int hidden);
// Launch on the current device (after prepare_floor_kernels), on `sms` SMs: the fixed variants
// run one block per SM (sms blocks), the pinned ones their shape. Throws on a CUDA error.
void launch_dispatch_floor(const DispatchFloorArgs& a, const FloorVariant& v, int sms,
                           cudaStream_t stream);
void launch_combine_floor(const CombineFloorArgs& a, const FloorVariant& v, int sms,
                          cudaStream_t stream);

// The latency floor of a call (decode): what any kernel pays before it moves a byte. Launched
// like epcomm's kernels (cooperative, `blocks` x `threads`), after prepare_floor_kernels:
//   empty      the launch alone; every block returns at once.
//   roundtrip  the launch and one flag round trip around the local ranks, as epcomm signals:
//              local rank r's thread 0 stores seq (release, system scope) into the next rank's
//              flag, which lives on that rank's GPU, and polls its own flag (acquire) until it
//              reaches seq; the other threads return. seq = *calls + 1 (*calls counts the
//              rank's round trips, so the ranks agree on it without the host). A wait that
//              passes its bound (1 s) sets *failed and returns. With one local rank the flag
//              is its own: the launch and a store and load through its memory.
struct RoundTripArgs {
  unsigned long long* mine = nullptr;   // this rank's flag, on its GPU, zeroed once
  unsigned long long* next = nullptr;   // the next local rank's flag (peer memory on another GPU)
  unsigned long long* calls = nullptr;  // this rank's count, zeroed once
  int* failed = nullptr;                // zeroed once; 1 after a wait timed out
};
void launch_empty(int blocks, int threads, cudaStream_t stream);
void launch_roundtrip(const RoundTripArgs& a, int blocks, int threads, cudaStream_t stream);

}  // namespace epbench

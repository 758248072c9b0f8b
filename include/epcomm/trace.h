// Stage trace: where the time of a dispatch or combine goes, block by block (Config::trace).
//
// With Config::trace set, thread 0 of every block of the dispatch and combine kernels writes
// %globaltimer (ns) when its block passes each mark below; Group::stage_trace() reads back the
// marks of the last dispatch and the last combine of this rank. A form clears the marks it may
// set before stamping (the send form the send marks, the receive form the receive marks), so a
// mark a block did not pass reads 0. Meant for profiling: each mark costs one store per block.
#pragma once

#include <cstdint>
#include <vector>

#include "epcomm/hd.h"

namespace epcomm {

enum TraceKernel : int32_t { kTraceDispatch = 0, kTraceCombine = 1, kTraceKernels = 2 };

enum TraceMark : int32_t {
  // send half
  kTraceStart = 0,  // the kernel began (fused or send form)
  kTraceRanked,     // dispatch: this block's ranking units are done
  kTraceRouted,     // dispatch: the grid's ranking and scan are done (second grid barrier)
  kTraceAcked,      // every destination acknowledged the previous call
  kTraceMetaSent,   // dispatch: this block wrote its meta records (the writer blocks only)
  kTraceStored,     // low-latency dispatch: the block's warps issued their round's stores
  kTraceFenced,     // low-latency dispatch: thread 0's fence after them returned
  kTraceSent,       // this block's last store and signal are issued
  // receive half
  kTraceRecvStart,  // the block begins receiving (the wait form: kernel start)
  kTraceCountsIn,   // dispatch: every source's meta record acquired and read
  kTraceChecked,    // dispatch: the records checked (check_sources)
  kTraceReady,      // dispatch: every source's counts arrived, the layout is built;
                    // combine: every source's rows arrived
  kTraceDone,       // the block is done with this kernel
  kTraceMarks
};

const char* trace_mark_name(TraceMark m);

// Index of (kernel, mark, block) in the trace buffer of a group of `blocks` blocks per kernel.
EPCOMM_HD int64_t trace_index(int32_t kernel, int32_t mark, int32_t block,
                                     int32_t blocks) {
  return (int64_t(kernel) * kTraceMarks + mark) * blocks + block;
}
EPCOMM_HD int64_t trace_words(int32_t blocks) {
  return int64_t(kTraceKernels) * kTraceMarks * blocks;
}

// The marks of the last dispatch and combine: ns[trace_index(kernel, mark, block, blocks)].
struct StageTrace {
  int32_t blocks = 0;
  std::vector<uint64_t> ns;
  uint64_t at(int32_t kernel, int32_t mark, int32_t block) const {
    return ns[size_t(trace_index(kernel, mark, block, blocks))];
  }
};

}  // namespace epcomm

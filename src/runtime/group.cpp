// Set-up, teardown and the host side of every operation: argument checks, kernel parameters,
// and the device error record.
#include "epcomm/group.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <sstream>
#include <thread>

#include "epcomm/detail/epilogue_access.h"
#include "epcomm/detail/nvtx.h"
#include "kernels/kernels.h"
#include "runtime/nvshmem_host.h"

namespace epcomm {
namespace detail {

namespace {

struct PeerInfo {
  int32_t pid;
  int32_t device;
  int32_t resident_blocks;  // max_resident_blocks on this rank's GPU
  char host[64];
  char pci_bus_id[32];
  char uuid[16];
  void* window;
  cudaIpcMemHandle_t handle;
  Config cfg;

  bool same_host(const PeerInfo& o) const {
    return std::strncmp(host, o.host, sizeof(host)) == 0;
  }
  bool same_gpu(const PeerInfo& o) const {
    return same_host(o) && std::memcmp(uuid, o.uuid, sizeof(uuid)) == 0;
  }
  bool same_process(const PeerInfo& o) const { return same_host(o) && pid == o.pid; }
};

}  // namespace

struct GroupState {
  Config cfg;
  Sizes sizes;
  int rank = 0;
  int n_ranks = 0;
  int device = 0;
  Bootstrap* bootstrap = nullptr;             // multi-process: the caller's, outlives the group
  std::unique_ptr<Bootstrap> owned_bootstrap;  // one-process mode
  std::vector<int> local_devices;             // one-process mode: every device of the group
  char* window = nullptr;
  bool nvshmem_window = false;     // window (and outbox) from nvshmem_malloc: the group spans nodes
  std::vector<char*> ipc_windows;  // peers' windows opened through CUDA IPC
  LocalState* state = nullptr;
  char* scratch_mem = nullptr;
  RankScratch scratch{};
  DeviceErrorRecord* error_host = nullptr;
  unsigned long long* trace = nullptr;  // Config::trace
  GroupView view{};
  bool poisoned = false;
  bool joined = false;  // set-up completed on every rank (teardown then synchronises with peers)
  DispatchRecord last;     // the last completed dispatch (combine reduces for it)
  DispatchRecord pending;  // the dispatch_async waiting for its dispatch_wait
  bool async_dispatch_pending = false;
  bool async_combine_pending = false;
  int32_t async_combine_hidden = 0;  // the combine_async's CombineInput::hidden

  ~GroupState();
  void setup(const Config& config, Bootstrap& bs, int dev);
  void map_node(const std::vector<PeerInfo>& all, const PeerInfo& me, int dev);
  void map_nodes(Bootstrap& bs, const WindowLayout& wl);
  void publish_windows();
  std::vector<char*> windows;        // every rank's window as seen here (null: another node)
  char** window_rest_dev = nullptr;  // GroupView::window_rest
};

std::string rank_prefix(int rank) { return "epcomm rank " + std::to_string(rank) + ": "; }

namespace {

void check_setup(bool ok, int rank, const std::string& msg) {
  if (!ok) throw Error(ErrorCode::kSetup, rank_prefix(rank) + msg);
}

// What every kernel of rank `rank` knows about the group, but the pointers.
GroupView make_view(const Config& cfg, int n_ranks, int rank, const Sizes& sizes) {
  GroupView v{};
  v.route = cfg.route(n_ranks, rank);
  v.rank = v.route.view_rank();
  v.n_ranks = v.route.view_ranks();
  v.hidden = cfg.hidden;
  v.top_k = v.route.slots();
  v.n_experts = v.route.view_experts();
  v.n_local_div = Divisor(v.route.groups());  // n_experts = view_ranks * groups
  v.n_ranks_div = Divisor(v.n_ranks);
  v.n_parts_div = Divisor(detail::num_parts(v.hidden));
  v.max_tokens = cfg.max_tokens_per_rank;
  v.num_blocks = cfg.num_sms;
  v.format = cfg.format;
  v.nvfp4_global_scale = cfg.nvfp4_global_scale;
  v.fp8_pow2 = cfg.fp8_pow2_scales ? 1 : 0;
  v.low_latency = cfg.resolved_path() == DispatchPath::kLowLatency;
  v.routed_rows = sizes.max_routed_rows;
  v.capacity = cfg.padded_capacity;
  v.ue8m0 = cfg.fp8_ue8m0_scales ? 1 : 0;
  v.timeout_ns = (unsigned long long)(cfg.timeout_seconds * 1e9);
  v.ranks_per_node = v.n_ranks;  // one node until set-up finds otherwise
  v.window_layout = WindowLayout{v.n_ranks,    v.hidden, v.top_k,      v.n_experts,
                                 v.max_tokens, v.format, v.low_latency};
  return v;
}

// Ranks per node (NodeMap) from the gathered set-up records: Config::ranks_per_node where set
// (each declared node must then be one host), else the hosts' own: consecutive ranks, the same
// number on every host. The same answer or the same error on every rank.
int32_t ranks_per_node_of(const std::vector<PeerInfo>& all, const Config& cfg, int rank) {
  const int n = int(all.size());
  auto same_host = [&](int a, int b) { return all[size_t(a)].same_host(all[size_t(b)]); };
  int32_t rpn = cfg.ranks_per_node;
  if (rpn == 0) {
    rpn = 1;
    while (rpn < n && same_host(rpn, 0))
      ++rpn;
    for (int r = 0; r < n; ++r)
      check_setup(
          n % rpn == 0 && same_host(r, r / rpn * rpn) &&
              [&] {  // a node's first rank: no earlier node on its host
                for (int q = 0; q < r && r % rpn == 0; q += rpn)
                  if (same_host(q, r)) return false;
                return true;
              }(),
          rank,
          "rank " + std::to_string(r) + " (host " + all[size_t(r)].host +
              ") breaks the placement by node: ranks of one host must be consecutive, "
              "the same number on every host (" +
              std::to_string(rpn) + " on host " + all[0].host + ")");
  }
  for (int r = 0; r < n; ++r)
    check_setup(same_host(r, r / rpn * rpn), rank,
                "ranks " + std::to_string(r / rpn * rpn) + " and " + std::to_string(r) +
                    " are declared one node (ranks_per_node = " + std::to_string(rpn) +
                    ") but run on hosts " + all[size_t(r / rpn * rpn)].host + " and " +
                    all[size_t(r)].host);
  return rpn;
}

// Blocks of the group's kernels the current device holds at once; loads the kernels.
int resident_blocks_here(const GroupView& v) {
  const int per_sm = std::min(prepare_dispatch_kernels(v), load_combine_kernels_default());
  int dev = 0, sms = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
             "cudaDeviceGetAttribute(multiProcessorCount)");
  return per_sm * sms;
}

// Every rank's blocks must be resident at once (the kernels wait on each other). Checked for
// each GPU over the ranks that use it, from the gathered set-up records, so every rank throws
// the same error.
void check_residency(const std::vector<PeerInfo>& all, const Config& cfg, int rank) {
  const int n = int(all.size());
  for (int r = 0; r < n; ++r) {
    int sharing = 0, first = -1;
    for (int q = 0; q < n; ++q)
      if (all[q].same_gpu(all[r])) {
        if (first < 0) first = q;
        ++sharing;
      }
    if (first != r) continue;  // each GPU once, at its first rank
    const int64_t need = int64_t(sharing) * cfg.num_sms;
    const int fit = all[r].resident_blocks;
    if (need <= fit) continue;
    std::ostringstream os;
    os << rank_prefix(rank);
    if (sharing == 1) {
      os << "num_sms = " << cfg.num_sms << " blocks exceed the " << fit
         << " that GPU " << all[r].pci_bus_id << " (rank " << r
         << ") can hold at once; set num_sms <= " << fit;
    } else {
      os << sharing << " ranks share GPU " << all[r].pci_bus_id << " (first rank " << r
         << "), each with num_sms = " << cfg.num_sms << ": " << need
         << " blocks must be resident at once but the GPU holds " << fit
         << "; set num_sms <= " << fit / sharing << " (max_resident_blocks / ranks on the GPU)";
    }
    throw Error(ErrorCode::kInvalidArgument, os.str());
  }
}

}  // namespace

void GroupState::setup(const Config& config, Bootstrap& bs, int dev) {
  cfg = config;
  bootstrap = &bs;
  rank = bs.rank();
  n_ranks = bs.size();
  device = dev;
  // Validate locally, then compare across ranks: every rank sees the same gathered configs and
  // so throws the same error.
  std::string local_error;
  try {
    cfg.validate(n_ranks);
  } catch (const Error& e) {
    local_error = e.what();
  }
  sizes = compute_sizes(cfg, std::max(n_ranks, 1));

  PeerInfo me{};
  me.pid = int32_t(::getpid());
  me.device = dev;
  ::gethostname(me.host, sizeof(me.host) - 1);
  me.cfg = cfg;
  check_cuda(cudaSetDevice(dev), "cudaSetDevice");
  check_cuda(cudaDeviceGetPCIBusId(me.pci_bus_id, sizeof(me.pci_bus_id), dev),
             "cudaDeviceGetPCIBusId");
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  std::memcpy(me.uuid, prop.uuid.bytes, 16);
  if (local_error.empty()) {
    const GroupView v = make_view(cfg, n_ranks, rank, sizes);
    me.resident_blocks = resident_blocks_here(v);
    const WindowLayout& wl = v.layout();
    size_t free_b = 0, total_b = 0;
    check_cuda(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
    if (size_t(wl.bytes()) > free_b) {
      std::ostringstream os;
      os << detail::rank_prefix(rank) << "the communication window needs " << wl.bytes()
         << " bytes but GPU " << dev << " has " << free_b << " free";
      local_error = os.str();
    } else if (cudaMalloc(&window, size_t(wl.bytes())) != cudaSuccess) {
      (void)cudaGetLastError();
      local_error = detail::rank_prefix(rank) + "cudaMalloc of the communication window failed";
    } else {
      check_cuda(cudaMemset(window, 0, size_t(wl.zeroed_bytes())), "cudaMemset(window)");
      me.window = window;
      check_cuda(cudaIpcGetMemHandle(&me.handle, window), "cudaIpcGetMemHandle");
    }
  }
  // One all-gather for everything; a rank that failed locally contributes an invalid config so
  // that every rank fails instead of waiting for it.
  if (!local_error.empty()) me.cfg.hidden = -1;
  std::vector<PeerInfo> all(static_cast<size_t>(n_ranks));
  bs.all_gather(&me, all.data(), sizeof(PeerInfo));
  if (!local_error.empty()) throw Error(ErrorCode::kInvalidArgument, local_error);
  for (int r = 0; r < n_ranks; ++r)
    if (all[r].cfg.hidden == -1)
      throw Error(ErrorCode::kSetup,
                  detail::rank_prefix(rank) + "rank " + std::to_string(r) + " failed its local set-up");
  std::vector<Config> cfgs;
  for (const PeerInfo& p : all) cfgs.push_back(p.cfg);
  check_configs_match(cfgs.data(), n_ranks);

  for (int r = 0; r < n_ranks; ++r)
    for (int q = 0; q < r; ++q)
      check_setup(cfg.share_gpus || !all[q].same_gpu(all[r]), rank,
                  "ranks " + std::to_string(q) + " and " + std::to_string(r) +
                      " use the same GPU (set Config::share_gpus to let ranks share one)");
  check_residency(all, cfg, rank);

  // Peer pointers: the same process -> its own pointer (same GPU) or peer access; another
  // process -> CUDA IPC (also on the same GPU).
  // skip_a2a: the view is this rank alone, and no peer is mapped.
  view = make_view(cfg, n_ranks, rank, sizes);
  if (view.n_ranks > 1) view.ranks_per_node = ranks_per_node_of(all, cfg, rank);
  if (view.multi_node()) {
    // Judged from the gathered records alone, so every rank throws the same.
    for (int r = 0; r < n_ranks; ++r)
      for (int q = 0; q < r; ++q)
        check_setup(!all[size_t(q)].same_process(all[size_t(r)]), rank,
            "ranks " + std::to_string(q) + " and " + std::to_string(r) +
                " run in one process, but a group that spans nodes needs one process per "
                "rank (NVSHMEM: one PE per process)");
    map_nodes(bs, view.layout());
  } else {
    map_node(all, me, dev);
  }
  publish_windows();

  // Local state, ranking scratch and the host-mapped error record.
  check_cuda(cudaMalloc(&state, sizeof(LocalState)), "cudaMalloc(state)");
  check_cuda(cudaMemset(state, 0, sizeof(LocalState)), "cudaMemset(state)");
  const ExpertMap em = view.experts();
  const int64_t T = cfg.max_tokens_per_rank, K = view.top_k, nk = em.num_keys();
  const int64_t n_view = view.n_ranks;
  const int64_t n_units = (T + dispatch_unit_tokens() - 1) / dispatch_unit_tokens();
  constexpr int kParts = 9;
  const int64_t words[kParts] = {T * K,
                                 T * K,
                                 T * n_view,
                                 n_units * nk,
                                 (n_units + 1) * nk,
                                 int64_t(num_chunks(int32_t(T))) * n_view,
                                 n_view * em.n_local(),
                                 n_view,
                                 T * K};
  int64_t total = 0;
  for (int64_t w : words) total += align_up(w * 4, 256);
  check_cuda(cudaMalloc(&scratch_mem, size_t(total)), "cudaMalloc(scratch)");
  check_cuda(cudaMemset(scratch_mem, 0, size_t(total)), "cudaMemset(scratch)");
  int32_t* parts[kParts];
  int64_t off = 0;
  for (int i = 0; i < kParts; ++i) {
    parts[i] = reinterpret_cast<int32_t*>(scratch_mem + off);
    off += align_up(words[i] * 4, 256);
  }
  scratch = RankScratch{parts[0], parts[1], parts[2], parts[3], parts[4],
                        parts[5], parts[6], parts[7], parts[8]};
  check_cuda(cudaHostAlloc(&error_host, sizeof(DeviceErrorRecord),
                           cudaHostAllocMapped | cudaHostAllocPortable),
             "cudaHostAlloc(error record)");
  std::memset(error_host, 0, sizeof(DeviceErrorRecord));
  DeviceErrorRecord* error_dev = nullptr;
  check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_dev), error_host, 0),
             "cudaHostGetDevicePointer");

  view.state = state;
  view.error = error_dev;
  if (cfg.trace) {
    const size_t bytes = size_t(trace_words(cfg.num_sms)) * sizeof(unsigned long long);
    check_cuda(cudaMalloc(&trace, bytes), "cudaMalloc(trace)");
    check_cuda(cudaMemset(trace, 0, bytes), "cudaMemset(trace)");
    view.trace = trace;
  }
  check_cuda(cudaDeviceSynchronize(), "set-up");
  // Nobody may send before every window is zeroed and mapped.
  bs.barrier();
  joined = true;
}

// One node: every peer's window mapped here (own pointer, peer access or CUDA IPC).
void GroupState::map_node(const std::vector<PeerInfo>& all, const PeerInfo& me, int dev) {
  windows.assign(size_t(view.n_ranks), nullptr);
  windows[size_t(view.rank)] = window;
  for (int r = 0; r < n_ranks && view.n_ranks > 1; ++r) {
    const PeerInfo& p = all[size_t(r)];
    if (r == rank) continue;
    const bool same_gpu = p.same_gpu(me);
    int peer_dev = -1;
    if (cudaDeviceGetByPCIBusId(&peer_dev, p.pci_bus_id) != cudaSuccess) {
      (void)cudaGetLastError();
      peer_dev = -1;
    }
    if (peer_dev >= 0 && !same_gpu) {
      int can = 0;
      check_cuda(cudaDeviceCanAccessPeer(&can, dev, peer_dev), "cudaDeviceCanAccessPeer");
      check_setup(can != 0, rank,
                  "P2P is not possible between GPU " + std::string(me.pci_bus_id) + " (rank " +
                      std::to_string(rank) + ") and GPU " + p.pci_bus_id + " (rank " +
                      std::to_string(r) + ")");
    }
    if (p.pid == me.pid) {
      if (!same_gpu) {
        const cudaError_t e = cudaDeviceEnablePeerAccess(p.device, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) {
          (void)cudaGetLastError();
        } else {
          check_cuda(e, "cudaDeviceEnablePeerAccess");
        }
      }
      windows[size_t(r)] = static_cast<char*>(p.window);
    } else {
      void* ptr = nullptr;
      check_cuda(cudaIpcOpenMemHandle(&ptr, p.handle, cudaIpcMemLazyEnablePeerAccess),
                 "cudaIpcOpenMemHandle");
      ipc_windows.push_back(static_cast<char*>(ptr));
      windows[size_t(r)] = static_cast<char*>(ptr);
    }
  }
}

// A group that spans nodes: the window and the outbox in NVSHMEM's symmetric heap (the
// cudaMalloc'd window is freed unused); ranks of this node mapped through nvshmem_ptr, ranks of
// other nodes left null (the kernels put to them).
void GroupState::map_nodes(Bootstrap& bs, const WindowLayout& wl) {
  if (window != nullptr) check_cuda(cudaFree(window), "cudaFree(window)");
  window = nullptr;
  const int64_t bytes = wl.bytes() + view.outbox_layout().bytes();
  nvshmem_start(bs, std::max<size_t>(size_t(1) << 30, 2 * size_t(bytes) + (size_t(256) << 20)));
  window = nvshmem_alloc(size_t(bytes), rank);
  nvshmem_window = true;
  // Every peer is in this set-up, so its earlier groups' kernels are done (their teardown
  // synchronised its device): nothing late lands in a reused window after it is zeroed.
  bs.barrier();
  check_cuda(cudaMemset(window, 0, size_t(bytes)), "cudaMemset(NVSHMEM window)");
  check_cuda(cudaDeviceSynchronize(), "cudaMemset(NVSHMEM window)");
  view.outbox = window + wl.bytes();
  const NodeMap nm = view.nodes();
  windows.assign(size_t(n_ranks), nullptr);
  int32_t unmapped = -1;  // a rank of this node NVSHMEM cannot map here
  for (int r = 0; r < n_ranks; ++r) {
    if (nm.remote(rank, r)) continue;
    windows[size_t(r)] = r == rank ? window : nvshmem_peer(window, r);
    if (windows[size_t(r)] == nullptr) unmapped = r;
  }
  // Decided together, so no rank waits for one that gave up.
  std::vector<int32_t> all(static_cast<size_t>(n_ranks));
  bs.all_gather(&unmapped, all.data(), sizeof(int32_t));
  for (int r = 0; r < n_ranks; ++r)
    check_setup(all[size_t(r)] < 0, rank,
                "rank " + std::to_string(all[size_t(r)]) + " is of rank " + std::to_string(r) +
                    "'s node but NVSHMEM cannot map its memory there (nvshmem_ptr)");
}

// The mapped windows into the view: the first GroupView::kInlineWindows inline, the rest in a
// device array.
void GroupState::publish_windows() {
  constexpr int kInline = GroupView::kInlineWindows;
  for (size_t r = 0; r < windows.size() && r < size_t(kInline); ++r)
    view.window[r] = windows[r];
  if (windows.size() <= size_t(kInline)) return;
  const size_t bytes = (windows.size() - kInline) * sizeof(char*);
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&window_rest_dev), bytes), "cudaMalloc(windows)");
  check_cuda(cudaMemcpy(window_rest_dev, windows.data() + kInline, bytes, cudaMemcpyHostToDevice),
             "cudaMemcpy(windows)");
  view.window_rest = window_rest_dev;
}

GroupState::~GroupState() {
  // Let every kernel that may touch our window finish, then free. In one-process mode the peers
  // are our own devices; otherwise the bootstrap barrier tells us the peers are done.
  for (int d : local_devices.empty() ? std::vector<int>{device} : local_devices) {
    if (cudaSetDevice(d) == cudaSuccess) (void)cudaDeviceSynchronize();
  }
  // A poisoned group skips it: a peer may be dead, and every peer's kernels gave up within the
  // same bound.
  const bool timed_out =
      poisoned || (error_host != nullptr && error_host->code == int32_t(ErrorCode::kTimeout));
  if (joined && !timed_out && owned_bootstrap == nullptr && bootstrap != nullptr) {
    try {
      bootstrap->barrier();
    } catch (const std::exception&) {
      // a dead peer must not stop us from freeing our memory
    }
  }
  (void)cudaSetDevice(device);
  for (char* p : ipc_windows) (void)cudaIpcCloseMemHandle(p);
  if (window && nvshmem_window)
    nvshmem_release(window, size_t(view.layout().bytes() + view.outbox_layout().bytes()));
  if (window && !nvshmem_window) (void)cudaFree(window);
  if (window_rest_dev) (void)cudaFree(window_rest_dev);
  if (state) (void)cudaFree(state);
  if (scratch_mem) (void)cudaFree(scratch_mem);
  if (error_host) (void)cudaFreeHost(error_host);
  if (trace) (void)cudaFree(trace);
  (void)cudaGetLastError();
}

}  // namespace detail

// ---- construction -----------------------------------------------------------------------------

int max_resident_blocks(const Config& cfg, int n_ranks, int device) {
  cfg.validate(n_ranks);
  detail::check_cuda(cudaSetDevice(device), "cudaSetDevice");
  return detail::resident_blocks_here(
      detail::make_view(cfg, n_ranks, 0, compute_sizes(cfg, n_ranks)));
}

Group::Group(std::unique_ptr<detail::GroupState> state) : s_(std::move(state)) {}
Group::~Group() = default;

std::unique_ptr<Group> Group::create(const Config& cfg, Bootstrap& bootstrap, int device) {
  auto st = std::make_unique<detail::GroupState>();
  st->setup(cfg, bootstrap, device);
  return std::unique_ptr<Group>(new Group(std::move(st)));
}

std::vector<std::unique_ptr<Group>> Group::create_local(const Config& cfg,
                                                        std::vector<int> devices) {
  if (devices.empty()) {
    int n = 0;
    detail::check_cuda(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
    for (int d = 0; d < n; ++d) devices.push_back(d);
  }
  const int n = int(devices.size());
  auto endpoints = make_thread_bootstraps(n);
  std::vector<std::unique_ptr<detail::GroupState>> states(static_cast<size_t>(n));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto st = std::make_unique<detail::GroupState>();
        st->owned_bootstrap = std::move(endpoints[size_t(r)]);
        st->local_devices = devices;
        st->setup(cfg, *st->owned_bootstrap, devices[size_t(r)]);
        states[size_t(r)] = std::move(st);
      } catch (...) {
        errors[size_t(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  // Prefer the root cause over the "someone left the group" errors it triggers elsewhere.
  std::exception_ptr first;
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      if (!first || err.code() != ErrorCode::kBootstrap) first = e;
      if (err.code() != ErrorCode::kBootstrap) break;
    } catch (...) {
      first = e;
      break;
    }
  }
  if (first) {
    states.clear();
    std::rethrow_exception(first);
  }
  std::vector<std::unique_ptr<Group>> groups;
  for (auto& st : states) groups.push_back(std::unique_ptr<Group>(new Group(std::move(st))));
  return groups;
}

int Group::rank() const { return s_->rank; }
int Group::n_ranks() const { return s_->n_ranks; }
int Group::device() const { return s_->device; }
const Config& Group::config() const { return s_->cfg; }
const Sizes& Group::sizes() const { return s_->sizes; }
bool Group::poisoned() const { return s_->poisoned; }
DispatchRecord Group::last_dispatch() const { return s_->last; }

int32_t Group::pending_combine_columns() const {
  return s_->async_combine_pending ? s_->async_combine_hidden : 0;
}

StageTrace Group::stage_trace() const {
  if (s_->trace == nullptr)
    throw Error(ErrorCode::kInvalidArgument, "stage_trace: the group was set up without Config::trace");
  detail::check_cuda(cudaSetDevice(s_->device), "cudaSetDevice");
  detail::check_cuda(cudaDeviceSynchronize(), "stage_trace: cudaDeviceSynchronize");
  StageTrace t;
  t.blocks = s_->cfg.num_sms;
  t.ns.resize(size_t(trace_words(t.blocks)));
  detail::check_cuda(cudaMemcpy(t.ns.data(), s_->trace, t.ns.size() * sizeof(uint64_t),
                                cudaMemcpyDeviceToHost),
                     "stage_trace: cudaMemcpy");
  return t;
}

uint64_t Group::network_bytes_put() const {
  detail::check_cuda(cudaSetDevice(s_->device), "cudaSetDevice");
  detail::check_cuda(cudaDeviceSynchronize(), "network_bytes_put: cudaDeviceSynchronize");
  unsigned long long bytes = 0;
  detail::check_cuda(cudaMemcpy(&bytes, &s_->state->network_bytes, sizeof(bytes),
                                cudaMemcpyDeviceToHost),
                     "network_bytes_put: cudaMemcpy");
  return uint64_t(bytes);
}

// ---- errors -----------------------------------------------------------------------------------

namespace {

const char* op_name(int32_t op) {
  switch (op) {
    case detail::kOpDispatchSend: return "dispatch (send)";
    case detail::kOpDispatchRecv: return "dispatch (receive)";
    case detail::kOpCombineSend: return "combine (send)";
    case detail::kOpCombineRecv: return "combine (receive)";
    case detail::kOpGridBarrier: return "grid barrier";
  }
  return "operation";
}

const char* wait_name(int32_t what) {
  switch (what) {
    case detail::kWaitAck: return "to release its receive buffer from the previous call";
    case detail::kWaitMeta: return "to send its token counts";
    case detail::kWaitData: return "to finish sending its tokens";
    case detail::kWaitBarrier: return "(the other blocks of this kernel)";
  }
  return "";
}

const char* peer_field_name(int32_t field) {
  switch (field) {
    case detail::kFieldStreamCount: return "a message count";
    case detail::kFieldChunks: return "a chunk count";
    case detail::kFieldGroupCount: return "a group's token count";
    case detail::kFieldChunkStart: return "a chunk start";
    case detail::kFieldRowsTo:
      return "its rows routed to a rank (out of range, or for this rank not its counts' sum)";
  }
  return "a value";
}

// The ranks of a recorded peer mask (peer_mask: ranks 0-31, peer_mask_hi: 32-63).
std::string ranks_of(int32_t lo, int32_t hi) {
  const unsigned long long mask =
      (unsigned long long)uint32_t(lo) | ((unsigned long long)uint32_t(hi) << 32);
  std::string s;
  for (int r = 0; r < 64; ++r)
    if ((mask >> r) & 1ull) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

}  // namespace

// The recorded timeout, in words.
static std::string describe_timeout(const detail::GroupState& s) {
  const volatile detail::DeviceErrorRecord* e = s.error_host;
  std::ostringstream os;
  os << "epcomm rank " << e->rank << ": " << op_name(e->op) << ": timed out after "
     << s.cfg.timeout_seconds << " s waiting for rank(s) "
     << ranks_of(e->peer_mask, e->peer_mask_hi) << " " << wait_name(e->wait_what)
     << "; the group is poisoned and must be set up again. If those ranks are alive but late "
        "(a first call compiling, weights still loading, processes time-sliced on one GPU), "
        "raise Config::timeout_seconds or set EPCOMM_TIMEOUT_SECONDS";
  return os.str();
}

void Group::check() {
  volatile detail::DeviceErrorRecord* e = s_->error_host;
  const int32_t code = e->code;
  if (code == 0) return;
  std::ostringstream os;
  os << "epcomm rank " << e->rank << ": " << op_name(e->op) << ": ";
  const ErrorCode ec = ErrorCode(code);
  switch (ec) {
    case ErrorCode::kTimeout:
      s_->poisoned = true;
      throw Error(ec, describe_timeout(*s_));
    case ErrorCode::kBadExpertId:
      os << "topk_ids[" << e->token << "][" << e->slot << "] = " << e->value << " is outside [-1, "
         << s_->cfg.n_experts << ")"
         << (e->value == INT32_MAX || e->value == INT32_MIN
                 ? " (an int64 id beyond int32's range shows as this bound)"
                 : "")
         << "; this rank sent no token";
      break;
    case ErrorCode::kDuplicateExpert:
      os << "topk_ids[" << e->token << "] names expert " << e->value
         << " twice (again at slot " << e->slot << "); this rank sent no token";
      break;
    case ErrorCode::kRecvCapacity:
      os << "rank(s) " << ranks_of(e->peer_mask, e->peer_mask_hi)
         << " would receive more rows than the receive capacity of " << s_->sizes.max_routed_rows
         << " rows (Config::max_routed_rows; the most: " << e->value
         << " rows); every rank of the call reports this and no rank wrote a row (row_offsets "
            "are all 0, so combine returns nothing), and the group stays usable";
      break;
    case ErrorCode::kBadPeerData:
      os << "rank " << ranks_of(e->peer_mask, e->peer_mask_hi) << " announced "
         << peer_field_name(e->wait_what) << " = " << e->value
         << ", out of range; no row was written";
      break;
    default:
      os << error_code_name(ec);
  }
  // The record holds one error at a time: a wait that timed out after this error was recorded
  // (a bad id on this rank, then a peer that never came) left its record unwritten but set the
  // abort flag, which makes every later kernel of the group return at once. So the flag is read
  // here, on this error path only, and a set flag poisons the group as a recorded timeout does;
  // otherwise later calls would write nothing and report nothing.
  // The read is checked, but a failure to read (a device that has failed, or a graph being
  // captured on the calling thread, which forbids a synchronous copy) must not hide the error
  // being reported: it is named in the message instead.
  int32_t aborted = 0;
  detail::check_cuda(cudaSetDevice(s_->device), "cudaSetDevice");
  const cudaError_t read =
      cudaMemcpy(&aborted, &s_->state->abort, sizeof(aborted), cudaMemcpyDeviceToHost);
  if (read != cudaSuccess) {
    (void)cudaGetLastError();
    os << " (whether a wait also timed out is unknown: reading the abort flag failed: "
       << cudaGetErrorString(read) << ")";
  } else if (aborted != 0) {
    s_->poisoned = true;
    os << "; a wait of this rank also timed out (its record was not kept: one error is "
          "recorded at a time), so the group is poisoned and must be set up again";
  }
  // Clear, then count the clear: the device may record again once the epoch has moved on.
  const int32_t epoch = e->epoch;
  std::memset(const_cast<detail::DeviceErrorRecord*>(s_->error_host), 0,
              sizeof(detail::DeviceErrorRecord));
  std::atomic_thread_fence(std::memory_order_seq_cst);
  e->epoch = epoch + 1;
  throw Error(ec, os.str());
}

void Group::synchronize(cudaStream_t stream) {
  detail::check_cuda(cudaSetDevice(s_->device), "cudaSetDevice");
  detail::check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  check();
}

// After every launch: a failed launch throws Error(kCuda) naming the operation.
static void after_launch(const char* op) {
  detail::check_cuda(cudaGetLastError(), op);
}

void detail::EpilogueAccess::after_launch(const char* op) {
  epcomm::after_launch(op);
}

// ---- argument checks --------------------------------------------------------------------------

namespace {

void require(bool ok, int rank, const char* op, const std::string& msg) {
  if (!ok) throw Error(ErrorCode::kInvalidArgument, detail::rank_prefix(rank) + op + ": " + msg);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte (empty ranges share none).
bool overlaps(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  const uintptr_t x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + uintptr_t(b_bytes) && y < x + uintptr_t(a_bytes);
}

void require_ptr(const void* p, int rank, const char* op, const char* name, bool align16) {
  require(p != nullptr, rank, op, std::string(name) + " is null");
  if (align16) require(aligned16(p), rank, op, std::string(name) + " is not 16-byte aligned");
}

}  // namespace

// Called at the start of every operation: a recorded timeout poisons the group.
static void check_usable(detail::GroupState& s, const char* op) {
  if (!s.poisoned && s.error_host->code == int32_t(ErrorCode::kTimeout)) s.poisoned = true;
  if (s.poisoned)
    throw Error(ErrorCode::kPoisoned, detail::rank_prefix(s.rank) + op +
                                          ": an earlier wait timed out; destroy the group and "
                                          "set it up again");
  detail::check_cuda(cudaSetDevice(s.device), "cudaSetDevice");
}

// Kernel parameters of a dispatch: the send half uses `in`, the receive half `out` (either may be
// null for the async / wait halves).
static detail::DispatchParams dispatch_params(detail::GroupState& s, const DispatchInput* in,
                                              const DispatchOutput* out) {
  detail::DispatchParams p{};
  p.g = s.view;
  p.scratch = s.scratch;
  if (in) {
    p.tokens = in->tokens;
    p.topk_ids = in->topk_ids64 != nullptr ? static_cast<const void*>(in->topk_ids64)
                                           : static_cast<const void*>(in->topk_ids);
    p.id_bytes = in->topk_ids64 != nullptr ? 8 : 4;
    p.weights = in->weights;
    p.num_tokens = in->num_tokens;
  }
  if (out) {
    p.out_tokens = out->tokens;
    p.row_offsets = out->row_offsets;
    p.expert_ids = out->expert_ids;
    p.src_info = out->src_info;
    p.out_scales = out->scales;
    p.scales_offsets = out->scales_offsets;
    p.counts = out->counts;
    p.slot_token = out->slot_token;
    p.layout_range = out->layout_range;
  }
  return p;
}

static void check_dispatch_input(detail::GroupState& s, const DispatchInput& in, const char* op) {
  require(in.num_tokens >= 0 && in.num_tokens <= s.cfg.max_tokens_per_rank, s.rank, op,
          "num_tokens = " + std::to_string(in.num_tokens) + " is outside [0, " +
              std::to_string(s.cfg.max_tokens_per_rank) + "] (max_tokens_per_rank)");
  require(in.hidden == s.cfg.hidden, s.rank, op,
          "hidden = " + std::to_string(in.hidden) + " but the group was set up with hidden = " +
              std::to_string(s.cfg.hidden));
  require(in.topk_ids == nullptr || in.topk_ids64 == nullptr, s.rank, op,
          "both topk_ids (int32) and topk_ids64 (int64) are given; give one");
  if (in.num_tokens > 0) {
    require_ptr(in.tokens, s.rank, op, "tokens", true);
    if (in.topk_ids64 != nullptr) {
      require((reinterpret_cast<uintptr_t>(in.topk_ids64) & 7u) == 0, s.rank, op,
              "topk_ids64 is not 8-byte aligned");
    } else {
      require_ptr(in.topk_ids, s.rank, op, "topk_ids (or topk_ids64)", false);
      require((reinterpret_cast<uintptr_t>(in.topk_ids) & 3u) == 0, s.rank, op,
              "topk_ids is not 4-byte aligned");
    }
    require((reinterpret_cast<uintptr_t>(in.weights) & 3u) == 0, s.rank, op,
            "weights is not 4-byte aligned");
  }
}

static void check_dispatch_output(detail::GroupState& s, const DispatchOutput& out,
                                  const char* op) {
  require_ptr(out.tokens, s.rank, op, "output tokens", true);
  require_ptr(out.row_offsets, s.rank, op, "row_offsets", false);
  require_ptr(out.expert_ids, s.rank, op, "expert_ids", false);
  require_ptr(out.src_info, s.rank, op, "src_info", false);
  require((reinterpret_cast<uintptr_t>(out.src_info) & 7u) == 0, s.rank, op,
          "src_info is not 8-byte aligned");
  if (s.cfg.format != TokenFormat::kBF16)
    require_ptr(out.scales, s.rank, op,
                (std::string("scales (") + token_format_name(s.cfg.format) + ")").c_str(), true);
  if (format_swizzled(s.cfg.format)) {
    require_ptr(out.scales_offsets, s.rank, op, "scales_offsets", false);
    require((reinterpret_cast<uintptr_t>(out.scales_offsets) & 3u) == 0, s.rank, op,
            "scales_offsets is not 4-byte aligned");
  }
  if (s.cfg.padded_capacity > 0) {
    require_ptr(out.counts, s.rank, op, "counts (padded_capacity)", false);
    require((reinterpret_cast<uintptr_t>(out.counts) & 3u) == 0 &&
                (reinterpret_cast<uintptr_t>(out.slot_token) & 3u) == 0 &&
                (reinterpret_cast<uintptr_t>(out.layout_range) & 7u) == 0,
            s.rank, op, "counts, slot_token or layout_range is not 4-, 4- or 8-byte aligned");
  }
}

void Group::dispatch(const DispatchInput& in, const DispatchOutput& out, cudaStream_t stream) {
  EPCOMM_NVTX_RANGE("epcomm::dispatch");
  const char* op = "dispatch";
  check_usable(*s_, op);
  require(!s_->async_dispatch_pending, s_->rank, op, "a dispatch_async is waiting for its dispatch_wait");
  check_dispatch_input(*s_, in, op);
  check_dispatch_output(*s_, out, op);
  // The fused kernel writes output rows while it still reads the input (a bf16 call's own rows
  // are read in place, late): an input inside the tokens or scales output would be overwritten
  // under it.
  const DispatchOutputLayout layout = s_->view.output();
  const int64_t in_bytes = int64_t(in.num_tokens) * in.hidden * 2;
  require(!overlaps(in.tokens, in_bytes, out.tokens, layout.tokens_bytes()) &&
              !overlaps(in.tokens, in_bytes, out.scales, layout.scales_bytes()),
          s_->rank, op, "the input tokens overlap the output tokens or scales");
  detail::launch_dispatch(dispatch_params(*s_, &in, &out), true, true, stream);
  after_launch(op);
  s_->last = DispatchRecord{in.num_tokens, in.weights != nullptr};
}

void Group::dispatch_async(const DispatchInput& in, cudaStream_t stream) {
  EPCOMM_NVTX_RANGE("epcomm::dispatch_async");
  const char* op = "dispatch_async";
  check_usable(*s_, op);
  require(!s_->async_dispatch_pending, s_->rank, op, "the previous dispatch_async has no dispatch_wait yet");
  check_dispatch_input(*s_, in, op);
  detail::launch_dispatch(dispatch_params(*s_, &in, nullptr), true, false, stream);
  after_launch(op);
  s_->async_dispatch_pending = true;
  s_->pending = DispatchRecord{in.num_tokens, in.weights != nullptr};
}

void Group::dispatch_wait(const DispatchOutput& out, cudaStream_t stream) {
  EPCOMM_NVTX_RANGE("epcomm::dispatch_wait");
  const char* op = "dispatch_wait";
  check_usable(*s_, op);
  require(s_->async_dispatch_pending, s_->rank, op, "no dispatch_async to wait for");
  check_dispatch_output(*s_, out, op);
  detail::launch_dispatch(dispatch_params(*s_, nullptr, &out), false, true, stream);
  after_launch(op);
  s_->async_dispatch_pending = false;
  s_->last = s_->pending;
}

// A combine's name by its form: combine (in and out), combine_async (in) or combine_wait (out).
static const char* combine_op(const CombineInput* in, const CombineOutput* out) {
  return in && out ? "combine" : (in ? "combine_async" : "combine_wait");
}

// The checks and kernel parameters of a combine (in and out), combine_async (in only) or
// combine_wait (out only); tracks the async / wait pairing.
static detail::CombineParams prepare_combine(detail::GroupState& s, const CombineInput* in,
                                             const CombineOutput* out) {
  const char* op = combine_op(in, out);
  check_usable(s, op);
  require(s.last.num_tokens >= 0, s.rank, op, "no dispatch has completed on this group yet");
  require(!s.async_dispatch_pending, s.rank, op,
          "a dispatch_async is waiting for its dispatch_wait");
  if (out && !in) {
    require(s.async_combine_pending, s.rank, op, "no combine_async to wait for");
  } else {
    require(!s.async_combine_pending, s.rank, op,
            "a combine_async is waiting for its combine_wait");
  }
  if (in)
    require(s.cfg.combine_columns_ok(in->hidden), s.rank, op,
            "hidden = " + std::to_string(in->hidden) + ": the group's hidden (" +
                std::to_string(s.cfg.hidden) + ") or fewer columns, a positive multiple of 8");
  detail::CombineParams p{};
  p.g = s.view;
  p.topk = s.scratch.topk;
  p.expert_side = s.last.weights ? 1 : 0;
  // The columns: this call's, or (combine_wait) its combine_async's.
  p.hidden = in ? in->hidden : s.async_combine_hidden;
  p.whole_rows = detail::combine_whole_rows(s.last.num_tokens, p.hidden, s.view.num_blocks) ? 1 : 0;
  p.recv_base = s.scratch.recv_base;
  p.recv_count = s.scratch.recv_count;
  p.self_row = s.scratch.self_row;
  if (in) {
    require_ptr(in->expert_out, s.rank, op, "expert_out", true);
    require_ptr(in->row_offsets, s.rank, op, "row_offsets", false);
    require_ptr(in->src_info, s.rank, op, "src_info", false);
    const int64_t most = s.view.route.max_group_rows(s.cfg.max_tokens_per_rank);
    const int64_t cap = in->expert_out_capacity;
    require(cap == 0 || s.view.route.padded_capacity_fits(s.cfg.max_tokens_per_rank, cap), s.rank,
            op,
            "expert_out_capacity = " + std::to_string(cap) +
                ": 0 (dispatch row order), or a padded layout of at least " + std::to_string(most) +
                " slots a group (the most rows a group can receive: the group's ranks, 1 with "
                "skip_a2a, times max_tokens_per_rank), fewer than 2^31 rows in all");
    p.expert_out = in->expert_out;
    p.row_offsets = in->row_offsets;
    p.src_info = in->src_info;
    p.expert_capacity = in->expert_out_capacity;
  }
  if (out) {
    require(!(s.last.weights && out->weights != nullptr), s.rank, op,
            "the last dispatch carried router weights, so combine reduces with those on the "
            "expert side: pass weights = nullptr");
    const bool reduced = out->weights != nullptr || s.last.weights;
    require(reduced || !s.cfg.shared_expert, s.rank, op,
            "with shared_expert, combine needs router weights (given to dispatch or here): "
            "the shared expert's row is added into each token's reduced row");
    if (out->out != nullptr || !reduced) require_ptr(out->out, s.rank, op, "out", true);
    if (out->weights)
      require((reinterpret_cast<uintptr_t>(out->weights) & 3u) == 0, s.rank, op,
              "weights is not 4-byte aligned");
    p.out = out->out;
    p.weights = out->weights;
  }
  s.async_combine_pending = in && !out;
  if (in && !out) s.async_combine_hidden = in->hidden;
  return p;
}

detail::CombineParams detail::EpilogueAccess::prepare_combine(Group& group, const CombineInput* in,
                                                              const CombineOutput* out) {
  // The epilogue's kernel is compiled in the caller's translation unit, without the library's
  // NVSHMEM transport: it would take a rank of another node for one it can store to.
  const detail::GroupState& s = *group.s_;
  require(!s.view.multi_node(), s.rank, combine_op(in, out),
          "a custom combine epilogue (epcomm/combine_epilogue.cuh) cannot run on a group that "
          "spans nodes: its kernel is compiled in your code, without the NVSHMEM transport. Use "
          "Group::combine, and apply the epilogue to its output");
  return epcomm::prepare_combine(*group.s_, in, out);
}

void Group::combine(const CombineInput& in, const CombineOutput& out, cudaStream_t stream) {
  EPCOMM_NVTX_RANGE("epcomm::combine");
  require_ptr(out.out, s_->rank, "combine", "out", true);
  const detail::CombineParams p = prepare_combine(*s_, &in, &out);
  detail::launch_combine_default(p, true, true, stream);
  after_launch("combine");
}

void Group::combine_async(const CombineInput& in, cudaStream_t stream) {
  EPCOMM_NVTX_RANGE("epcomm::combine_async");
  const detail::CombineParams p = prepare_combine(*s_, &in, nullptr);
  detail::launch_combine_default(p, true, false, stream);
  after_launch("combine_async");
}

void Group::combine_wait(const CombineOutput& out, cudaStream_t stream) {
  EPCOMM_NVTX_RANGE("epcomm::combine_wait");
  require_ptr(out.out, s_->rank, "combine_wait", "out", true);
  const detail::CombineParams p = prepare_combine(*s_, nullptr, &out);
  detail::launch_combine_default(p, false, true, stream);
  after_launch("combine_wait");
}

}  // namespace epcomm

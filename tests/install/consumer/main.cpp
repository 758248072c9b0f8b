#include <epcomm/group.h>
#include <epcomm/reference.h>

#include <cstdio>

int main() {
  epcomm::Config cfg;
  cfg.hidden = 7168;
  cfg.top_k = 8;
  cfg.n_experts = 256;
  cfg.max_tokens_per_rank = 128;
  cfg.validate(8);
  const epcomm::Sizes s = epcomm::compute_sizes(cfg, 8);
  const auto p = epcomm::reference::make_problem(2, 64, 2, 4, {3, 2}, 1);
  const auto d = epcomm::reference::dispatch(p, 0);
  std::printf("consumer: found epcomm; max_recv_rows %lld, reference rows %lld\n",
              static_cast<long long>(s.max_recv_rows), static_cast<long long>(d.rows()));
  return s.max_recv_rows == 128 * 8 * 8 ? 0 : 1;
}

// Errors: every failure epcomm reports is an epcomm::Error carrying a code and a message that
// names the operation, the rank and (where it applies) the field, token or peer at fault.
#pragma once

#include <stdexcept>
#include <string>

namespace epcomm {

enum class ErrorCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // bad shape, pointer, alignment or configuration value (host check)
  kConfigMismatch = 2,   // ranks were set up with different configurations
  kSetup = 3,            // peer access, memory, device selection
  kCuda = 4,             // a CUDA call failed
  kTimeout = 5,          // a wait on a peer expired on the device; the group must be re-created
  kBadExpertId = 6,      // topk_ids holds a value outside [-1, n_experts) (device check)
  kDuplicateExpert = 7,  // one token names the same expert twice (device check)
  kPoisoned = 8,         // an earlier timeout left the group unusable
  kBootstrap = 9,        // the bootstrap all-gather failed
  kRecvCapacity = 10,    // a dispatch routed more rows to a rank than Config::max_routed_rows
  kBadPeerData = 11,     // a peer's counts or offsets are out of range (device check)
};

const char* error_code_name(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& what) : std::runtime_error(what), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace epcomm

// epcomm_launch -n N [-t SECONDS] -- PROGRAM [ARGS...]
// Starts N copies of PROGRAM, one per rank, with EPCOMM_RANK, EPCOMM_LOCAL_RANK,
// EPCOMM_WORLD_SIZE and EPCOMM_BOOTSTRAP_DIR set (the file bootstrap's environment), waits for
// them, and kills them all if one fails or the time limit passes. Exit status: 0 if all
// succeeded, 77 if all reported "skipped" (77), else the first failure's status.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
  int n = 0;
  double timeout_s = 600;
  int i = 1;
  for (; i < argc; ++i) {
    if (!std::strcmp(argv[i], "-n") && i + 1 < argc) {
      n = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "-t") && i + 1 < argc) {
      timeout_s = std::atof(argv[++i]);
    } else if (!std::strcmp(argv[i], "--")) {
      ++i;
      break;
    } else {
      break;
    }
  }
  if (n < 1 || i >= argc) {
    std::fprintf(stderr, "usage: epcomm_launch -n N [-t SECONDS] -- PROGRAM [ARGS...]\n");
    return 2;
  }
  char dir[] = "/tmp/epcomm_launch_XXXXXX";
  if (!mkdtemp(dir)) {
    std::perror("mkdtemp");
    return 2;
  }
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("fork");
      return 2;
    }
    if (pid == 0) {
      setpgid(0, 0);
      const std::string rs = std::to_string(r), ns = std::to_string(n);
      setenv("EPCOMM_RANK", rs.c_str(), 1);
      setenv("EPCOMM_LOCAL_RANK", rs.c_str(), 1);
      setenv("EPCOMM_WORLD_SIZE", ns.c_str(), 1);
      setenv("EPCOMM_BOOTSTRAP_DIR", dir, 1);
      execvp(argv[i], argv + i);
      std::perror("execvp");
      _exit(127);
    }
    pids.push_back(pid);
  }
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int result = -1, running = n;
  bool all_skipped = true, timed_out = false;
  std::vector<bool> done(static_cast<size_t>(n), false);
  auto kill_all = [&] {
    for (int r = 0; r < n; ++r)
      if (!done[size_t(r)]) kill(-pids[size_t(r)], SIGKILL), kill(pids[size_t(r)], SIGKILL);
  };
  while (running > 0) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (int r = 0; r < n; ++r) {
        if (pids[size_t(r)] != pid) continue;
        done[size_t(r)] = true;
        --running;
        const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (code != 77) all_skipped = false;
        if (code != 0 && code != 77 && result <= 0) {
          std::fprintf(stderr, "epcomm_launch: rank %d exited with %d; stopping the others\n", r,
                       code);
          result = code;
          kill_all();
        }
      }
      continue;
    }
    if (!timed_out && std::chrono::steady_clock::now() > deadline) {
      timed_out = true;
      std::fprintf(stderr, "epcomm_launch: time limit of %.0f s reached; killing every rank\n",
                   timeout_s);
      kill_all();
      result = 124;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::string rm = std::string("rm -rf ") + dir;
  if (std::system(rm.c_str()) != 0) std::fprintf(stderr, "epcomm_launch: cannot remove %s\n", dir);
  if (result > 0) return result;
  return all_skipped ? 77 : 0;
}

// epcomm_launch -n N [-t SECONDS] [--keep-going] -- PROGRAM [ARGS...]
// Starts N copies of PROGRAM, one per rank, with EPCOMM_RANK, EPCOMM_LOCAL_RANK,
// EPCOMM_WORLD_SIZE and EPCOMM_BOOTSTRAP_DIR set (the file bootstrap's environment) and waits for
// them. By default it kills them all as soon as one fails; with --keep-going it lets the others
// run on (to test how they cope with a dead peer) and ends with one line per rank saying how it
// ended. Either way it kills every rank at the time limit (or on SIGTERM / SIGINT), and reports
// each rank that died by a signal, naming the signal. Exit status: 0 if all succeeded, 77 if all
// reported "skipped" (77), 124 at the time limit, else the first failure's status (128 + N for
// signal N).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

// Set by SIGTERM / SIGINT (a test driver's own time limit, ^C): the ranks run in process groups
// of their own, so nothing but us would stop them.
volatile std::sig_atomic_t stop_signal = 0;
extern "C" void on_stop_signal(int sig) { stop_signal = sig; }

std::string signal_name(int sig) {
  struct Named {
    int sig;
    const char* name;
  };
  static const Named names[] = {
      {SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"}, {SIGILL, "SIGILL"},
      {SIGTRAP, "SIGTRAP"}, {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},
      {SIGKILL, "SIGKILL"}, {SIGUSR1, "SIGUSR1"}, {SIGSEGV, "SIGSEGV"}, {SIGUSR2, "SIGUSR2"},
      {SIGPIPE, "SIGPIPE"}, {SIGALRM, "SIGALRM"}, {SIGTERM, "SIGTERM"}, {SIGXCPU, "SIGXCPU"},
      {SIGXFSZ, "SIGXFSZ"}, {SIGSYS, "SIGSYS"}};
  for (const Named& n : names)
    if (n.sig == sig) return n.name;
  return "signal " + std::to_string(sig);
}

// How a rank ended, in words: "exited with 3", "was killed by signal 9 (SIGKILL)".
std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + signal_name(sig) + ")";
  }
  return "ended with wait status " + std::to_string(status);
}

}  // namespace

int main(int argc, char** argv) {
  int n = 0;
  double timeout_s = 600;
  bool keep_going = false;
  int i = 1;
  for (; i < argc; ++i) {
    if (!std::strcmp(argv[i], "-n") && i + 1 < argc) {
      n = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "-t") && i + 1 < argc) {
      timeout_s = std::atof(argv[++i]);
    } else if (!std::strcmp(argv[i], "--keep-going")) {
      keep_going = true;
    } else if (!std::strcmp(argv[i], "--")) {
      ++i;
      break;
    } else {
      break;
    }
  }
  if (n < 1 || i >= argc) {
    std::fprintf(stderr,
                 "usage: epcomm_launch -n N [-t SECONDS] [--keep-going] -- PROGRAM [ARGS...]\n");
    return 2;
  }
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
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
  bool all_skipped = true, timed_out = false, stopped = false;
  std::vector<bool> done(static_cast<size_t>(n), false);
  std::vector<bool> killed_by_us(static_cast<size_t>(n), false);
  std::vector<int> statuses(static_cast<size_t>(n), 0);
  auto kill_all = [&] {
    for (int r = 0; r < n; ++r) {
      if (done[size_t(r)]) continue;
      killed_by_us[size_t(r)] = true;
      kill(-pids[size_t(r)], SIGKILL);
      kill(pids[size_t(r)], SIGKILL);
    }
  };
  while (running > 0) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (int r = 0; r < n; ++r) {
        if (pids[size_t(r)] != pid) continue;
        done[size_t(r)] = true;
        statuses[size_t(r)] = status;
        --running;
        const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (code != 77) all_skipped = false;
        if (WIFSIGNALED(status))
          std::fprintf(stderr, "epcomm_launch: rank %d (pid %d) %s%s\n", r, int(pid),
                       describe(status).c_str(),
                       killed_by_us[size_t(r)] ? ", sent by epcomm_launch" : "");
        if (code != 0 && code != 77 && result <= 0 && !killed_by_us[size_t(r)]) {
          result = code;
          std::fprintf(stderr, "epcomm_launch: rank %d %s; %s\n", r, describe(status).c_str(),
                       keep_going ? "the others go on (--keep-going)" : "stopping the others");
          if (!keep_going) kill_all();
        }
      }
      continue;
    }
    if (stop_signal != 0 && !stopped) {
      stopped = true;
      std::fprintf(stderr, "epcomm_launch: got %s; killing every rank\n",
                   signal_name(int(stop_signal)).c_str());
      kill_all();
      result = 128 + int(stop_signal);
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
  if (keep_going) {
    for (int r = 0; r < n; ++r)
      std::fprintf(stderr, "epcomm_launch: rank %d (pid %d): %s%s\n", r, int(pids[size_t(r)]),
                   describe(statuses[size_t(r)]).c_str(),
                   killed_by_us[size_t(r)] ? " (killed by epcomm_launch)" : "");
  }
  std::string rm = std::string("rm -rf ") + dir;
  if (std::system(rm.c_str()) != 0) std::fprintf(stderr, "epcomm_launch: cannot remove %s\n", dir);
  if (result > 0) return result;
  return all_skipped ? 77 : 0;
}

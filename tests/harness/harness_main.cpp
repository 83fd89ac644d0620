// The main of every weft MPI test executable. MPI and Kokkos start once per
// process; doctest runs the same test cases on every rank; after each test
// case the ranks agree (with a deadline) on who failed, and rank 0 prints each
// failing rank's checks. A rank that never reaches the end of a test case (a
// hang, or blocked by a failed peer) ends the job within a bounded time
// instead of hanging it: WEFT_TEST_DEADLINE (seconds, default 60) bounds the
// wait at the end of a test case, WEFT_TEST_TIMEOUT (default 600) bounds one
// test case on one rank, and weft's own waits are bounded by WEFT_DEADLINE
// (default here: twice WEFT_TEST_DEADLINE, so that a failing rank's report
// comes first).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "weft_test.hpp"

namespace {

weft::Comm* g_world = nullptr;
MPI_Comm g_harness = MPI_COMM_NULL;  // the harness' own traffic, never mixed with tests'
int g_rank = 0, g_size = 1;

double env_seconds(const char* name, double fallback) {
  const char* v = std::getenv(name);
  if (!v) return fallback;
  double d = std::atof(v);
  return d > 0 ? d : fallback;
}

[[noreturn]] void abort_job(const std::string& why) {
  std::fprintf(stderr, "[weft-test] rank %d: %s\n", g_rank, why.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  MPI_Abort(MPI_COMM_WORLD, 3);
  std::_Exit(3);
}

const std::string g_harness_axis = "harness";
std::vector<int> g_world_ranks;  // 0 .. size-1: the harness communicator is a duplicate of the world

// Completes a request on the harness communicator or ends the job at the
// deadline, naming the ranks that did not reach the end of the test case (the
// heartbeat table of weft's watchdog shows the harness' wait; its own deadline
// is this loop's).
void wait_or_abort(MPI_Request& rq, const std::string& test_name, const std::string& local_failures) {
  static constexpr const char* op = "the end of a test case";
  const double deadline = env_seconds("WEFT_TEST_DEADLINE", 60.0);
  weft::detail::WaitScope scope(op, g_harness_axis, g_world_ranks, 0);
  const auto t0 = std::chrono::steady_clock::now();
  for (long spin = 0;; ++spin) {
    int flag = 0;
    MPI_Test(&rq, &flag, MPI_STATUS_IGNORE);
    if (flag) return;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > deadline) {
      abort_job("test case '" + test_name + "' ended on this rank, but not every rank reached its end within " +
                std::to_string(deadline) +
                " s (WEFT_TEST_DEADLINE): a rank failed and left the others blocked, or a rank hangs." +
                weft::detail::Watchdog::instance().report(op, g_harness_axis, g_world_ranks) + "\n" +
                (local_failures.empty() ? std::string("This rank had no failures.")
                                        : "This rank's failures:\n" + local_failures));
    }
    if (spin > 64) std::this_thread::yield();
  }
}

// Ends the process when one test case runs longer than WEFT_TEST_TIMEOUT on
// this rank: Open MPI's launcher then ends every other rank.
struct Watchdog {
  std::atomic<double> started{-1.0};
  std::atomic<bool> stop{false};
  std::mutex name_mutex;
  std::string name;
  std::thread thread;

  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  void start() {
    const double limit = env_seconds("WEFT_TEST_TIMEOUT", 600.0);
    thread = std::thread([this, limit] {
      while (!stop.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        const double s = started.load();
        if (s > 0 && now() - s > limit) {
          std::string n;
          {
            std::lock_guard<std::mutex> g(name_mutex);
            n = name;
          }
          std::fprintf(stderr, "[weft-test] rank %d: test case '%s' is still running after %.0f s (WEFT_TEST_TIMEOUT): ending the job\n",
                       g_rank, n.c_str(), limit);
          std::fflush(stderr);
          std::_Exit(4);
        }
      }
    });
  }
  void enter(const char* n) {
    {
      std::lock_guard<std::mutex> g(name_mutex);
      name = n;
    }
    started.store(now());
  }
  void leave() { started.store(-1.0); }
  void finish() {
    stop.store(true);
    if (thread.joinable()) thread.join();
  }
};
Watchdog g_watchdog;

struct Totals {
  int passed = 0;
  int failed = 0;
};
Totals g_totals;

// Collects this rank's failures; at the end of each test case the ranks agree
// on who failed and rank 0 reports it.
struct MpiReporter : public doctest::IReporter {
  const doctest::ContextOptions& opt;
  const doctest::TestCaseData* tc = nullptr;
  std::string failures;

  explicit MpiReporter(const doctest::ContextOptions& in) : opt(in) {}

  void report_query(const doctest::QueryData& q) override {
    if (g_rank != 0) return;
    for (unsigned i = 0; i < q.num_data; ++i) std::printf("%s\n", q.data[i]->m_name);
  }
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData& in) override {
    tc = &in;
    failures.clear();
    g_watchdog.enter(in.m_name);
  }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats& st) override {
    g_watchdog.leave();
    const std::string name = tc ? tc->m_name : "?";
    int local = (st.failure_flags != 0 || st.numAssertsFailedCurrentTest > 0 || !failures.empty()) ? 1 : 0;
    if (local && failures.empty()) failures = "  (failed without a failing check: doctest failure flags " + std::to_string(st.failure_flags) + ")\n";
    // Who failed?
    std::vector<int> flags(static_cast<std::size_t>(g_size));
    MPI_Request rq;
    MPI_Iallgather(&local, 1, MPI_INT, flags.data(), 1, MPI_INT, g_harness, &rq);
    wait_or_abort(rq, name, failures);
    int any = 0;
    for (int f : flags) any |= f;
    if (!any) {
      ++g_totals.passed;
      if (g_rank == 0 && opt.success) std::printf("[weft-test] passed: %s\n", name.c_str());
      return;
    }
    ++g_totals.failed;
    // Gather the failure texts to rank 0.
    int len = static_cast<int>(failures.size());
    std::vector<int> lens(static_cast<std::size_t>(g_size));
    MPI_Igather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, g_harness, &rq);
    wait_or_abort(rq, name, failures);
    std::vector<int> displs(static_cast<std::size_t>(g_size), 0);
    int total = 0;
    for (int r = 0; r < g_size; ++r) {
      displs[static_cast<std::size_t>(r)] = total;
      total += lens[static_cast<std::size_t>(r)];
    }
    std::string all(static_cast<std::size_t>(g_rank == 0 ? total : 0), '\0');
    MPI_Igatherv(failures.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, 0, g_harness, &rq);
    wait_or_abort(rq, name, failures);
    if (g_rank != 0) return;
    std::string ranks;
    for (int r = 0; r < g_size; ++r)
      if (flags[static_cast<std::size_t>(r)]) ranks += std::string(ranks.empty() ? "" : ", ").append(std::to_string(r));
    std::printf("[weft-test] test case '%s' FAILED on rank(s) %s of %d:\n", name.c_str(), ranks.c_str(), g_size);
    for (int r = 0; r < g_size; ++r) {
      if (!flags[static_cast<std::size_t>(r)]) continue;
      std::printf("%s", all.substr(static_cast<std::size_t>(displs[static_cast<std::size_t>(r)]),
                                   static_cast<std::size_t>(lens[static_cast<std::size_t>(r)])).c_str());
    }
    std::fflush(stdout);
  }
  void test_case_exception(const doctest::TestCaseException& e) override {
    failures += "  rank " + std::to_string(g_rank) + ": " + (e.is_crash ? "crash: " : "exception: ") +
                e.error_string.c_str() + "\n";
  }
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData& a) override {
    if (!a.m_failed) return;
    std::string s = "  rank " + std::to_string(g_rank) + ": " + a.m_file + ":" + std::to_string(a.m_line) + ": " +
                    a.m_expr;
    if (a.m_threw) s += std::string(" threw: ") + a.m_exception.c_str();
    else if (a.m_decomp.size()) s += std::string("  (values: ") + a.m_decomp.c_str() + ")";
    failures += s + "\n";
  }
  void log_message(const doctest::MessageData& m) override {
    if (m.m_severity & doctest::assertType::is_warn) return;
    failures += "  rank " + std::to_string(g_rank) + ": " + m.m_file + ":" + std::to_string(m.m_line) + ": " +
                m.m_string.c_str() + "\n";
  }
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

}  // namespace

DOCTEST_REGISTER_REPORTER("weft-mpi", 1, MpiReporter);

namespace weft::test {
Comm& world() { return *g_world; }
}  // namespace weft::test

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  g_world = &env.world();
  g_rank = env.world().rank();
  g_size = env.world().size();
  MPI_Comm_dup(MPI_COMM_WORLD, &g_harness);
  for (int r = 0; r < g_size; ++r) g_world_ranks.push_back(r);
  // A rank that fails leaves its peers blocked in a collective: its own
  // failures are printed when the end-of-test-case wait passes
  // WEFT_TEST_DEADLINE, so unless WEFT_DEADLINE says otherwise the peers'
  // bounded waits (which end the job) get twice as long.
  if (std::getenv("WEFT_DEADLINE") == nullptr) {
    const double d = 2 * env_seconds("WEFT_TEST_DEADLINE", 60.0);
    weft::detail::checked_defaults().deadline_s = d;
    env.world().set_deadline(d);
  }
  g_watchdog.start();

  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  ctx.setOption("reporters", "weft-mpi");
  const int rc = ctx.run();
  g_watchdog.finish();

  // Every rank returns the same code, and every rank leaves the same way: when
  // one rank's communicators are unusable (a wait passed its deadline, an
  // operation was abandoned), weft::Environment ends the job with MPI_Abort
  // there, and a rank that called MPI_Finalize meanwhile can leave Open MPI's
  // launcher hanging. So then every rank takes the aborting path.
  int mine[2] = {(rc != 0 || g_totals.failed > 0) ? 1 : 0, weft::detail::comm_poisoned() ? 1 : 0}, any[2] = {0, 0};
  MPI_Request rq;
  MPI_Iallreduce(mine, any, 2, MPI_INT, MPI_MAX, g_harness, &rq);
  wait_or_abort(rq, "(end of run)", "");
  const int any_bad = any[0];
  if (any[1]) weft::detail::comm_poisoned() = true;
  if (g_rank == 0 && !ctx.shouldExit()) {
    std::printf("[weft-test] %d ranks: %d passed, %d failed\n", g_size, g_totals.passed, g_totals.failed);
    std::fflush(stdout);
  }
  MPI_Comm_free(&g_harness);
  return any_bad ? 1 : 0;
}

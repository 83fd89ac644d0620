// The two-host harness checks itself (tests/cluster/run.sh, 2 hosts x 2 ranks):
//   1. MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) gives one communicator per
//      host, of 2 ranks each, and its ranks share one processor name, which
//      differs between the two communicators;
//   2. bytes between two ranks of one host do not cross the link, and bytes
//      between hosts do: the transmit counter of the host's veth end
//      (/sys/class/net/weftc*/statistics/tx_bytes, seen from inside its
//      namespace) grows by at least the bytes sent, and the transfer's rate
//      stays below the link's tbf rate (--rate-mbit) with some slack.
// Prints "cluster harness: ok" on rank 0 when every check holds; otherwise
// the failed check and ends the job with MPI_Abort.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <set>
#include <string>
#include <vector>

namespace {

int world_rank = 0;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "cluster harness: FAILED on world rank %d: %s\n", world_rank, what.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

void require(bool ok, const std::string& what) {
  if (!ok) fail(what);
}

// The harness's veth end in this rank's network namespace (the only weftc* link there).
std::string link_name() {
  std::string found;
  if (DIR* d = opendir("/sys/class/net")) {
    while (dirent* e = readdir(d)) {
      if (std::strncmp(e->d_name, "weftc", 5) == 0) {
        require(found.empty(), "two weftc links in one namespace: " + found + " and " + e->d_name);
        found = e->d_name;
      }
    }
    closedir(d);
  }
  require(!found.empty(), "no weftc* link in /sys/class/net: not started by tests/cluster/run.sh?");
  return found;
}

long long tx_bytes(const std::string& link) {
  std::ifstream in("/sys/class/net/" + link + "/statistics/tx_bytes");
  long long v = -1;
  in >> v;
  require(in && v >= 0, "cannot read /sys/class/net/" + link + "/statistics/tx_bytes");
  return v;
}

std::vector<std::string> all_names(MPI_Comm comm, const std::string& mine) {
  int n = 0;
  MPI_Comm_size(comm, &n);
  std::vector<char> buf(std::size_t(n) * MPI_MAX_PROCESSOR_NAME, '\0');
  std::vector<char> own(MPI_MAX_PROCESSOR_NAME, '\0');
  std::memcpy(own.data(), mine.data(), mine.size());
  MPI_Allgather(own.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, buf.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, comm);
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.emplace_back(buf.data() + std::size_t(i) * MPI_MAX_PROCESSOR_NAME);
  return out;
}

// Sends `bytes` from world rank `from` to `to`; returns the seconds on `from`
// and the growth of its link's tx counter (both 0 elsewhere).
std::pair<double, long long> transfer(int from, int to, std::size_t bytes, const std::string& link) {
  std::vector<char> buf(bytes, char(1));
  MPI_Barrier(MPI_COMM_WORLD);
  double secs = 0;
  long long grown = 0;
  if (world_rank == from) {
    const long long before = tx_bytes(link);
    const auto t0 = std::chrono::steady_clock::now();
    MPI_Send(buf.data(), int(bytes), MPI_CHAR, to, 7, MPI_COMM_WORLD);
    char ack = 0;
    MPI_Recv(&ack, 1, MPI_CHAR, to, 8, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    grown = tx_bytes(link) - before;
  } else if (world_rank == to) {
    MPI_Recv(buf.data(), int(bytes), MPI_CHAR, from, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    char ack = 1;
    MPI_Send(&ack, 1, MPI_CHAR, from, 8, MPI_COMM_WORLD);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  return {secs, grown};
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  double rate_mbit = 1000;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--rate-mbit") rate_mbit = std::atof(argv[i + 1]);
  require(size == 4, "expected 4 ranks (2 hosts x 2), got " + std::to_string(size));

  char name_buf[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(name_buf, &len);
  const std::string name(name_buf, std::size_t(len));
  const auto names = all_names(MPI_COMM_WORLD, name);

  // 1. One shared-memory communicator per host.
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank, MPI_INFO_NULL, &node);
  int node_size = 0, node_rank = 0;
  MPI_Comm_size(node, &node_size);
  MPI_Comm_rank(node, &node_rank);
  require(node_size == 2, "MPI_COMM_TYPE_SHARED gave a communicator of " + std::to_string(node_size) +
                              " ranks, expected 2 (one per host): the hosts are not separate to MPI");
  for (const auto& peer : all_names(node, name))
    require(peer == name, "a shared-memory communicator holds ranks of hosts " + name + " and " + peer);
  // Count the communicators: one leader (node rank 0) per host.
  int leaders = 0, leader = node_rank == 0 ? 1 : 0;
  MPI_Allreduce(&leader, &leaders, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  require(leaders == 2, std::to_string(leaders) + " shared-memory communicators, expected 2");
  const std::set<std::string> distinct(names.begin(), names.end());
  require(distinct.size() == 2, std::to_string(distinct.size()) + " distinct processor names, expected 2");

  // 2. Where the bytes go. World rank 0's peers: one on its host, one on the other.
  int same = -1, other = -1;
  for (int r = 1; r < size; ++r) {
    if (names[std::size_t(r)] == names[0] && same < 0) same = r;
    if (names[std::size_t(r)] != names[0] && other < 0) other = r;
  }
  require(same > 0 && other > 0, "world rank 0 has no peer on its own host or none on the other");
  const std::string link = link_name();
  const std::size_t bytes = std::size_t(8) << 20;
  const auto inside = transfer(0, same, bytes, link);
  const auto across = transfer(0, other, bytes, link);
  if (world_rank == 0) {
    const double mbit = double(bytes) * 8 / across.first / 1e6;
    std::printf("cluster harness: hosts %s (ranks", names[0].c_str());
    for (int r = 0; r < size; ++r)
      if (names[std::size_t(r)] == names[0]) std::printf(" %d", r);
    std::printf(") and %s (ranks", names[std::size_t(other)].c_str());
    for (int r = 0; r < size; ++r)
      if (names[std::size_t(r)] != names[0]) std::printf(" %d", r);
    std::printf(")\n");
    std::printf("cluster harness: %zu bytes rank 0 -> %d (same host): link %s tx +%lld bytes\n", bytes, same, link.c_str(),
                inside.second);
    std::printf("cluster harness: %zu bytes rank 0 -> %d (other host): link %s tx +%lld bytes in %.3f s (%.0f Mbit/s, tbf %.0f Mbit/s)\n",
                bytes, other, link.c_str(), across.second, across.first, mbit, rate_mbit);
    require(inside.second < (long long)(bytes / 4),
            "a transfer inside a host put " + std::to_string(inside.second) + " bytes on the link (expected shared memory)");
    require(across.second >= (long long)bytes,
            "a transfer across hosts put only " + std::to_string(across.second) + " of " + std::to_string(bytes) +
                " bytes on the link (expected TCP over the veth pair)");
    // tbf lets a burst of 256 KiB through at once; beyond that the rate holds.
    require(mbit < 1.25 * rate_mbit, "the transfer across hosts ran at " + std::to_string(mbit) +
                                         " Mbit/s, above the link's tbf rate of " + std::to_string(rate_mbit));
    std::printf("cluster harness: ok\n");
  }
  MPI_Comm_free(&node);
  MPI_Finalize();
  return 0;
}

// Which ranks share a node. Every node split of weft goes through
// split_by_node, so that the testing switch WEFT_TEST_RANKS_PER_NODE=K (every
// K consecutive world ranks count as one node) reaches all of them: the mesh's
// node communicator, the transports that bypass MPI inside a node, and the
// heartbeat table of the wait watchdog.
#pragma once

#include <mpi.h>

#include <cstdlib>
#include <string>

namespace weft::detail {

/// K of WEFT_TEST_RANKS_PER_NODE (testing only: every K consecutive ranks of
/// MPI_COMM_WORLD count as one node, inside the real node), or 0 when the
/// variable is unset, empty or not a positive integer (read once).
inline int test_ranks_per_node() {
  static const int k = [] {
    const char* e = std::getenv("WEFT_TEST_RANKS_PER_NODE");
    if (e == nullptr || *e == '\0') return 0;
    char* end = nullptr;
    const long v = std::strtol(e, &end, 10);
    return (*end == '\0' && v > 0 && v < (1L << 30)) ? static_cast<int>(v) : 0;
  }();
  return k;
}

/// Splits `parent` into the groups of ranks that share a node, like
/// MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) ordered by `key`; with
/// WEFT_TEST_RANKS_PER_NODE=K each real node is further split by world rank / K.
/// Collective over parent; returns MPI's error code.
inline int split_by_node(MPI_Comm parent, int key, MPI_Comm* out) {
  MPI_Comm shared = MPI_COMM_NULL;
  int rc = MPI_Comm_split_type(parent, MPI_COMM_TYPE_SHARED, key, MPI_INFO_NULL, &shared);
  if (rc != MPI_SUCCESS || test_ranks_per_node() == 0) {
    *out = shared;
    return rc;
  }
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  rc = MPI_Comm_split(shared, world_rank / test_ranks_per_node(), key, out);
  MPI_Comm_free(&shared);
  return rc;
}

/// How many ranks of `parent` share this rank's node (split_by_node's group
/// size; 1 when the split fails). Collective over parent.
inline int ranks_on_node(MPI_Comm parent) {
  MPI_Comm node = MPI_COMM_NULL;
  if (split_by_node(parent, 0, &node) != MPI_SUCCESS) return 1;
  int n = 1;
  MPI_Comm_size(node, &n);
  MPI_Comm_free(&node);
  return n;
}

/// The name of this rank's node as records give it: MPI's processor name,
/// and with WEFT_TEST_RANKS_PER_NODE=K also "/node<i>" for the i-th group of K
/// world ranks, so that a record of a simulated multi-node run shows as many
/// hosts as the run had nodes. At most MPI_MAX_PROCESSOR_NAME - 1 characters.
inline std::string node_name() {
  char host[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(host, &len);
  std::string name(host, static_cast<std::size_t>(len));
  if (const int k = test_ranks_per_node()) {
    int world_rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    const std::string suffix = "/node" + std::to_string(world_rank / k);
    name = name.substr(0, std::size_t(MPI_MAX_PROCESSOR_NAME) - 1 - suffix.size()) + suffix;
  }
  return name;
}

}  // namespace weft::detail

namespace weft {

/// How many ranks of `comm` share this rank's node, at least 1: a program's
/// count for dividing the node's cores among its ranks (e.g.
/// ops::set_blas_threads). Follows WEFT_TEST_RANKS_PER_NODE like every node
/// split of weft. Collective over comm.
inline int ranks_on_node(MPI_Comm comm) { return detail::ranks_on_node(comm); }

}  // namespace weft

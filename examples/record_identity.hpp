// What a run record says about how the run's MPI library was configured:
// the transport between the hosts and inside a host (the record's
// topology.transport). Read once, on the rank that writes the record.
#pragma once

#include <mpi.h>

#include <cstdlib>
#include <sstream>
#include <string>

#include <weft/metrics/json.hpp>

namespace record_identity {

using weft::metrics::Json;

// The transport between the hosts and inside a host, as the run was
// configured. Open MPI (ob1) picks a BTL per pair of ranks: shared memory
// (vader, sm) inside a host, the others (tcp, ...) between hosts. Recorded is
// the configuration that mpirun's --mca btl and pml pass to the ranks
// (OMPI_MCA_btl, OMPI_MCA_pml in their environment), not an observation of
// each pair: where the btl list is unset or an exclusion (^...), both
// transports are null. (Open MPI's tool interface, MPI_T, would also see its
// parameter files, but one read costs about 0.33 s here.)
inline Json mpi_transport() {
  Json transport = Json::object();
#if defined(OPEN_MPI) && OPEN_MPI
  auto env = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v ? v : "");
  };
  const std::string btl = env("OMPI_MCA_btl"), pml = env("OMPI_MCA_pml");
  std::string inside, between;
  if (!btl.empty() && btl[0] != '^') {
    std::istringstream in(btl);
    for (std::string b; std::getline(in, b, ',');) {
      if (b.empty() || b == "self") continue;
      std::string& to = (b == "vader" || b == "sm" || b == "smcuda") ? inside : between;
      to += (to.empty() ? "" : ",") + b;
    }
  }
  transport.set("inside_host", inside.empty() ? Json(nullptr) : Json(inside))
      .set("between_hosts", between.empty() ? Json(nullptr) : Json(between))
      .set("btl", btl).set("pml", pml)
      .set("source", "configured, not observed per pair of ranks: Open MPI's MCA parameters btl and pml as mpirun "
                     "passes them (OMPI_MCA_btl, OMPI_MCA_pml; empty: unset, Open MPI's own selection); inside_host: "
                     "the shared-memory BTLs of an explicit btl list, between_hosts: its other BTLs; null where the "
                     "list is unset or an exclusion (^...)");
#else
  transport.set("inside_host", Json(nullptr)).set("between_hosts", Json(nullptr))
      .set("source", "not read: only Open MPI's configuration is read (its MCA parameters btl and pml)");
#endif
  return transport;
}

}  // namespace record_identity

// Transports: how a communicator's bytes move, as types. Placements choose
// the collective (redistribute: all_gather, all_to_all, ...); the transport
// chooses the path the bytes take. CommOver<Transport> (comm/nccl.hpp) names
// the communicator class of each transport.
#pragma once

#include <Kokkos_Core.hpp>
#include <type_traits>

namespace weft {

namespace transport {
/// MPI only (weft::Comm): host views, and device views through GPU-aware MPI
/// or host staging.
struct Mpi {};
/// NCCL (weft::NcclComm, comm/nccl.hpp): CUDA device views, on their
/// execution space's stream.
struct Nccl {};
/// MPI, with the node-local paths of comm/node_local.hpp in front of it for
/// host memory: when every rank of the communicator shares one node, a
/// strided exchange (ChunkLayout) copies the peers' blocks straight out of
/// node-shared windows (weft::NodeShared), reads them with Linux
/// cross-memory attach (process_vm_readv), or stages them through the
/// communicator's node-shared scratch window; each path is decided at run
/// time, by every rank alike, and MPI's collective runs where none applies.
/// The communicator is weft::Comm. The default for host memory.
struct NodeLocal {};

/// Whether T is one of weft's transports.
template <class T>
inline constexpr bool is_transport_v =
    std::is_same_v<T, Mpi> || std::is_same_v<T, Nccl> || std::is_same_v<T, NodeLocal>;

/// The transport redistribute uses for views in Space when none is named:
/// NodeLocal for memory the host can access, Mpi otherwise. A program may
/// specialise it for its own memory spaces.
template <class Space>
struct default_for {
  using type = std::conditional_t<Kokkos::SpaceAccessibility<Kokkos::HostSpace, Space>::accessible, NodeLocal, Mpi>;
};
/// default_for<Space>::type.
template <class Space>
using default_for_t = typename default_for<Space>::type;
}  // namespace transport

/// A transport type: weft::transport::Mpi, Nccl or NodeLocal.
template <class T>
concept Transport = transport::is_transport_v<T>;

class Comm;
class NcclComm;

namespace detail {
template <class Tr>
struct comm_over;  // comm/nccl.hpp specialises it for transport::Nccl
template <>
struct comm_over<transport::Mpi> {
  using type = Comm;
};
template <>
struct comm_over<transport::NodeLocal> {
  using type = Comm;
};
}  // namespace detail

/// The communicator of a transport: CommOver<transport::Mpi> and
/// CommOver<transport::NodeLocal> are weft::Comm, CommOver<transport::Nccl>
/// is weft::NcclComm (include weft/comm/nccl.hpp for it).
template <Transport Tr>
using CommOver = typename detail::comm_over<Tr>::type;

}  // namespace weft

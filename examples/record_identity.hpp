// What a run record says about the build and the machine a run used, as an
// honest measurement needs it: the compiler and its flags, Kokkos (version,
// backends) and Kokkos Kernels, the BLAS and the GEMM provider, the CPU model
// and ISA, the GPU where there is one, and the MPI library with the transport
// the run was configured with. Everything is read once, on the rank that
// writes the record: a few hundred microseconds, none of it in the steps.
#pragma once

#include <mpi.h>
#include <sys/utsname.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <weft/metrics/json.hpp>
#include <weft/ops/blas_threads.hpp>
#include <weft/ops/gemm_provider.hpp>

#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime.h>
#elif defined(KOKKOS_ENABLE_HIP)
#include <hip/hip_runtime.h>
#endif
#if WEFT_ONEDNN_PROVIDER
#include <oneapi/dnnl/dnnl.h>
#endif
#if __has_include(<Trilinos_version.h>)
#include <Trilinos_version.h>
#endif
// The compiler's identity and flags as CMake configured them (examples/CMakeLists.txt).
#if __has_include("weft_build_identity.hpp")
#include "weft_build_identity.hpp"
#endif

namespace record_identity {

using weft::metrics::Json;

// The first "key : value" line of /proc/cpuinfo whose key is `key` ("" if none).
inline std::string cpuinfo_field(const std::string& text, const char* key) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string k = line.substr(0, colon);
    while (!k.empty() && (k.back() == ' ' || k.back() == '\t')) k.pop_back();
    if (k != key) continue;
    std::string v = line.substr(colon + 1);
    while (!v.empty() && v.front() == ' ') v.erase(v.begin());
    return v;
  }
  return {};
}

// The CPU: its model name, architecture, logical cores, and which of the
// instruction sets that matter to weft's kernels and GEMM providers it has.
inline Json cpu() {
  std::ifstream f("/proc/cpuinfo");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string text = ss.str();
  std::string model = cpuinfo_field(text, "model name");
  if (model.empty()) model = cpuinfo_field(text, "Model");  // some Arm kernels
  std::string flags = cpuinfo_field(text, "flags");
  if (flags.empty()) flags = cpuinfo_field(text, "Features");  // Arm
  std::vector<std::string> have;
  {
    std::istringstream in(flags);
    for (std::string w; in >> w;) have.push_back(w);
  }
  static const char* const wanted[] = {"sse4_2",   "avx",         "avx2",        "fma",      "f16c",
                                       "avx512f",  "avx512bw",    "avx512vl",    "avx512dq", "avx512_vnni",
                                       "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
                                       "asimd",    "asimdhp",     "sve",         "sve2",     "bf16",
                                       "i8mm"};
  Json::Array isa;
  for (const char* w : wanted)
    if (std::find(have.begin(), have.end(), w) != have.end()) isa.push_back(Json(w));
  utsname u{};
  const std::string arch = uname(&u) == 0 ? u.machine : "";
  return Json::object()
      .set("model", model.empty() ? Json(nullptr) : Json(model))
      .set("architecture", arch)
      .set("logical_cores", Json(std::size_t(std::thread::hardware_concurrency())))
      .set("isa", Json(isa))
      .set("isa_source", "/proc/cpuinfo flags, those of this list present: sse4_2 avx avx2 fma f16c avx512f avx512bw "
                         "avx512vl avx512dq avx512_vnni avx512_bf16 avx512_fp16 amx_tile amx_bf16 amx_int8 asimd "
                         "asimdhp sve sve2 bf16 i8mm");
}

// The GPU of this rank's Kokkos device, or null on a host-only build.
inline Json gpu() {
#if defined(KOKKOS_ENABLE_CUDA)
  int dev = 0;
  cudaDeviceProp p{};
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&p, dev) != cudaSuccess) return Json(nullptr);
  return Json::object().set("model", std::string(p.name)).set("runtime", "cuda")
      .set("compute_capability", std::to_string(p.major) + "." + std::to_string(p.minor))
      .set("memory_bytes", Json(std::size_t(p.totalGlobalMem)));
#elif defined(KOKKOS_ENABLE_HIP)
  int dev = 0;
  hipDeviceProp_t p{};
  if (hipGetDevice(&dev) != hipSuccess || hipGetDeviceProperties(&p, dev) != hipSuccess) return Json(nullptr);
  return Json::object().set("model", std::string(p.name)).set("runtime", "hip")
      .set("architecture", std::string(p.gcnArchName)).set("memory_bytes", Json(std::size_t(p.totalGlobalMem)));
#else
  return Json(nullptr);
#endif
}

inline std::string version_string(int v) {  // 30401 -> "3.4.1"
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

// Kokkos: the version and the backends this build enabled; Kokkos Kernels' version where it says it.
inline Json kokkos() {
  Json::Array backends;
#if defined(KOKKOS_ENABLE_SERIAL)
  backends.push_back(Json("Serial"));
#endif
#if defined(KOKKOS_ENABLE_OPENMP)
  backends.push_back(Json("OpenMP"));
#endif
#if defined(KOKKOS_ENABLE_THREADS)
  backends.push_back(Json("Threads"));
#endif
#if defined(KOKKOS_ENABLE_HPX)
  backends.push_back(Json("HPX"));
#endif
#if defined(KOKKOS_ENABLE_CUDA)
  backends.push_back(Json("Cuda"));
#endif
#if defined(KOKKOS_ENABLE_HIP)
  backends.push_back(Json("HIP"));
#endif
#if defined(KOKKOS_ENABLE_SYCL)
  backends.push_back(Json("SYCL"));
#endif
#if defined(KOKKOS_ENABLE_OPENMPTARGET)
  backends.push_back(Json("OpenMPTarget"));
#endif
  Json kernels = Json::object();
#if defined(KOKKOSKERNELS_VERSION)
  kernels.set("version", version_string(KOKKOSKERNELS_VERSION)).set("version_source", "KOKKOSKERNELS_VERSION");
#elif defined(TRILINOS_VERSION_STRING)
  kernels.set("version", std::string("Trilinos ") + TRILINOS_VERSION_STRING)
      .set("version_source", "Trilinos_version.h: this Kokkos Kernels is Trilinos' own and defines no version of its own");
#else
  kernels.set("version", Json(nullptr)).set("version_source", "no version macro found");
#endif
  return Json::object()
      .set("version", version_string(KOKKOS_VERSION))
      .set("backends", Json(backends))
      .set("default_execution_space", Kokkos::DefaultExecutionSpace::name())
      .set("kokkos_kernels", kernels);
}

// The BLAS library behind Kokkos Kernels' host gemm, as it names itself
// (OpenBLAS' configuration string, MKL's or BLIS' version), or null.
inline Json blas() {
  using get_str = char* (*)();
  if (auto f = reinterpret_cast<get_str>(weft::ops::detail::blas_symbol("openblas_get_config")))
    return Json::object().set("library", "OpenBLAS").set("config", std::string(f()));
  using mkl_ver = void (*)(char*, int);
  if (auto f = reinterpret_cast<mkl_ver>(weft::ops::detail::blas_symbol("MKL_Get_Version_String"))) {
    char b[256] = {};
    f(b, int(sizeof b));
    return Json::object().set("library", "MKL").set("config", std::string(b));
  }
  using blis_ver = const char* (*)();
  if (auto f = reinterpret_cast<blis_ver>(weft::ops::detail::blas_symbol("bli_info_get_version_str")))
    return Json::object().set("library", "BLIS").set("config", std::string(f()));
  return Json(nullptr);
}

// oneDNN where weft's oneDNN provider is compiled in: the version the
// loaded library reports (dnnl_version), else null.
inline Json onednn() {
#if WEFT_ONEDNN_PROVIDER
  const dnnl_version_t* v = dnnl_version();
  if (v == nullptr) return Json(nullptr);
  return Json::object()
      .set("version", std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch))
      .set("hash", v->hash ? std::string(v->hash) : std::string());
#else
  return Json(nullptr);
#endif
}

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

// The MPI library (MPI_Get_library_version) and the standard it implements.
inline Json mpi() {
  char lib[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MPI_Get_library_version(lib, &len);
  std::string library(lib, std::size_t(std::max(0, len)));
  while (!library.empty() && (library.back() == '\n' || library.back() == ' ' || library.back() == '\0'))
    library.pop_back();
  int major = 0, minor = 0;
  MPI_Get_version(&major, &minor);
  return Json::object().set("library", library).set("standard", std::to_string(major) + "." + std::to_string(minor));
}

// The compiler that built this program and its flags.
inline Json compiler() {
#if defined(WEFT_BUILD_CXX_COMPILER_ID)
  return Json::object()
      .set("id", WEFT_BUILD_CXX_COMPILER_ID).set("version", WEFT_BUILD_CXX_COMPILER_VERSION)
      .set("build_type", WEFT_BUILD_TYPE).set("flags", WEFT_BUILD_CXX_FLAGS)
      .set("source", "CMake: CMAKE_CXX_COMPILER_ID and _VERSION, CMAKE_BUILD_TYPE, CMAKE_CXX_FLAGS and the build "
                     "type's CMAKE_CXX_FLAGS_<CONFIG> (target options such as warnings and Kokkos' own not listed)");
#else
  return Json::object().set("id", Json(nullptr)).set("version", __VERSION__).set("build_type", Json(nullptr)).set("flags", Json(nullptr))
      .set("source", "__VERSION__ (built without CMake's identity header)");
#endif
}

/// The record's `identity` object. `gemm_provider`: the provider of the
/// model's float products (weft::ops::float_gemm_provider_name).
inline Json identity(const char* gemm_provider) {
  return Json::object()
      .set("compiler", compiler())
      .set("kokkos", kokkos())
      .set("gemm_provider", gemm_provider)
      .set("onednn", onednn())
      .set("blas", blas())
      .set("cpu", cpu())
      .set("gpu", gpu())
      .set("mpi", mpi());
}

}  // namespace record_identity

# Finds weft's dependencies -- MPI, Kokkos and Kokkos Kernels -- and guarantees
# the targets MPI::MPI_CXX, Kokkos::kokkos and Kokkos::kokkoskernels, whether
# Kokkos comes from a standard Kokkos >= 4 install or from Debian's
# Trilinos-packaged 3.4 (targets trilinos_kokkoscore / trilinos_kokkoskernels
# and an exported include directory that does not exist).
# Used by weft's own build and installed beside weftConfig.cmake.
include_guard(GLOBAL)

set(_weft_install_hint
  "On Debian/Ubuntu run scripts/install_deps.sh from the weft source tree, or:\n"
  "  apt-get install libtrilinos-kokkos-dev libtrilinos-kokkos-kernels-dev libopenmpi-dev openmpi-bin libopenblas-dev\n"
  "Elsewhere install Kokkos >= 4 and Kokkos Kernels (any backend) and pass -DKokkos_ROOT=<prefix> -DKokkosKernels_ROOT=<prefix>.")

find_package(MPI QUIET COMPONENTS CXX)
if(NOT MPI_CXX_FOUND)
  message(FATAL_ERROR "weft: MPI (C++ bindings of the C API) was not found.\n" ${_weft_install_hint})
endif()

find_package(Kokkos CONFIG QUIET)
if(NOT Kokkos_FOUND)
  message(FATAL_ERROR "weft: Kokkos was not found (neither a Kokkos >= 4 install nor Debian's Trilinos-packaged Kokkos).\n" ${_weft_install_hint})
endif()

# Trilinos' TriBITS config sets Kokkos_PACKAGE_LIST and defines trilinos_* targets.
if(TARGET trilinos_kokkoscore OR DEFINED Kokkos_PACKAGE_LIST)
  set(WEFT_KOKKOS_FLAVOR "trilinos")
  # Its Kokkos::kokkos names <prefix>/lib/include, which does not exist; the
  # headers are in Kokkos_INCLUDE_DIRS. Keep only the directories that exist.
  set(_weft_kokkos_inc "")
  foreach(_dir IN LISTS Kokkos_INCLUDE_DIRS)
    get_filename_component(_dir "${_dir}" REALPATH)
    if(IS_DIRECTORY "${_dir}")
      list(APPEND _weft_kokkos_inc "${_dir}")
    endif()
  endforeach()
  if(NOT _weft_kokkos_inc OR NOT EXISTS "${_weft_kokkos_inc}/Kokkos_Core.hpp")
    message(FATAL_ERROR "weft: Trilinos-packaged Kokkos found at ${Kokkos_DIR}, but Kokkos_Core.hpp is not in '${Kokkos_INCLUDE_DIRS}'.\n" ${_weft_install_hint})
  endif()
  if(NOT TARGET Kokkos::kokkos)
    add_library(Kokkos::kokkos INTERFACE IMPORTED)
    set_property(TARGET Kokkos::kokkos PROPERTY INTERFACE_LINK_LIBRARIES ${Kokkos_LIBRARIES})
  endif()
  set_property(TARGET Kokkos::kokkos PROPERTY INTERFACE_INCLUDE_DIRECTORIES "${_weft_kokkos_inc}")
  if(NOT Kokkos_VERSION)
    file(STRINGS "${_weft_kokkos_inc}/KokkosCore_config.h" _weft_kv REGEX "define KOKKOS_VERSION ")
    string(REGEX REPLACE ".*KOKKOS_VERSION ([0-9]+).*" "\\1" _weft_kv "${_weft_kv}")
    math(EXPR _maj "${_weft_kv} / 10000")
    math(EXPR _min "(${_weft_kv} / 100) % 100")
    math(EXPR _pat "${_weft_kv} % 100")
    set(Kokkos_VERSION "${_maj}.${_min}.${_pat}")
  endif()
else()
  set(WEFT_KOKKOS_FLAVOR "standard")
  if(NOT TARGET Kokkos::kokkos)
    message(FATAL_ERROR "weft: Kokkos found at ${Kokkos_DIR} but it defines no Kokkos::kokkos target.\n" ${_weft_install_hint})
  endif()
endif()
if(Kokkos_VERSION VERSION_LESS 3.4)
  message(FATAL_ERROR "weft: Kokkos ${Kokkos_VERSION} is too old; weft needs 3.4 (Debian) or >= 4.0.\n" ${_weft_install_hint})
endif()

find_package(KokkosKernels CONFIG QUIET)
if(NOT KokkosKernels_FOUND)
  message(FATAL_ERROR "weft: Kokkos Kernels was not found (Kokkos ${Kokkos_VERSION} was, at ${Kokkos_DIR}).\n" ${_weft_install_hint})
endif()
if(NOT TARGET Kokkos::kokkoskernels)
  if(TARGET trilinos_kokkoskernels)
    add_library(Kokkos::kokkoskernels INTERFACE IMPORTED)
    set_property(TARGET Kokkos::kokkoskernels PROPERTY INTERFACE_LINK_LIBRARIES trilinos_kokkoskernels Kokkos::kokkos)
  else()
    message(FATAL_ERROR "weft: Kokkos Kernels found at ${KokkosKernels_DIR} but it defines neither Kokkos::kokkoskernels nor trilinos_kokkoskernels.\n" ${_weft_install_hint})
  endif()
endif()

# Kokkos Kernels must come from the same release as Kokkos: built against
# another Kokkos, its explicit instantiations (KokkosBlas::Impl::Scal<...> and
# kin) name execution spaces that the Kokkos in use does not have, and a
# program then links two Kokkos core libraries or fails to link. Major and
# minor must match; the patch level may differ (Kokkos ships patch releases
# that Kokkos Kernels does not follow one for one).
# A standard install reports its version through KokkosKernelsConfigVersion.cmake.
# Debian's TriBITS-packaged Kokkos Kernels reports none: it is part of one
# Trilinos release, whose Kokkos version is in the KokkosCore_config.h beside
# its headers.
set(WEFT_KOKKOSKERNELS_VERSION "${KokkosKernels_VERSION}")
if(NOT WEFT_KOKKOSKERNELS_VERSION AND DEFINED KokkosKernels_PACKAGE_LIST)
  foreach(_dir IN LISTS KokkosKernels_INCLUDE_DIRS)
    get_filename_component(_dir "${_dir}" REALPATH)
    if(EXISTS "${_dir}/KokkosCore_config.h")
      file(STRINGS "${_dir}/KokkosCore_config.h" _weft_kkv REGEX "define KOKKOS_VERSION ")
      string(REGEX REPLACE ".*KOKKOS_VERSION ([0-9]+).*" "\\1" _weft_kkv "${_weft_kkv}")
      math(EXPR _maj "${_weft_kkv} / 10000")
      math(EXPR _min "(${_weft_kkv} / 100) % 100")
      math(EXPR _pat "${_weft_kkv} % 100")
      set(WEFT_KOKKOSKERNELS_VERSION "${_maj}.${_min}.${_pat}")
      break()
    endif()
  endforeach()
endif()
if(NOT WEFT_KOKKOSKERNELS_VERSION)
  message(FATAL_ERROR "weft: Kokkos Kernels found at ${KokkosKernels_DIR} reports no version, so weft cannot check that it "
          "matches Kokkos ${Kokkos_VERSION} (at ${Kokkos_DIR}).\n" ${_weft_install_hint})
endif()
string(REGEX MATCH "^[0-9]+\\.[0-9]+" _weft_k_mm "${Kokkos_VERSION}")
string(REGEX MATCH "^[0-9]+\\.[0-9]+" _weft_kk_mm "${WEFT_KOKKOSKERNELS_VERSION}")
if(NOT _weft_k_mm VERSION_EQUAL _weft_kk_mm)
  message(FATAL_ERROR "weft: Kokkos Kernels ${WEFT_KOKKOSKERNELS_VERSION} (at ${KokkosKernels_DIR}) does not match "
          "Kokkos ${Kokkos_VERSION} (at ${Kokkos_DIR}); their major and minor versions must be equal.\n"
          "Point CMake at the Kokkos Kernels built with this Kokkos: -DKokkosKernels_ROOT=<the prefix of Kokkos Kernels ${Kokkos_VERSION}> "
          "(or -DKokkosKernels_DIR=<its lib/cmake/KokkosKernels>), or at the Kokkos that this Kokkos Kernels was built with.")
endif()

if(NOT weft_FIND_QUIETLY)
  message(STATUS "weft: Kokkos ${Kokkos_VERSION} (${WEFT_KOKKOS_FLAVOR}) at ${Kokkos_DIR}; "
                 "Kokkos Kernels ${WEFT_KOKKOSKERNELS_VERSION} at ${KokkosKernels_DIR}; MPI ${MPI_CXX_VERSION}")
endif()

# oneDNN, the host GEMM provider for float and bf16 products
# (weft/ops/gemm_onednn.hpp). WEFT_ENABLE_ONEDNN: AUTO (default) uses it when
# its CMake package (DNNL::dnnl) is found, ON requires it, OFF never uses it
# (products then go to Kokkos Kernels, and so to the system BLAS).
# WEFT_HAVE_ONEDNN says what was decided; weftConfig.cmake passes weft's own
# decision here, so a consumer links the oneDNN that weft was built with.
if(NOT DEFINED WEFT_ENABLE_ONEDNN)
  set(WEFT_ENABLE_ONEDNN AUTO)
endif()
set(WEFT_HAVE_ONEDNN OFF)
if(WEFT_ENABLE_ONEDNN STREQUAL "AUTO" OR WEFT_ENABLE_ONEDNN)
  find_package(dnnl CONFIG QUIET)
  if(dnnl_FOUND AND TARGET DNNL::dnnl)
    set(WEFT_HAVE_ONEDNN ON)
  elseif(NOT WEFT_ENABLE_ONEDNN STREQUAL "AUTO")
    message(FATAL_ERROR "weft: WEFT_ENABLE_ONEDNN=${WEFT_ENABLE_ONEDNN} but oneDNN's CMake package (dnnl, target DNNL::dnnl) "
                        "was not found. Install it (Debian/Ubuntu: apt-get install libdnnl-dev), point -Ddnnl_DIR=<prefix>/lib/cmake/dnnl "
                        "at another install, or configure with -DWEFT_ENABLE_ONEDNN=OFF to use Kokkos Kernels for every product.")
  endif()
endif()

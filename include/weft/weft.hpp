// The umbrella header: everything weft offers. Include this, or the headers of
// the layers you use.
#pragma once

#include <weft/config.hpp>
#include <weft/core/error.hpp>
#include <weft/core/kokkos_compat.hpp>
#include <weft/core/version.hpp>
#include <weft/comm/datatype.hpp>
#include <weft/comm/stats.hpp>
#include <weft/comm/request.hpp>
#include <weft/comm/comm.hpp>
#include <weft/comm/environment.hpp>
#include <weft/mesh/axis.hpp>
#include <weft/mesh/mesh.hpp>
#include <weft/ops/ops.hpp>
#include <weft/placement/placement.hpp>
#include <weft/placement/dist_view.hpp>
#include <weft/placement/node_shared.hpp>
#include <weft/placement/redistribute.hpp>
#include <weft/placement/propagation.hpp>
#include <weft/nn/nn.hpp>
#include <weft/optim/optim.hpp>
#include <weft/data/corpus.hpp>
#include <weft/data/stream.hpp>
#include <weft/optim/train_step.hpp>
#include <weft/metrics/metrics.hpp>
#include <weft/parallel/data_parallel.hpp>
#include <weft/parallel/train_step.hpp>
#include <weft/parallel/pipeline/simulator.hpp>
#include <weft/parallel/pipeline/partition.hpp>
#include <weft/parallel/pipeline/stage.hpp>
#include <weft/parallel/pipeline/executor.hpp>
#include <weft/plan/model.hpp>
#include <weft/plan/memory.hpp>
#include <weft/plan/meshes.hpp>
#include <weft/plan/json_read.hpp>
#include <weft/plan/presets.hpp>

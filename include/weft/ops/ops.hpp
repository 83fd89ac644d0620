// All of weft's kernels: gemm, norms, activations, softmax, embeddings,
// blockwise attention, rotary positions, cross-entropy, counter-based
// initialisation.
#pragma once

#include <weft/ops/blas_threads.hpp>
#include <weft/ops/common.hpp>
#include <weft/ops/cross_entropy.hpp>
#include <weft/ops/elementwise.hpp>
#include <weft/ops/embedding.hpp>
#include <weft/ops/flash_attention.hpp>
#include <weft/ops/gemm.hpp>
#include <weft/ops/norm.hpp>
#include <weft/ops/random.hpp>
#include <weft/ops/rotary.hpp>
#include <weft/ops/softmax.hpp>

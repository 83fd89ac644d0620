// All of weft's layers: Linear (plain and placed over a TP axis), Embedding, Norm,
// Attention, MLP, Block, GPT.
#pragma once

#include <weft/nn/attention.hpp>
#include <weft/nn/block.hpp>
#include <weft/nn/config.hpp>
#include <weft/nn/embedding.hpp>
#include <weft/nn/gpt.hpp>
#include <weft/nn/layer.hpp>
#include <weft/nn/linear.hpp>
#include <weft/nn/mlp.hpp>
#include <weft/nn/moe.hpp>
#include <weft/nn/norm.hpp>
#include <weft/nn/parameter.hpp>
#include <weft/nn/sequence_attention.hpp>
#include <weft/nn/tensor_parallel.hpp>
#include <weft/nn/tp_comm.hpp>

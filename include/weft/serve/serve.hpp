// The serving runtime: the KV block cache, the batching scheduler (a pure
// function), the sampler, the inference pass of the reference GPT and the
// engine over them, and the request lengths of the traffic models.
// docs/serving.md describes how they fit.
#pragma once

#include <weft/serve/kv_cache.hpp>
#include <weft/serve/scheduler.hpp>
#include <weft/serve/sampler.hpp>
#include <weft/serve/runner.hpp>
#include <weft/serve/engine.hpp>
#include <weft/serve/budget.hpp>
#include <weft/serve/traffic.hpp>

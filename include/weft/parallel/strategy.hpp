// Moved: the strategy vocabulary (pure types and their checks, no run time)
// lives in weft/vocabulary/, the floor below nn, parallel and plan that all
// three read (docs/architecture.md, "Layers"). This header keeps code that
// includes the old path compiling.
#pragma once

#include <weft/vocabulary/strategy.hpp>

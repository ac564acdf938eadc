// Which backend an engine test binary drives: the CPU one (CI; results bit-exact to
// the oracle), or the CUDA one when built with LATENTD_TEST_CUDA (tag gpu; within
// tolerance). Included by test sources only, never by a library.
#pragma once

#include "engine/engine.h"

namespace latentd::engine::testing {

#ifdef LATENTD_TEST_CUDA
inline constexpr BackendKind kBackendUnderTest = BackendKind::kCuda;
inline constexpr bool kExactUnderTest = false;
#else
inline constexpr BackendKind kBackendUnderTest = BackendKind::kCpu;
inline constexpr bool kExactUnderTest = true;
#endif

}  // namespace latentd::engine::testing

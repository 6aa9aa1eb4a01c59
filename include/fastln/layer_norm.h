/* LayerNorm row kernels for float32 (suffix _f32) and float64 (suffix _f64).
 *
 * The per-row functions are written once in layer_norm_impl.h and instantiated here for each
 * element type. All statistics are accumulated in double. */
#ifndef FASTLN_LAYER_NORM_H
#define FASTLN_LAYER_NORM_H

#include <math.h>
#include <stdint.h>
#include "fastln/common.h"

#define FASTLN_T float
#define FASTLN_NAME(name) name##_f32
#include "fastln/layer_norm_impl.h"
#undef FASTLN_T
#undef FASTLN_NAME

#define FASTLN_T double
#define FASTLN_NAME(name) name##_f64
#include "fastln/layer_norm_impl.h"
#undef FASTLN_T
#undef FASTLN_NAME

#endif /* FASTLN_LAYER_NORM_H */

/* RMSNorm row kernels for float32 (suffix _f32) and float64 (suffix _f64).
 *
 *     y = gamma * x / sqrt(mean(x * x) + eps)
 *
 * The per-row functions are written once in rms_norm_impl.h and instantiated here for each
 * element type, exactly as layer_norm.h does. All arithmetic is in double: squares of float32
 * values (up to 3.4e38) cannot overflow there, and float64 rows whose sum of squares does
 * overflow are rescaled by their largest magnitude (a rare path outside the hot loop). */
#ifndef FASTLN_RMS_NORM_H
#define FASTLN_RMS_NORM_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "fastln/common.h"

#define FASTLN_TEMPLATE "fastln/rms_norm_impl.h"
#include "fastln/instantiate.h"
#undef FASTLN_TEMPLATE

#endif /* FASTLN_RMS_NORM_H */

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

#define FASTLN_T float
#define FASTLN_NAME(name) name##_f32
#define FASTLN_LOAD8 fastln_load8_f32
#define FASTLN_STORE8 fastln_store8_f32
#include "fastln/rms_norm_impl.h"
#undef FASTLN_T
#undef FASTLN_NAME
#undef FASTLN_LOAD8
#undef FASTLN_STORE8

#define FASTLN_T double
#define FASTLN_NAME(name) name##_f64
#define FASTLN_LOAD8 fastln_load8_f64
#define FASTLN_STORE8 fastln_store8_f64
#include "fastln/rms_norm_impl.h"
#undef FASTLN_T
#undef FASTLN_NAME
#undef FASTLN_LOAD8
#undef FASTLN_STORE8

#endif /* FASTLN_RMS_NORM_H */

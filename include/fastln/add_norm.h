/* Fused residual add + normalization row kernels (the pre-norm transformer step):
 *
 *     s = x + residual (+ bias),   y = layer_norm(s) or rms_norm(s)
 *
 * One call per row reads x and residual once, writes s once, and then runs the LayerNorm or
 * RMSNorm row kernel on s while the row is still in cache, writing y once. Using those very
 * kernels (not a copy of them) makes y bitwise what fastln.layer_norm / fastln.rms_norm give
 * for the returned s.
 *
 * s is computed in double and rounded once to the element type: for float32 that is exactly
 * NumPy's x + residual (double holds the sum of two floats exactly), and with a bias the
 * three-term sum is rounded once instead of twice. */
#ifndef FASTLN_ADD_NORM_H
#define FASTLN_ADD_NORM_H

#include <stdint.h>
#include <string.h>
#include "fastln/common.h"
#include "fastln/layer_norm.h"
#include "fastln/rms_norm.h"

#define FASTLN_TEMPLATE "fastln/add_norm_impl.h"
#include "fastln/instantiate.h"
#undef FASTLN_TEMPLATE

#endif /* FASTLN_ADD_NORM_H */

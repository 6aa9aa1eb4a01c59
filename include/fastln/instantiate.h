/* Instantiates a kernel template once per element type: float32 (names suffixed _f32) and
 * float64 (_f64). Define FASTLN_TEMPLATE as the template's header path, then include this file.
 * No include guard on purpose.
 *
 * A template sees:
 *   FASTLN_T            the element type
 *   FASTLN_NAME(name)   name with the type suffix
 *   FASTLN_LOAD8/STORE8 eight elements to/from a fastln_d8
 *   FASTLN_STREAM8      FASTLN_STORE8 with a non-temporal store where the type has one
 *                       (float64; a float32 store of eight elements is half a vector)
 *   FASTLN_ACC_T        the type of per-row gradient accumulators (float for float32 rows,
 *                       folded into double partial sums by the caller; double for float64),
 *                       with FASTLN_ACC_LOAD8/STORE8 */
#ifndef FASTLN_TEMPLATE
#error "define FASTLN_TEMPLATE before including fastln/instantiate.h"
#endif

#define FASTLN_T float
#define FASTLN_ACC_T float
#define FASTLN_NAME(name) name##_f32
#define FASTLN_LOAD8 fastln_load8_f32
#define FASTLN_STORE8 fastln_store8_f32
#define FASTLN_STREAM8 fastln_store8_f32
#define FASTLN_ACC_LOAD8 fastln_load8_f32
#define FASTLN_ACC_STORE8 fastln_store8_f32
#include FASTLN_TEMPLATE
#undef FASTLN_T
#undef FASTLN_ACC_T
#undef FASTLN_NAME
#undef FASTLN_LOAD8
#undef FASTLN_STORE8
#undef FASTLN_STREAM8
#undef FASTLN_ACC_LOAD8
#undef FASTLN_ACC_STORE8

#define FASTLN_T double
#define FASTLN_ACC_T double
#define FASTLN_NAME(name) name##_f64
#define FASTLN_LOAD8 fastln_load8_f64
#define FASTLN_STORE8 fastln_store8_f64
#define FASTLN_STREAM8 fastln_stream8_f64
#define FASTLN_ACC_LOAD8 fastln_load8_f64
#define FASTLN_ACC_STORE8 fastln_store8_f64
#include FASTLN_TEMPLATE
#undef FASTLN_T
#undef FASTLN_ACC_T
#undef FASTLN_NAME
#undef FASTLN_LOAD8
#undef FASTLN_STORE8
#undef FASTLN_STREAM8
#undef FASTLN_ACC_LOAD8
#undef FASTLN_ACC_STORE8

# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Plumbing between the Python API and the C kernels (include/fastln/kernels.h).

One binding entry per operation and direction (layer_norm_forward, layer_norm_backward,
rms_norm_forward, rms_norm_backward, add_layer_norm_forward, add_rms_norm_forward,
batch_norm_forward, batch_norm_backward, group_norm_forward, group_norm_backward). Each takes
kernel-ready arrays - C-contiguous, aligned, native byte order, of the storage type `storage`
(FLOAT16, BFLOAT16, FLOAT32, FLOAT64) and, for parameters and statistics, of its parameter type
(float32, or float64 for float64) - that the Python layer has checked, fills the C call
structure, and runs the operation's phases through one driver (_run), with the GIL released.
The storage type picks the row of the dispatch table; the instruction set (chosen at import)
picks the table.

At the end, the recognisers of small common calls (row_norm_forward_fast,
row_norm_backward_fast): for one 768-wide row the Python checks would cost several times the
arithmetic, so a call whose arguments are already kernel-ready is recognised here with a few
C-level tests and goes straight to the
same entry. A recogniser only recognises: whatever it does not recognise - including every invalid
argument - returns None, and the caller takes the general path, whose checks are the only ones
that raise. tests/test_fast_paths.py holds the two paths to the same results.
"""
from cython.parallel cimport prange
from libc.math cimport INFINITY
from libc.stdint cimport int64_t, uint16_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memset

cimport numpy as cnp

from fastln._openmp cimport (
    fastln_get_num_threads,
    fastln_openmp_enabled,
    fastln_openmp_num_procs,
    fastln_set_initial_threads,
    fastln_set_num_threads,
    fastln_thread_cap,
    fastln_watch_for_fork,
)
from fastln._output_cache cimport new_output

cnp.import_array()
fastln_watch_for_fork()  # forked children run serially: see fastln/openmp_compat.h

cdef extern from "fastln/kernels.h" nogil:
    ctypedef void (*fastln_task)(const void *call, int64_t begin, int64_t end) noexcept nogil
    int fastln_streams_apart(const void *output, const void *input)

    ctypedef struct fastln_rows_call:
        const void *x
        const void *residual
        const void *dy
        void *y
        void *s
        void *dx
        const void *gamma
        const void *beta
        const void *bias
        void *mean
        void *rstd
        int64_t n_rows, n_cols
        double eps
        int streaming, rows_alone, fetch_ahead, add_in_float
        int64_t n_blocks, rows_per_block
        double *partials
        float *accumulators
        void *dgamma
        void *dbeta

    ctypedef struct fastln_bn_call:
        const void *x
        const void *dy
        void *y
        void *dx
        int64_t n_outer, n_features, n_inner
        double eps
        int training
        int streaming
        const double *gamma
        const double *beta
        const double *running_mean
        const double *running_var
        double *mean
        double *var
        double *rstd
        void *dgamma_out
        void *dbeta_out
        int64_t n_blocks, rows_per_block, n_chunks, n_units, rows_per_unit
        double *shift
        double *center
        double *scale
        double *offset
        double *sum
        double *sumsq
        double *sum_dy
        double *sum_dy_d
        double *sum_d
        double *dgamma
        double *correction
        double *k
        double *mean_dy
        double *coef
        double *dx_mean
        float *float_constants
        double *partials
        int64_t *finish
        int64_t *n_finish
        int64_t *waiting

    ctypedef struct fastln_gn_call:
        const void *x
        const void *dy
        void *y
        void *dx
        const void *gamma
        const void *beta
        void *mean
        void *rstd
        void *dgamma
        void *dbeta
        int64_t n_samples, n_channels, n_groups, n_spatial
        int channels_last, streaming
        double eps
        int64_t n_pieces, piece
        double *partials
        double *channel_scratch
        double *group_scratch
        int64_t *rare

    enum:
        FASTLN_FLOAT16, FASTLN_BFLOAT16, FASTLN_FLOAT32, FASTLN_FLOAT64
        FASTLN_ISA_BASE, FASTLN_ISA_AVX2, FASTLN_ISA_AVX512, FASTLN_ISA_AVX512_BF16
        FASTLN_LAYER_NORM_FORWARD, FASTLN_RMS_NORM_FORWARD, FASTLN_ADD_LAYER_NORM_FORWARD
        FASTLN_ADD_RMS_NORM_FORWARD, FASTLN_LAYER_NORM_BACKWARD, FASTLN_RMS_NORM_BACKWARD
        FASTLN_COLUMN_SUMS, FASTLN_BN_FIRST_VALUES, FASTLN_BN_STATISTICS
        FASTLN_BN_TRAIN_CONSTANTS, FASTLN_BN_EVAL_CONSTANTS, FASTLN_BN_APPLY
        FASTLN_BN_FINISH_RESCALED
        FASTLN_BN_BACKWARD_SUMS, FASTLN_BN_BACKWARD_CONSTANTS, FASTLN_BN_BACKWARD_APPLY
        FASTLN_BN_BACKWARD_FEATURES, FASTLN_BN_BACKWARD_WAITING
        FASTLN_BN_BACKWARD_FINISH_RESCALED, FASTLN_WIDEN, FASTLN_NARROW
        FASTLN_GN_FORWARD_GROUPS, FASTLN_GN_STATISTICS, FASTLN_GN_FINISH_STATISTICS
        FASTLN_GN_APPLY, FASTLN_GN_FINISH_RARE, FASTLN_GN_BACKWARD_GROUPS
        FASTLN_GN_BACKWARD_PARAMETERS, FASTLN_GN_BACKWARD_SUMS
        FASTLN_GN_BACKWARD_CONSTANTS, FASTLN_GN_BACKWARD_APPLY
        FASTLN_MAX_BLOCKS
    float fastln_float16_to_float(uint16_t value)
    uint16_t fastln_float_to_float16(float value)
    float fastln_bfloat16_to_float(uint16_t value)
    uint16_t fastln_float_to_bfloat16(float value)

    int fastln_cpu_isa()
    fastln_task fastln_task_for(int isa, int storage, int task)
    int64_t fastln_row_blocks(int64_t n_rows)
    void fastln_bn_layout(fastln_bn_call *call, int64_t max_blocks)
    void fastln_gn_layout(fastln_gn_call *call, int backward)
    int64_t fastln_gn_group_size(const fastln_gn_call *call)
    int64_t fastln_gn_piece_tasks(const fastln_gn_call *call, int backward)
    int64_t fastln_gn_partials(const fastln_gn_call *call, int backward)
    int64_t fastln_gn_channel_scratch(const fastln_gn_call *call, int backward)
    int64_t fastln_gn_group_scratch(const fastln_gn_call *call)

cdef extern from "fastln/pool.h" nogil:
    enum: FASTLN_HAVE_POOL
    void fastln_pool_run(fastln_task task, const void *call, int64_t n_tasks, int64_t n_parts,
                         int64_t n_elements, int n_threads)

FLOAT16 = FASTLN_FLOAT16
BFLOAT16 = FASTLN_BFLOAT16
FLOAT32 = FASTLN_FLOAT32
FLOAT64 = FASTLN_FLOAT64

# ---------------------------------------------------------------------------------------------
# Instruction set and threads
# ---------------------------------------------------------------------------------------------

_ISA_NAMES = {FASTLN_ISA_BASE: "x86-64 baseline", FASTLN_ISA_AVX2: "AVX2",
              FASTLN_ISA_AVX512: "AVX-512", FASTLN_ISA_AVX512_BF16: "AVX-512 with BF16"}
cdef int _cpu_isa = fastln_cpu_isa()
cdef int _isa = _cpu_isa


def instruction_set():
    """The name of the kernels' instruction-set variant in use (the best this CPU runs)."""
    return _ISA_NAMES[_isa]


def use_instruction_set(name):
    """Run the kernels of the variant `name` (one of instruction_sets()), or of the best this CPU
    runs for None. Every variant gives the same bits; the tests use this to check it."""
    global _isa
    choices = {value: key for key, value in _ISA_NAMES.items()}
    if name is None:
        _isa = _cpu_isa
        return
    if name not in instruction_sets():
        raise ValueError(f"instruction set {name!r} is not one this CPU runs; expected one of "
                         f"{instruction_sets()}")
    _isa = choices[name]


def instruction_sets():
    """The variants this CPU runs, from the baseline up."""
    return [_ISA_NAMES[isa] for isa in sorted(_ISA_NAMES) if isa <= _cpu_isa]


def openmp_enabled():
    """True when the extension was compiled with OpenMP."""
    return bool(fastln_openmp_enabled())


def default_num_threads():
    """The calling thread's default team size (fastln/threads.h), capped; 1 without OpenMP."""
    return min(fastln_get_num_threads(), fastln_thread_cap())


def num_procs():
    """The processors this process may run on, as OpenMP counts them (1 without OpenMP)."""
    return fastln_openmp_num_procs()


def set_initial_num_threads(int num_threads):
    """The default of every thread that has not set its own (fastln._threads, at import)."""
    fastln_set_initial_threads(num_threads)


def thread_cap():
    """The most threads one call starts (4 per processor, at least 64)."""
    return fastln_thread_cap()


def set_default_num_threads(int num_threads):
    """Set the calling thread's default team size (fastln.set_num_threads)."""
    fastln_set_num_threads(num_threads)


# ---------------------------------------------------------------------------------------------
# The driver: every phase of every operation runs through _run
# ---------------------------------------------------------------------------------------------

# Calls below MIN_ELEMENTS_FOR_NOGIL elements (every op) keep the GIL: releasing and taking it
# back costs about as much as their arithmetic (docs/performance.md, "Small calls keep the GIL";
# NumPy's loops keep it below 500 elements). Below MIN_ELEMENTS_FOR_THREADS elements a call runs
# on the calling thread: handing parts to a worker costs more than the work (see
# docs/performance.md). Outputs of MIN_BYTES_FOR_STREAMING and more are written with
# non-temporal stores: below, the output would still have been in cache. A float32 row backward
# whose dy, x and dx together reach MIN_BYTES_FOR_STREAMING takes its rows one at a time instead
# of in groups, when a row is at most MAX_ROW_BYTES_ALONE (measured faster there; slower in
# cache, for longer rows and for float64; the same for the half types). A row backward whose dy,
# x and dx reach BACKWARD_MIN_BYTES_FOR_FETCHING fetches the next group's lines while it writes
# each group (rows taken alone: the next two, for rows of MIN_ROW_BYTES_FETCHED_ALONE and more;
# docs/performance.md, "Every line of the rows fetched"). GroupNorm's forward streams y from
# inputs of GN_MIN_BYTES_FOR_STREAMING, its backward dx from inputs of
# GN_BACKWARD_MIN_BYTES_FOR_STREAMING, in both layouts (the backward channels last: the
# float32-compute types; docs/performance.md, "GroupNorm's outputs streamed from smaller
# calls"). BatchNorm's rows layout streams y (dx) from smaller inputs, of
# BN_MIN_BYTES_FOR_STREAMING, where that measured faster (docs/performance.md), and from that
# size its float32-compute backward sums prefetch their rows (in cache, the prefetches cost more
# than they save). The GroupNorm backward takes a group at a time (its sums, then its dx from
# cache) when the group's dy and x together are at most GN_MAX_GROUP_BYTES_IN_CACHE; larger
# groups would be read from memory twice either way, and the piece phases stream better. The
# fused adds add x + residual in float (the same bits as in double): the half formats always,
# float32 when x, residual, the sum and y together take at most ADD_IN_FLOAT_MAX_BYTES; from L3
# the double loop measured faster (docs/performance.md, "The residual add in float").
# BatchNorm's forward runs on the calling thread below BN_FORWARD_MIN_ELEMENTS_FOR_THREADS: its
# write pass is one multiply-add per element of data in the caller's cache, so a worker spends
# more pulling its half across than it saves (docs/performance.md, "BatchNorm's small calls").
cdef enum:
    MIN_ELEMENTS_FOR_NOGIL = 4096
    MIN_ELEMENTS_FOR_THREADS = 32768
    MIN_BYTES_FOR_STREAMING = 32 * 1024 * 1024
    MAX_ROW_BYTES_ALONE = 8 * 1024
    BACKWARD_MIN_BYTES_FOR_FETCHING = 12 * 1024 * 1024
    MIN_ROW_BYTES_FETCHED_ALONE = 1536
    BN_MIN_BYTES_FOR_STREAMING = 4 * 1024 * 1024
    GN_MAX_GROUP_BYTES_IN_CACHE = 2 * 1024 * 1024
    GN_MIN_BYTES_FOR_STREAMING = 12 * 1024 * 1024
    GN_BACKWARD_MIN_BYTES_FOR_STREAMING = 8 * 1024 * 1024
    BN_FORWARD_MIN_ELEMENTS_FOR_THREADS = 3 * MIN_ELEMENTS_FOR_THREADS
    ADD_IN_FLOAT_MAX_BYTES = 8 * 1024 * 1024


# A row backward's partial sums and accumulators, up to FASTLN_BACKWARD_ROOM_DOUBLES doubles
# (32 KiB; a 768-wide LayerNorm backward needs 18 KiB), go in this room of the calling thread:
# for a single row, calloc and free were a tenth of the call. Per thread, not on the stack,
# where it would have overflowed threads that Python starts with 32-40 KiB stacks
# (threading.stack_size).
cdef extern from *:
    """
    #define FASTLN_BACKWARD_ROOM_DOUBLES 4096
    static _Thread_local double fastln_backward_room[FASTLN_BACKWARD_ROOM_DOUBLES];
    static double *fastln_thread_backward_room(void) { return fastln_backward_room; }
    """
    int FASTLN_BACKWARD_ROOM_DOUBLES
    double *fastln_thread_backward_room() noexcept nogil


cdef inline fastln_task _task(int storage, int task) noexcept nogil:
    return fastln_task_for(_isa, storage, task)


cdef void _run(fastln_task task, const void *call, int64_t n_tasks, int64_t n_elements,
               int num_threads) noexcept nogil:
    """Tasks [0, n_tasks) of the call: on the calling thread when the work is small (waking a
    worker costs more), else in parts that the calling thread and up to num_threads - 1
    workers claim (fastln/pool.h; an OpenMP loop of num_threads contiguous ranges where the
    pool is not built). Tasks never share an output and every reduction's layout is fixed by
    the shape, so the split changes no result."""
    cdef int64_t part, n_parts
    if num_threads <= 1 or n_tasks <= 1 or n_elements < MIN_ELEMENTS_FOR_THREADS:
        task(call, 0, n_tasks)
        return
    if FASTLN_HAVE_POOL:
        # one contiguous part per thread, as a static loop would split them, but claimed by
        # whichever thread is free (fastln/pool.h): a worker that wakes late finds its part
        # done by the caller. (Four parts per thread measured no better: docs/performance.md;
        # a job that has to wake a worker goes in finer parts, fastln/pool.h.)
        fastln_pool_run(task, call, n_tasks, min(<int64_t>num_threads, n_tasks), n_elements,
                        num_threads)
        return
    n_parts = min(<int64_t>num_threads, n_tasks)
    for part in prange(n_parts, schedule='static', num_threads=n_parts):
        task(call, part * n_tasks // n_parts, (part + 1) * n_tasks // n_parts)


cdef inline const void *_data(object array):
    """An optional array argument's data pointer: NULL for None."""
    return NULL if array is None else cnp.PyArray_DATA(<cnp.ndarray>array)


cdef inline bint _streams(bint streaming, const void *output, const void *input,
                         const void *other_input=NULL) noexcept nogil:
    """streaming, unless the output starts just after an input in its page, where ordinary
    stores are faster (fastln_streams_apart); other_input may be NULL."""
    return (streaming and fastln_streams_apart(output, input)
            and (other_input == NULL or fastln_streams_apart(output, other_input)))


cdef inline void _rows_call(fastln_rows_call *call, const void *x, Py_ssize_t n_rows,
                            Py_ssize_t n_cols, Py_ssize_t output_bytes, double eps) noexcept:
    """The fields every row call has; every other pointer NULL."""
    call.x = x
    call.residual = call.dy = NULL
    call.y = call.s = call.dx = NULL
    call.gamma = call.beta = call.bias = NULL
    call.mean = call.rstd = NULL
    call.n_rows = n_rows
    call.n_cols = n_cols
    call.eps = eps
    call.streaming = output_bytes >= MIN_BYTES_FOR_STREAMING
    call.rows_alone = call.fetch_ahead = 0
    call.add_in_float = 0
    call.n_blocks = call.rows_per_block = 0
    call.partials = NULL
    call.accumulators = NULL
    call.dgamma = call.dbeta = NULL


cdef inline void _rows_call_of(fastln_rows_call *call, cnp.ndarray x, cnp.ndarray output,
                               double eps) noexcept:
    """_rows_call for a 2-D x (n_rows, n_cols) and its output."""
    _rows_call(call, cnp.PyArray_DATA(x), cnp.PyArray_DIM(x, 0), cnp.PyArray_DIM(x, 1),
               cnp.PyArray_NBYTES(output), eps)


# ---------------------------------------------------------------------------------------------
# Row normalizations
# ---------------------------------------------------------------------------------------------

cdef void _forward_rows(int op, fastln_rows_call *call, int storage, int num_threads):
    """The row forward's tasks; the GIL is released for calls of MIN_ELEMENTS_FOR_NOGIL and
    more (releasing and taking it back costs as much as a smaller call's arithmetic)."""
    call.streaming = _streams(call.streaming, call.y, call.x)
    cdef int64_t n_elements = call.n_rows * call.n_cols
    if n_elements < MIN_ELEMENTS_FOR_NOGIL:
        _run(_task(storage, op), call, call.n_rows, n_elements, num_threads)
        return
    with nogil:
        _run(_task(storage, op), call, call.n_rows, n_elements, num_threads)


cdef inline void _layer_norm_forward(fastln_rows_call *call, object gamma, object beta,
                                     void *y, object mean, object rstd, int storage,
                                     int num_threads):
    call.gamma = _data(gamma)
    call.beta = _data(beta)
    call.y = y
    call.mean = <void*>_data(mean)
    call.rstd = <void*>_data(rstd)
    _forward_rows(FASTLN_LAYER_NORM_FORWARD, call, storage, num_threads)


def layer_norm_forward(cnp.ndarray x, object gamma, object beta, cnp.ndarray y, object mean,
                       object rstd, double eps, int storage, int num_threads):
    """LayerNorm of the rows of the 2-D array x into y; mean/rstd (1-D, or None) get the
    statistics."""
    cdef fastln_rows_call call
    _rows_call_of(&call, x, y, eps)
    _layer_norm_forward(&call, gamma, beta, cnp.PyArray_DATA(y), mean, rstd, storage,
                        num_threads)


cdef inline void _rms_norm_forward(fastln_rows_call *call, object gamma, void *y, object rstd,
                                   int storage, int num_threads):
    call.gamma = _data(gamma)
    call.y = y
    call.rstd = <void*>_data(rstd)
    _forward_rows(FASTLN_RMS_NORM_FORWARD, call, storage, num_threads)


def rms_norm_forward(cnp.ndarray x, object gamma, cnp.ndarray y, object rstd, double eps,
                     int storage, int num_threads):
    """RMSNorm of the rows of the 2-D array x into y; rstd (1-D, or None) gets the statistics."""
    cdef fastln_rows_call call
    _rows_call_of(&call, x, y, eps)
    _rms_norm_forward(&call, gamma, cnp.PyArray_DATA(y), rstd, storage, num_threads)


cdef inline void _add_norm_forward(int op, fastln_rows_call *call, object residual,
                                   object bias, object gamma, object beta, object s, object y,
                                   object mean, object rstd, int storage, int num_threads):
    call.streaming = 0  # y is written while the row is in cache
    call.add_in_float = (storage in (FASTLN_FLOAT16, FASTLN_BFLOAT16)
                         or 4 * cnp.PyArray_NBYTES(<cnp.ndarray>s) <= ADD_IN_FLOAT_MAX_BYTES)
    call.residual = _data(residual)
    call.bias = _data(bias)
    call.gamma = _data(gamma)
    call.beta = _data(beta)
    call.s = <void*>_data(s)
    call.y = <void*>_data(y)
    call.mean = <void*>_data(mean)
    call.rstd = <void*>_data(rstd)
    _forward_rows(op, call, storage, num_threads)


def add_layer_norm_forward(cnp.ndarray x, cnp.ndarray residual, object bias, object gamma,
                           object beta, cnp.ndarray s, cnp.ndarray y, object mean, object rstd,
                           double eps, int storage, int num_threads):
    """s = x + residual (+ bias) and y = LayerNorm(s) over the rows of the 2-D arrays."""
    cdef fastln_rows_call call
    _rows_call_of(&call, x, y, eps)
    _add_norm_forward(FASTLN_ADD_LAYER_NORM_FORWARD, &call, residual, bias, gamma, beta, s, y,
                      mean, rstd, storage, num_threads)


def add_rms_norm_forward(cnp.ndarray x, cnp.ndarray residual, object bias, object gamma,
                         cnp.ndarray s, cnp.ndarray y, object rstd, double eps, int storage,
                         int num_threads):
    """s = x + residual (+ bias) and y = RMSNorm(s) over the rows of the 2-D arrays."""
    cdef fastln_rows_call call
    _rows_call_of(&call, x, y, eps)
    _add_norm_forward(FASTLN_ADD_RMS_NORM_FORWARD, &call, residual, bias, gamma, None, s, y,
                      None, rstd, storage, num_threads)


cdef void _backward_phases(int op, fastln_rows_call *call, int storage,
                           int num_threads) noexcept nogil:
    """A row backward's row blocks, then its column sums in block order."""
    _run(_task(storage, op), call, call.n_blocks, call.n_rows * call.n_cols, num_threads)
    _run(_task(storage, FASTLN_COLUMN_SUMS), call, call.n_cols, call.n_blocks * call.n_cols,
         num_threads)


cdef int _backward_rows(int op, fastln_rows_call *call, int storage, int n_sums,
                        int num_threads) except -1:
    """A row backward: its row blocks (each with its own double partial sums and, for
    LayerNorm of the float32-compute types, zeroed float accumulators that set the partials at
    their first fold; other partials start zeroed), then the column sums in block order."""
    call.streaming = _streams(call.streaming, call.dx, call.dy, call.x)
    call.n_blocks = fastln_row_blocks(call.n_rows)
    call.rows_per_block = (call.n_rows + call.n_blocks - 1) // call.n_blocks
    cdef Py_ssize_t row_bytes = call.n_cols * _storage_bytes(storage)
    cdef Py_ssize_t call_bytes = 3 * row_bytes * call.n_rows  # dy, x and dx
    call.rows_alone = (storage == FASTLN_FLOAT32 and call_bytes >= MIN_BYTES_FOR_STREAMING
                       and row_bytes <= MAX_ROW_BYTES_ALONE)
    call.fetch_ahead = (call_bytes >= BACKWARD_MIN_BYTES_FOR_FETCHING
                        and not (call.rows_alone and row_bytes < MIN_ROW_BYTES_FETCHED_ALONE))
    cdef Py_ssize_t n_partials = n_sums * call.n_blocks * call.n_cols
    # LayerNorm's float accumulators (the float32-compute types): as many floats as partials,
    # in half as many doubles
    cdef bint accumulate = op == FASTLN_LAYER_NORM_BACKWARD and storage != FASTLN_FLOAT64
    cdef Py_ssize_t n_room = n_partials + ((n_partials + 1) // 2 if accumulate else 0)
    cdef bint in_room = n_room <= FASTLN_BACKWARD_ROOM_DOUBLES
    cdef double *room
    if in_room:
        room = fastln_thread_backward_room()
        call.partials = room
        call.accumulators = <float*>(room + n_partials) if accumulate else NULL
        if accumulate:  # the partials are set by each block's first fold of its accumulators
            memset(call.accumulators, 0, (n_room - n_partials) * sizeof(double))
        else:
            memset(room, 0, n_room * sizeof(double))
    else:  # (with accumulators, the partials need no zeroing either)
        call.partials = <double*>(malloc(n_partials * sizeof(double)) if accumulate
                                  else calloc(n_partials, sizeof(double)))
        call.accumulators = <float*>calloc(n_partials, sizeof(float)) if accumulate else NULL
        if call.partials == NULL or (accumulate and call.accumulators == NULL):
            free(call.partials)
            free(call.accumulators)
            raise MemoryError("cannot allocate the backward's partial sums")
    if call.n_rows * call.n_cols < MIN_ELEMENTS_FOR_NOGIL:  # as _forward_rows
        _backward_phases(op, call, storage, num_threads)
    else:
        with nogil:
            _backward_phases(op, call, storage, num_threads)
    if not in_room:
        free(call.partials)
        free(call.accumulators)
    return 0


cdef inline int _layer_norm_backward(fastln_rows_call *call, object dy, object gamma,
                                     object mean, object rstd, object dx, object dgamma,
                                     object dbeta, int storage, int num_threads) except -1:
    call.dy = _data(dy)
    call.gamma = _data(gamma)
    call.mean = <void*>_data(mean)
    call.rstd = <void*>_data(rstd)
    call.dx = <void*>_data(dx)
    call.dgamma = <void*>_data(dgamma)
    call.dbeta = <void*>_data(dbeta)
    return _backward_rows(FASTLN_LAYER_NORM_BACKWARD, call, storage, 2, num_threads)


def layer_norm_backward(cnp.ndarray dy, cnp.ndarray x, object gamma, cnp.ndarray mean,
                        cnp.ndarray rstd, cnp.ndarray dx, cnp.ndarray dgamma, cnp.ndarray dbeta,
                        double eps, int storage, int num_threads):
    """LayerNorm backward over the rows of the 2-D arrays dy and x into dx, dgamma and dbeta;
    eps is the forward's (rows whose cached rstd is Inf are done from x again)."""
    cdef fastln_rows_call call
    _rows_call_of(&call, x, dx, eps)
    _layer_norm_backward(&call, dy, gamma, mean, rstd, dx, dgamma, dbeta, storage, num_threads)


cdef inline int _rms_norm_backward(fastln_rows_call *call, object dy, object gamma, object rstd,
                                   object dx, object dgamma, int storage,
                                   int num_threads) except -1:
    call.dy = _data(dy)
    call.gamma = _data(gamma)
    call.rstd = <void*>_data(rstd)
    call.dx = <void*>_data(dx)
    call.dgamma = <void*>_data(dgamma)
    return _backward_rows(FASTLN_RMS_NORM_BACKWARD, call, storage, 1, num_threads)


def rms_norm_backward(cnp.ndarray dy, cnp.ndarray x, object gamma, cnp.ndarray rstd,
                      cnp.ndarray dx, cnp.ndarray dgamma, double eps, int storage,
                      int num_threads):
    """RMSNorm backward over the rows of the 2-D arrays dy and x into dx and dgamma."""
    cdef fastln_rows_call call
    _rows_call_of(&call, x, dx, eps)
    _rms_norm_backward(&call, dy, gamma, rstd, dx, dgamma, storage, num_threads)


# ---------------------------------------------------------------------------------------------
# BatchNorm: x is a C-contiguous (n_outer, n_features, n_inner) array
# ---------------------------------------------------------------------------------------------

cdef inline bint _is_single(object values):
    return values is not None and cnp.PyArray_TYPE(<cnp.ndarray>values) == cnp.NPY_FLOAT32


cdef double *_widen_room(Py_ssize_t n_features, object a, object b=None, object c=None,
                         object d=None) except? NULL:
    """Room for the float32 ones among BatchNorm's per-feature arrays a, b, c, d as doubles
    (_as_doubles fills it); NULL when there are none."""
    cdef Py_ssize_t n_single = (_is_single(a) + _is_single(b) + _is_single(c)
                                + _is_single(d))
    if n_single == 0:
        return NULL
    cdef double *room = <double*>malloc(n_single * n_features * sizeof(double))
    if room == NULL:
        raise MemoryError("batch_norm: cannot allocate the per-feature parameters")
    return room


cdef const double *_as_doubles(object values, double **room) noexcept:
    """A BatchNorm parameter or statistic (None, or a 1-D contiguous float32 or float64 array)
    as the doubles its constants are computed from: float64 values where they are (no copy
    per call), float32 ones widened, exactly, into *room, which then moves past them."""
    if values is None:
        return NULL
    cdef cnp.ndarray array = <cnp.ndarray>values
    if cnp.PyArray_TYPE(array) == cnp.NPY_FLOAT64:
        return <const double*>cnp.PyArray_DATA(array)
    cdef const float *single = <const float*>cnp.PyArray_DATA(array)
    cdef double *widened = room[0]
    cdef Py_ssize_t i, n = cnp.PyArray_SIZE(array)
    for i in range(n):
        widened[i] = single[i]
    room[0] = widened + n
    return widened


cdef void _bn_call(fastln_bn_call *call, cnp.ndarray x, Py_ssize_t n_outer,
                   Py_ssize_t n_features, Py_ssize_t n_inner, const double *gamma, double eps,
                   bint training):
    call.x = cnp.PyArray_DATA(x)
    call.dy = NULL
    call.y = call.dx = NULL
    call.n_outer = n_outer
    call.n_features = n_features
    call.n_inner = n_inner
    call.eps = eps
    call.training = training
    call.streaming = cnp.PyArray_NBYTES(x) >= BN_MIN_BYTES_FOR_STREAMING
    call.gamma = gamma
    call.beta = call.running_mean = call.running_var = NULL
    call.dgamma_out = call.dbeta_out = NULL
    call.dx_mean = NULL
    call.float_constants = NULL
    call.waiting = NULL
    fastln_bn_layout(call, FASTLN_MAX_BLOCKS)


cdef inline double *_features(double *scratch, Py_ssize_t n_features, int index) noexcept nogil:
    return scratch + index * n_features


def batch_norm_forward(cnp.ndarray x, cnp.ndarray y, Py_ssize_t n_outer, Py_ssize_t n_features,
                       Py_ssize_t n_inner, object gamma, object beta, object running_mean,
                       object running_var, cnp.ndarray mean, object var, cnp.ndarray rstd,
                       bint training, double eps, int storage, int num_threads):
    """BatchNorm of x (n_outer * n_features * n_inner values, C order) into y.

    gamma, beta, running_mean, running_var: contiguous float32 or float64 (n_features,) or None
    (running statistics are required when not training). mean, var, rstd: float64
    (n_features,) outputs (var written only when training, and may be None otherwise)."""
    cdef fastln_bn_call call
    cdef double *widened = _widen_room(n_features, gamma, beta, running_mean, running_var)
    cdef double *room = widened
    _bn_call(&call, x, n_outer, n_features, n_inner, _as_doubles(gamma, &room), eps, training)
    call.y = cnp.PyArray_DATA(y)
    call.streaming = _streams(call.streaming, call.y, call.x)
    call.beta = _as_doubles(beta, &room)
    call.running_mean = _as_doubles(running_mean, &room)
    call.running_var = _as_doubles(running_var, &room)
    call.mean = <double*>cnp.PyArray_DATA(mean)
    call.var = <double*>_data(var)
    call.rstd = <double*>cnp.PyArray_DATA(rstd)
    # shift, center, scale, offset, sum, sumsq, then the rare features' indices (int64, as wide
    # as a double) and their count, then (float32-compute types) the float apply's four float
    # constants per feature, as wide as two doubles
    cdef bint float_apply = storage != FASTLN_FLOAT64
    cdef size_t n_scratch = 7 * n_features + 1 + (2 * n_features if float_apply else 0)
    # Evaluation writes every value it reads (the sums are training's), so it skips the zeroing
    # that training's accumulators need; the rare features' count is set below.
    cdef double *scratch = <double*>(calloc(n_scratch, sizeof(double)) if training
                                     else malloc(n_scratch * sizeof(double)))
    call.partials = NULL
    if training:
        call.partials = <double*>calloc(2 * call.n_blocks * n_features, sizeof(double))
    if scratch == NULL or (training and call.partials == NULL):
        free(scratch)
        free(call.partials)
        free(widened)
        raise MemoryError("batch_norm: cannot allocate the per-feature scratch")
    call.shift = _features(scratch, n_features, 0)
    call.center = _features(scratch, n_features, 1)
    call.scale = _features(scratch, n_features, 2)
    call.offset = _features(scratch, n_features, 3)
    call.sum = _features(scratch, n_features, 4)
    call.sumsq = _features(scratch, n_features, 5)
    call.finish = <int64_t*>_features(scratch, n_features, 6)
    call.n_finish = <int64_t*>_features(scratch, n_features, 7)
    call.n_finish[0] = 0
    if float_apply:
        call.float_constants = <float*>(_features(scratch, n_features, 7) + 1)
    cdef int64_t n_elements = n_outer * n_features * n_inner
    if n_elements < BN_FORWARD_MIN_ELEMENTS_FOR_THREADS:
        num_threads = 1
    if n_elements < MIN_ELEMENTS_FOR_NOGIL:  # as _forward_rows
        _batch_norm_phases(&call, training, storage, n_elements, num_threads)
    else:
        with nogil:
            _batch_norm_phases(&call, training, storage, n_elements, num_threads)
    free(scratch)
    free(call.partials)
    free(widened)


cdef void _batch_norm_phases(fastln_bn_call *call, bint training, int storage,
                             int64_t n_elements, int num_threads) noexcept nogil:
    """A BatchNorm forward's phases: the statistics (training) or the running ones' constants,
    the apply, and the features the rare path passed on."""
    if training:
        _run(_task(storage, FASTLN_BN_FIRST_VALUES), call, 1, 0, 1)
        _run(_task(storage, FASTLN_BN_STATISTICS), call, call.n_blocks * call.n_chunks,
             n_elements, num_threads)
        _run(_task(storage, FASTLN_BN_TRAIN_CONSTANTS), call, 1, 0, 1)
    else:
        _run(_task(storage, FASTLN_BN_EVAL_CONSTANTS), call, 1, 0, 1)
    _run(_task(storage, FASTLN_BN_APPLY), call, call.n_units, n_elements, num_threads)
    if call.n_finish[0] > 0:
        _run(_task(storage, FASTLN_BN_FINISH_RESCALED), call, 1, 0, 1)


def batch_norm_backward(cnp.ndarray dy, cnp.ndarray x, cnp.ndarray dx, cnp.ndarray dgamma,
                        cnp.ndarray dbeta, Py_ssize_t n_outer, Py_ssize_t n_features,
                        Py_ssize_t n_inner, object gamma, cnp.ndarray mean, cnp.ndarray rstd,
                        bint training, double eps, int storage, int num_threads):
    """BatchNorm backward into dx (x's layout) and dgamma, dbeta (n_features, parameter type).

    gamma: contiguous float32 or float64 (n_features,) or None; mean, rstd: float64
    (n_features,) and eps from the forward (eps for the rare features whose rstd is beyond
    double)."""
    cdef fastln_bn_call call
    cdef double *widened = _widen_room(n_features, gamma)
    cdef double *room = widened
    _bn_call(&call, x, n_outer, n_features, n_inner, _as_doubles(gamma, &room), eps, training)
    call.dy = cnp.PyArray_DATA(dy)
    call.dx = cnp.PyArray_DATA(dx)
    call.streaming = _streams(call.streaming, call.dx, call.dy, call.x)
    call.mean = <double*>cnp.PyArray_DATA(mean)
    call.rstd = <double*>cnp.PyArray_DATA(rstd)
    call.var = NULL
    call.dgamma_out = cnp.PyArray_DATA(dgamma)
    call.dbeta_out = cnp.PyArray_DATA(dbeta)
    # sum_dy, sum_dy_d, sum_d, dgamma, correction, k, mean_dy, coef, dx_mean, then the rare
    # features' indices and the waiting flags (int64, as wide as a double) and the indices'
    # count, then (float32-compute types; in the segments layout training only, evaluation's
    # dx = dy * k being written in double there) the float dx pass's five float constants per
    # feature, in the room of three doubles
    cdef bint float_apply = storage != FASTLN_FLOAT64 and (n_inner == 1 or training)
    cdef double *scratch = <double*>calloc(11 * n_features + 1 + (3 * n_features if float_apply
                                                                    else 0), sizeof(double))
    call.partials = <double*>calloc(3 * call.n_blocks * n_features, sizeof(double))
    if scratch == NULL or call.partials == NULL:
        free(scratch)
        free(call.partials)
        free(widened)
        raise MemoryError("batch_norm_backward: cannot allocate the per-feature scratch")
    call.sum_dy = _features(scratch, n_features, 0)
    call.sum_dy_d = _features(scratch, n_features, 1)
    call.sum_d = _features(scratch, n_features, 2)
    call.dgamma = _features(scratch, n_features, 3)
    call.correction = _features(scratch, n_features, 4)
    call.k = _features(scratch, n_features, 5)
    call.mean_dy = _features(scratch, n_features, 6)
    call.coef = _features(scratch, n_features, 7)
    call.dx_mean = _features(scratch, n_features, 8)
    call.finish = <int64_t*>_features(scratch, n_features, 9)
    call.waiting = <int64_t*>_features(scratch, n_features, 10)
    call.n_finish = <int64_t*>_features(scratch, n_features, 11)
    if float_apply:
        call.float_constants = <float*>(_features(scratch, n_features, 11) + 1)
    cdef int64_t n_elements = n_outer * n_features * n_inner
    if n_elements < MIN_ELEMENTS_FOR_NOGIL:  # as _forward_rows
        _batch_norm_backward_phases(&call, n_features, n_inner, storage, n_elements, num_threads)
    else:
        with nogil:
            _batch_norm_backward_phases(&call, n_features, n_inner, storage, n_elements,
                                        num_threads)
    free(scratch)
    free(call.partials)
    free(widened)


cdef void _batch_norm_backward_phases(fastln_bn_call *call, int64_t n_features, int64_t n_inner,
                                      int storage, int64_t n_elements,
                                      int num_threads) noexcept nogil:
    """A BatchNorm backward's phases: the sums, the constants and dx, then the features the
    rare path passed on."""
    if n_inner > 1 and call.n_blocks == 1:
        # each feature's phases at once, while its values are in cache
        _run(_task(storage, FASTLN_BN_BACKWARD_FEATURES), call, n_features, n_elements,
             num_threads)
        _run(_task(storage, FASTLN_BN_BACKWARD_WAITING), call, 1, 0, 1)
    else:
        _run(_task(storage, FASTLN_BN_BACKWARD_SUMS), call, call.n_blocks * call.n_chunks,
             n_elements, num_threads)
        _run(_task(storage, FASTLN_BN_BACKWARD_CONSTANTS), call, 1, 0, 1)
        _run(_task(storage, FASTLN_BN_BACKWARD_APPLY), call, call.n_units, n_elements,
             num_threads)
    if call.n_finish[0] > 0:
        _run(_task(storage, FASTLN_BN_BACKWARD_FINISH_RESCALED), call, 1, 0, 1)


# ---------------------------------------------------------------------------------------------
# GroupNorm: x is a C-contiguous (n_samples, n_channels, n_spatial) array, or (n_samples,
# n_spatial, n_channels) channels last; statistics per (sample, group)
# ---------------------------------------------------------------------------------------------

cdef int _gn_call(fastln_gn_call *call, cnp.ndarray x, Py_ssize_t n_samples,
                  Py_ssize_t n_channels, Py_ssize_t n_groups, Py_ssize_t n_spatial,
                  bint channels_last, object gamma, double eps, bint backward) except -1:
    """The fields every GroupNorm call has, its layout and its zeroed scratch."""
    call.x = cnp.PyArray_DATA(x)
    call.dy = NULL
    call.y = call.dx = NULL
    call.gamma = _data(gamma)
    call.beta = NULL
    call.mean = call.rstd = call.dgamma = call.dbeta = NULL
    call.n_samples = n_samples
    call.n_channels = n_channels
    call.n_groups = n_groups
    call.n_spatial = n_spatial
    call.channels_last = channels_last
    cdef Py_ssize_t nbytes = cnp.PyArray_NBYTES(x)
    cdef Py_ssize_t channel_bytes = n_spatial * cnp.PyArray_ITEMSIZE(x)
    if backward:
        call.streaming = nbytes >= GN_BACKWARD_MIN_BYTES_FOR_STREAMING
    else:
        call.streaming = nbytes >= GN_MIN_BYTES_FOR_STREAMING
    if not channels_last:
        # Channels first, only channels of whole 16-byte pieces, a line or more, stream: then
        # every store of the call is a non-temporal one (a line that gets both kinds is slow).
        call.streaming = call.streaming and channel_bytes % 16 == 0 and channel_bytes >= 64
    call.eps = eps
    fastln_gn_layout(call, backward)
    call.partials = <double*>calloc(max(fastln_gn_partials(call, backward), 1), sizeof(double))
    call.channel_scratch = <double*>calloc(max(fastln_gn_channel_scratch(call, backward), 1),
                                           sizeof(double))
    call.group_scratch = <double*>calloc(max(fastln_gn_group_scratch(call), 1), sizeof(double))
    call.rare = <int64_t*>calloc(max(n_samples * n_groups, 1), sizeof(int64_t))
    if (call.partials == NULL or call.channel_scratch == NULL or call.group_scratch == NULL
            or call.rare == NULL):
        _gn_free(call)
        raise MemoryError("group_norm: cannot allocate the per-group scratch")
    return 0


cdef void _gn_free(fastln_gn_call *call) noexcept:
    free(call.partials)
    free(call.channel_scratch)
    free(call.group_scratch)
    free(call.rare)


def group_norm_forward(cnp.ndarray x, object gamma, object beta, cnp.ndarray y, object mean,
                       object rstd, Py_ssize_t n_samples, Py_ssize_t n_channels,
                       Py_ssize_t n_groups, Py_ssize_t n_spatial, bint channels_last,
                       double eps, int storage, int num_threads):
    """GroupNorm of x into y (both C-contiguous, n_samples * n_channels * n_spatial values, the
    channels second or last); gamma, beta: (n_channels,) or None; mean, rstd: (n_samples *
    n_groups,) outputs or None."""
    cdef fastln_gn_call call
    _gn_call(&call, x, n_samples, n_channels, n_groups, n_spatial, channels_last, gamma, eps,
             False)
    call.beta = _data(beta)
    call.y = cnp.PyArray_DATA(y)
    call.streaming = _streams(call.streaming, call.y, call.x)
    call.mean = <void*>_data(mean)
    call.rstd = <void*>_data(rstd)
    cdef int64_t n_elements = n_samples * n_channels * n_spatial
    if n_elements < MIN_ELEMENTS_FOR_NOGIL:  # as _forward_rows
        _group_norm_phases(&call, storage, n_elements, num_threads)
    else:
        with nogil:
            _group_norm_phases(&call, storage, n_elements, num_threads)
    _gn_free(&call)


cdef void _group_norm_phases(fastln_gn_call *call, int storage, int64_t n_elements,
                             int num_threads) noexcept nogil:
    """A GroupNorm forward's phases. A task per group keeps each group in cache from its sums
    to its write; with fewer groups than threads can share out evenly, the same sums go by
    pieces instead."""
    cdef int64_t n_group_tasks = call.n_samples * call.n_groups
    cdef int64_t n_piece_tasks = fastln_gn_piece_tasks(call, 0)
    if not call.channels_last and (call.n_pieces == 1 or n_group_tasks >= 4 * num_threads):
        _run(_task(storage, FASTLN_GN_FORWARD_GROUPS), call, n_group_tasks, n_elements,
             num_threads)
    else:
        _run(_task(storage, FASTLN_GN_STATISTICS), call, n_piece_tasks, n_elements, num_threads)
        _run(_task(storage, FASTLN_GN_FINISH_STATISTICS), call, n_group_tasks, 0, 1)
        _run(_task(storage, FASTLN_GN_APPLY), call, n_piece_tasks, n_elements, num_threads)
        if call.channels_last:
            _run(_task(storage, FASTLN_GN_FINISH_RARE), call, 1, 0, 1)


def group_norm_backward(cnp.ndarray dy, cnp.ndarray x, object gamma, cnp.ndarray mean,
                        cnp.ndarray rstd, cnp.ndarray dx, cnp.ndarray dgamma,
                        cnp.ndarray dbeta, Py_ssize_t n_samples, Py_ssize_t n_channels,
                        Py_ssize_t n_groups, Py_ssize_t n_spatial, bint channels_last,
                        double eps, int storage, int num_threads):
    """GroupNorm backward into dx (x's layout), dgamma and dbeta ((n_channels,), parameter
    type); mean, rstd: the forward's (n_samples * n_groups,), eps the forward's (groups whose
    cached rstd is Inf are done from x again)."""
    cdef fastln_gn_call call
    _gn_call(&call, x, n_samples, n_channels, n_groups, n_spatial, channels_last, gamma, eps,
             True)
    call.dy = cnp.PyArray_DATA(dy)
    call.dx = cnp.PyArray_DATA(dx)
    call.streaming = _streams(call.streaming, call.dx, call.dy, call.x)
    call.mean = cnp.PyArray_DATA(mean)
    call.rstd = cnp.PyArray_DATA(rstd)
    call.dgamma = cnp.PyArray_DATA(dgamma)
    call.dbeta = cnp.PyArray_DATA(dbeta)
    cdef int64_t n_elements = n_samples * n_channels * n_spatial
    cdef int64_t group_bytes = 2 * fastln_gn_group_size(&call) * cnp.PyArray_ITEMSIZE(x)
    if n_elements < MIN_ELEMENTS_FOR_NOGIL:  # as _forward_rows
        _group_norm_backward_phases(&call, storage, n_elements, group_bytes, num_threads)
    else:
        with nogil:
            _group_norm_backward_phases(&call, storage, n_elements, group_bytes, num_threads)
    _gn_free(&call)


cdef void _group_norm_backward_phases(fastln_gn_call *call, int storage, int64_t n_elements,
                                      int64_t group_bytes, int num_threads) noexcept nogil:
    """A GroupNorm backward's phases; as the forward, a task per group while there are
    groups enough to share out (and a group's dy and x fit the cache)."""
    cdef int64_t n_group_tasks = call.n_samples * call.n_groups
    cdef int64_t n_piece_tasks = fastln_gn_piece_tasks(call, 1)
    if (not call.channels_last and group_bytes <= GN_MAX_GROUP_BYTES_IN_CACHE
            and (call.n_pieces == 1 or n_group_tasks >= 4 * num_threads)):
        _run(_task(storage, FASTLN_GN_BACKWARD_GROUPS), call, n_group_tasks, n_elements,
             num_threads)
        _run(_task(storage, FASTLN_GN_BACKWARD_PARAMETERS), call, 1, 0, 1)
    else:
        _run(_task(storage, FASTLN_GN_BACKWARD_SUMS), call, n_piece_tasks, n_elements,
             num_threads)
        _run(_task(storage, FASTLN_GN_BACKWARD_CONSTANTS), call, 1, 0, 1)
        _run(_task(storage, FASTLN_GN_BACKWARD_APPLY), call, n_piece_tasks, n_elements,
             num_threads)


# ---------------------------------------------------------------------------------------------
# The half-precision conversions alone, for the tests (which hold them to NumPy's and
# ml_dtypes' astype), through the kernels' own loads and stores
# ---------------------------------------------------------------------------------------------

cdef void _convert(int task, cnp.ndarray source, cnp.ndarray out, int storage):
    cdef fastln_rows_call call
    _rows_call(&call, cnp.PyArray_DATA(source), 1, cnp.PyArray_SIZE(source), 0, 0.0)
    call.y = cnp.PyArray_DATA(out)
    if call.n_cols < MIN_ELEMENTS_FOR_NOGIL:  # a parameter's few values: as _forward_rows
        _task(storage, task)(&call, 0, call.n_cols)
        return
    with nogil:
        _task(storage, task)(&call, 0, call.n_cols)


def widen(cnp.ndarray half, cnp.ndarray out, int storage):
    """out[:] = half as float32 (1-D C-contiguous arrays of equal length; out float32;
    storage FLOAT16 or BFLOAT16), one element at a time: the conversion of the kernels' single
    elements, exact for every value (a signalling NaN stays signalling, as in NumPy)."""
    cdef const uint16_t *source = <const uint16_t*>cnp.PyArray_DATA(half)
    cdef float *target = <float*>cnp.PyArray_DATA(out)
    cdef Py_ssize_t i
    for i in range(cnp.PyArray_SIZE(half)):
        target[i] = (fastln_bfloat16_to_float(source[i]) if storage == FASTLN_BFLOAT16
                     else fastln_float16_to_float(source[i]))


def narrow(cnp.ndarray values, cnp.ndarray out, int storage):
    """out[:] = float32 values rounded to the half format (1-D C-contiguous, equal length), one
    element at a time."""
    cdef const float *source = <const float*>cnp.PyArray_DATA(values)
    cdef uint16_t *target = <uint16_t*>cnp.PyArray_DATA(out)
    cdef Py_ssize_t i
    for i in range(cnp.PyArray_SIZE(values)):
        target[i] = (fastln_float_to_bfloat16(source[i]) if storage == FASTLN_BFLOAT16
                     else fastln_float_to_float16(source[i]))


def widen_as_loaded(cnp.ndarray half, cnp.ndarray out, int storage):
    """widen as the kernels' vector loads do it in the instruction-set variant in use (F16C
    quiets a signalling float16 NaN, as IEEE 754 conversions do; every other value is exact)."""
    _convert(FASTLN_WIDEN, half, out, storage)


def narrow_as_stored(cnp.ndarray values, cnp.ndarray out, int storage):
    """narrow as the kernels' vector stores do it in the variant in use."""
    _convert(FASTLN_NARROW, values, out, storage)


# ---------------------------------------------------------------------------------------------
# Recognisers of small common calls (see the module docstring)
# ---------------------------------------------------------------------------------------------

cdef int _bfloat16_typenum = -1  # ml_dtypes' bfloat16, once the general path has met it


def register_bfloat16(int typenum):
    """Let the recognisers take bfloat16 arrays (typenum: ml_dtypes' bfloat16 dtype.num)."""
    global _bfloat16_typenum
    _bfloat16_typenum = typenum


cdef inline int _storage_of(int typenum) noexcept:
    """The storage type of a dtype number, -1 for the dtypes the kernels do not take."""
    if typenum == cnp.NPY_FLOAT32:
        return FASTLN_FLOAT32
    if typenum == cnp.NPY_FLOAT64:
        return FASTLN_FLOAT64
    if typenum == cnp.NPY_FLOAT16:
        return FASTLN_FLOAT16
    if typenum == _bfloat16_typenum:
        return FASTLN_BFLOAT16
    return -1


cdef inline bint _is_kernel_array(object value, int typenum):
    """An exact ndarray of typenum: C-contiguous, aligned, native byte order."""
    if type(value) is not cnp.ndarray:
        return False
    cdef cnp.ndarray array = <cnp.ndarray>value
    return (cnp.PyArray_TYPE(array) == typenum and cnp.PyArray_ISCARRAY_RO(array)
            and cnp.PyArray_ISNOTSWAPPED(array))


cdef inline bint _is_param(object value, int typenum, Py_ssize_t n_cols):
    """None, or a 1-D kernel array of n_cols elements."""
    if value is None:
        return True
    return (_is_kernel_array(value, typenum) and cnp.PyArray_NDIM(<cnp.ndarray>value) == 1
            and cnp.PyArray_DIM(<cnp.ndarray>value, 0) == n_cols)


cdef inline bint _overlaps(object a, object b):
    """Whether the memory of two contiguous arrays (or None) intersects."""
    if a is None or b is None:
        return False
    cdef char *a_start = <char*>cnp.PyArray_DATA(<cnp.ndarray>a)
    cdef char *b_start = <char*>cnp.PyArray_DATA(<cnp.ndarray>b)
    return (a_start < b_start + cnp.PyArray_NBYTES(<cnp.ndarray>b)
            and b_start < a_start + cnp.PyArray_NBYTES(<cnp.ndarray>a))


cdef inline bint _clobbers(object out, object source):
    """Whether writing out could change source before it is read. The kernels read element i of
    a row before they write element i of its output, so out exactly on top of source (same
    start, same size) is safe; any other overlap is not."""
    if not _overlaps(out, source):
        return False
    return (cnp.PyArray_DATA(<cnp.ndarray>out) != cnp.PyArray_DATA(<cnp.ndarray>source)
            or cnp.PyArray_NBYTES(<cnp.ndarray>out) != cnp.PyArray_NBYTES(<cnp.ndarray>source))


cdef inline bint _clobbers_backward_inputs(object out, object dy, object x, object gamma,
                                           object mean, object rstd):
    """Whether a backward's dx in out could change what the backward reads: out may be dy or x
    itself (in place) but must not otherwise overlap them, gamma or the statistics."""
    return (_overlaps(out, gamma) or _overlaps(out, mean) or _overlaps(out, rstd)
            or _clobbers(out, dy) or _clobbers(out, x))


cdef inline object _zero_sums(Py_ssize_t n, int typenum):
    """A backward's dgamma or dbeta: n zeros of typenum, for the kernels to add into."""
    cdef cnp.npy_intp shape = n
    return cnp.PyArray_ZEROS(1, &shape, typenum, 0)


cdef inline object _backward_outputs(object out, cnp.ndarray x, object dy, object gamma,
                                     object mean, object rstd, Py_ssize_t n_params,
                                     int typenum, int param_typenum):
    """(dx, dgamma, dbeta) of a recognised per-channel backward (BatchNorm, GroupNorm): dx out,
    when it is a kernel array like x that _clobbers_backward_inputs allows, or a new array;
    dgamma and dbeta n_params zeros. None when out needs the general path."""
    if not _is_fast_out(out, x) or _clobbers_backward_inputs(out, dy, x, gamma, mean, rstd):
        return None
    dx = out if out is not None else _new_like(x, typenum)
    return dx, _zero_sums(n_params, param_typenum), _zero_sums(n_params, param_typenum)


cdef inline bint _same_leading_dims(cnp.ndarray a, cnp.ndarray b, int ndim):
    cdef int axis
    for axis in range(ndim):
        if cnp.PyArray_DIM(a, axis) != cnp.PyArray_DIM(b, axis):
            return False
    return True


cdef inline bint _same_shape(cnp.ndarray a, cnp.ndarray b):
    cdef int ndim = cnp.PyArray_NDIM(a)
    return cnp.PyArray_NDIM(b) == ndim and _same_leading_dims(a, b, ndim)


cdef inline bint _is_fast_eps(object eps):
    return type(eps) is float and 0.0 <= <double>eps < INFINITY


cdef inline bint _is_last_axis(object axis, int ndim):
    """A forward's axis argument naming the last axis, as a plain int (-1 or ndim - 1)."""
    return type(axis) is int and (axis == -1 or axis == ndim - 1)


cdef inline bint _is_fast_out(object out, cnp.ndarray like):
    """None, or a writeable kernel array of like's dtype and shape."""
    if out is None:
        return True
    return (_is_kernel_array(out, cnp.PyArray_TYPE(like))
            and cnp.PyArray_ISWRITEABLE(<cnp.ndarray>out) and _same_shape(<cnp.ndarray>out, like))


cdef inline bint _is_row_stats(object value, int typenum, cnp.ndarray x):
    """A cache's per-row statistic (mean or rstd) for x normalized over its last axis: a kernel
    array of typenum and shape x.shape[:-1], as the forward made it."""
    if not _is_kernel_array(value, typenum):
        return False
    cdef cnp.ndarray stats = <cnp.ndarray>value
    cdef int ndim = cnp.PyArray_NDIM(x) - 1
    return cnp.PyArray_NDIM(stats) == ndim and _same_leading_dims(stats, x, ndim)


cdef inline bint _is_cache_dtype(object dtype, cnp.ndarray x):
    """A cache's _dtype field for x: x's own dtype, as fastln's forwards record it, or None (a
    cache built by hand, whose dtype is then its statistics', float32 or float64 as
    _is_row_stats checks: x's own only when x is float32 or float64; for half-precision x the
    general path refuses the cache)."""
    if dtype is None:
        return cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32 or cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT64
    return (cnp.PyArray_DescrCheck(dtype)
            and cnp.PyArray_EquivTypes(<cnp.dtype>dtype, <cnp.dtype>cnp.PyArray_DESCR(x)))


# What every recogniser establishes first about its x and num_threads (_fast_rows).
ctypedef struct _FastRows:
    int storage           # the storage type of x
    int typenum           # x's dtype number
    int param_typenum     # gamma, beta and statistics: float32, or float64 for float64 x
    int ndim
    Py_ssize_t n_cols     # x.shape[-1], not 0
    Py_ssize_t n_rows     # the product of the other dimensions
    int threads           # the thread count, within the cap


cdef inline bint _fast_rows(object x, object num_threads, _FastRows *rows):
    """The opening test of every recogniser: x a kernel array of a storage type with at least
    one dimension and a non-empty last axis, and a thread count that needs no checking."""
    if type(x) is not cnp.ndarray:
        return False
    cdef cnp.ndarray array = <cnp.ndarray>x
    rows.typenum = cnp.PyArray_TYPE(array)
    rows.storage = _storage_of(rows.typenum)
    rows.ndim = cnp.PyArray_NDIM(array)
    if rows.storage < 0 or rows.ndim == 0 or not _is_kernel_array(x, rows.typenum):
        return False
    rows.param_typenum = cnp.NPY_FLOAT64 if rows.storage == FASTLN_FLOAT64 else cnp.NPY_FLOAT32
    rows.n_cols = cnp.PyArray_DIM(array, rows.ndim - 1)
    if num_threads is None:
        rows.threads = min(fastln_get_num_threads(), fastln_thread_cap())
    elif type(num_threads) is int and 1 <= num_threads <= fastln_thread_cap():
        rows.threads = <int>num_threads
    else:
        return False
    if rows.n_cols == 0:
        return False
    rows.n_rows = cnp.PyArray_SIZE(array) // rows.n_cols
    return True


cdef inline object _new_like(cnp.ndarray x, int typenum):
    """An output of x's shape (from the output cache when it is large)."""
    return new_output(cnp.PyArray_NDIM(x), cnp.PyArray_DIMS(x), typenum, cnp.PyArray_NBYTES(x))


cdef inline object _new_row_stats(cnp.ndarray x, int typenum):
    """A per-row statistic (mean, rstd) of x normalized over its last axis: x.shape[:-1]."""
    return cnp.PyArray_EMPTY(cnp.PyArray_NDIM(x) - 1, cnp.PyArray_DIMS(x), typenum, 0)


cdef inline object _new_column_sums(cnp.ndarray x, int typenum):
    """A parameter gradient (dgamma, dbeta) of x normalized over its last axis: x.shape[-1:]."""
    return cnp.PyArray_EMPTY(1, cnp.PyArray_DIMS(x) + cnp.PyArray_NDIM(x) - 1, typenum, 0)


cdef inline object _as_param(object value, _FastRows *rows, Py_ssize_t n):
    """gamma, beta or bias (n values) of a half-precision x given in x's own format (as a model
    in float16 or bfloat16 holds its weights): the float32 the kernels take. Any other value as
    it is, for the recogniser's own tests."""
    if ((rows.storage != FASTLN_FLOAT16 and rows.storage != FASTLN_BFLOAT16) or value is None
            or not _is_param(value, rows.typenum, n)):
        return value
    cdef cnp.ndarray widened = cnp.PyArray_EMPTY(1, cnp.PyArray_DIMS(<cnp.ndarray>value),
                                                 cnp.NPY_FLOAT32, 0)
    # As the kernels' loads widen x: exact, as NumPy's cast is, except that F16C makes a
    # signalling NaN quiet - which changes no output, arithmetic on it giving that quiet NaN.
    _convert(FASTLN_WIDEN, <cnp.ndarray>value, widened, rows.storage)
    return widened


# The recognisers' op codes (the forward task of each operation).
LAYER_NORM = FASTLN_LAYER_NORM_FORWARD
RMS_NORM = FASTLN_RMS_NORM_FORWARD
ADD_LAYER_NORM = FASTLN_ADD_LAYER_NORM_FORWARD
ADD_RMS_NORM = FASTLN_ADD_RMS_NORM_FORWARD


cdef inline bint _is_safe_add_output(object output, object x, object residual, object bias,
                                     object gamma, object beta):
    """An add-norm output (out or sum_out, or None) may sit exactly on x or residual (a row is
    read completely before its s and y are written) but must not otherwise overlap an input."""
    return not (_clobbers(output, x) or _clobbers(output, residual) or _overlaps(output, bias)
                or _overlaps(output, gamma) or _overlaps(output, beta))


def row_norm_forward_fast(int op, object x, object residual, object gamma, object beta,
                          object bias, object eps, object axis, object out, object sum_out,
                          object num_threads, bint keep_cache):
    """A row normalization's forward - op LAYER_NORM, RMS_NORM, ADD_LAYER_NORM or ADD_RMS_NORM -
    when its arguments are kernel-ready; None when the call needs the general path. Without
    keep_cache, what the public function returns (y, or (y, s) for the fused adds: a one-row
    call costs little more than a tuple to repack); with it, (y, s, mean, rstd), s None but for
    the fused adds and mean None for RMSNorm. The caller passes None for the arguments the op
    does not have."""
    cdef _FastRows rows
    if not _fast_rows(x, num_threads, &rows):
        return None
    cdef cnp.ndarray x_array = <cnp.ndarray>x
    gamma, beta = _as_param(gamma, &rows, rows.n_cols), _as_param(beta, &rows, rows.n_cols)
    bias = _as_param(bias, &rows, rows.n_cols)
    cdef bint fused = op == FASTLN_ADD_LAYER_NORM_FORWARD or op == FASTLN_ADD_RMS_NORM_FORWARD
    cdef bint has_mean = op == FASTLN_LAYER_NORM_FORWARD or op == FASTLN_ADD_LAYER_NORM_FORWARD
    if (not _is_last_axis(axis, rows.ndim) or not _is_fast_eps(eps)
            or not _is_param(gamma, rows.param_typenum, rows.n_cols)
            or not _is_param(beta, rows.param_typenum, rows.n_cols)
            or not _is_fast_out(out, x_array)):
        return None
    if fused:
        # out and sum_out may each be x or residual (sum_out=residual updates the residual
        # stream in place), but not each other: the general path refuses that.
        if (not _is_kernel_array(residual, rows.typenum)
                or not _same_shape(<cnp.ndarray>residual, x_array)
                or not _is_param(bias, rows.param_typenum, rows.n_cols)
                or not _is_fast_out(sum_out, x_array) or _overlaps(out, sum_out)
                or not _is_safe_add_output(out, x, residual, bias, gamma, beta)
                or not _is_safe_add_output(sum_out, x, residual, bias, gamma, beta)):
            return None
    # out may be x itself (in place), except when the cache keeps x for the backward.
    elif (_overlaps(out, gamma) or _overlaps(out, beta) or _clobbers(out, x)
            or (keep_cache and _overlaps(out, x))):
        return None
    y = out if out is not None else _new_like(x_array, rows.typenum)
    s = mean = rstd = None
    if fused:
        s = sum_out if sum_out is not None else _new_like(x_array, rows.typenum)
    if keep_cache:
        rstd = _new_row_stats(x_array, rows.param_typenum)
        if has_mean:
            mean = _new_row_stats(x_array, rows.param_typenum)
    cdef fastln_rows_call call
    _rows_call(&call, cnp.PyArray_DATA(x_array), rows.n_rows, rows.n_cols,
               cnp.PyArray_NBYTES(x_array), <double>eps)
    if fused:
        _add_norm_forward(op, &call, residual, bias, gamma, beta, s, y, mean, rstd, rows.storage,
                          rows.threads)
    elif has_mean:
        _layer_norm_forward(&call, gamma, beta, cnp.PyArray_DATA(<cnp.ndarray>y), mean, rstd,
                            rows.storage, rows.threads)
    else:
        _rms_norm_forward(&call, gamma, cnp.PyArray_DATA(<cnp.ndarray>y), rstd, rows.storage,
                          rows.threads)
    if keep_cache:
        return y, s, mean, rstd
    return (y, s) if fused else y


def row_norm_backward_fast(bint rms, object dy, object x, object mean, object rstd,
                           object axis, object dtype, object eps, object gamma, object out,
                           object num_threads):
    """(dx, dgamma, dbeta) of LayerNorm's backward, (dx, dgamma) of RMSNorm's (rms; mean None),
    for a cache normalized over x's last axis; None when the call needs the general path. x,
    mean, rstd, axis, eps and dtype (its _dtype field) come from the cache."""
    cdef _FastRows rows
    if not _fast_rows(x, num_threads, &rows):
        return None
    cdef cnp.ndarray x_array = <cnp.ndarray>x
    gamma = _as_param(gamma, &rows, rows.n_cols)
    # A cache's axis is non-negative: -1 there is a forged cache, for the general path to refuse.
    if (type(axis) is not int or axis != rows.ndim - 1
            or not _is_kernel_array(dy, rows.typenum) or not _same_shape(<cnp.ndarray>dy, x_array)
            or not _is_cache_dtype(dtype, x_array) or not _is_fast_eps(eps)
            or not _is_param(gamma, rows.param_typenum, rows.n_cols)
            or not _is_fast_out(out, x_array)
            or not (rms or _is_row_stats(mean, rows.param_typenum, x_array))
            or not _is_row_stats(rstd, rows.param_typenum, x_array)):
        return None
    if _clobbers_backward_inputs(out, dy, x, gamma, mean, rstd):
        return None
    dx = out if out is not None else _new_like(x_array, rows.typenum)
    dgamma = _new_column_sums(x_array, rows.param_typenum)
    cdef fastln_rows_call call
    _rows_call(&call, cnp.PyArray_DATA(x_array), rows.n_rows, rows.n_cols,
               cnp.PyArray_NBYTES(x_array), <double>eps)
    if rms:
        _rms_norm_backward(&call, dy, gamma, rstd, dx, dgamma, rows.storage, rows.threads)
        return dx, dgamma
    dbeta = _new_column_sums(x_array, rows.param_typenum)
    _layer_norm_backward(&call, dy, gamma, mean, rstd, dx, dgamma, dbeta, rows.storage,
                         rows.threads)
    return dx, dgamma, dbeta


# PyTorch tensors, for fastln.torch's inference calls (row_norm_forward_tensor). A tensor's
# .numpy() view and torch.from_numpy cost more than a one-row call's arithmetic; these read a
# tensor's memory by its address instead. register_torch sets them when fastln.torch is imported.
cdef object _torch_tensor = None  # torch.Tensor: exact instances only, never subclasses
cdef object _torch_strided = None
cdef object _torch_bfloat16 = None
cdef dict _torch_storages = {}    # torch dtype -> its storage type
cdef object _torch_from_numpy = None


def register_torch(object tensor_type, object strided, dict storages, object bfloat16,
                   object from_numpy):
    """What row_norm_forward_tensor needs of PyTorch: the tensor class, the strided layout, the
    storage type of each dtype it reads in place, the bfloat16 dtype (its results are made as
    int16 and viewed as it) and torch.from_numpy."""
    global _torch_tensor, _torch_strided, _torch_storages, _torch_bfloat16, _torch_from_numpy
    _torch_tensor, _torch_strided, _torch_bfloat16 = tensor_type, strided, bfloat16
    _torch_storages = {dtype: int(storage) for dtype, storage in storages.items()}
    _torch_from_numpy = from_numpy


cdef inline Py_ssize_t _storage_bytes(int storage) noexcept:
    return 8 if storage == FASTLN_FLOAT64 else 4 if storage == FASTLN_FLOAT32 else 2


cdef inline bint _fast_tensor_rows(object x, object num_threads, _FastRows *rows,
                                   cnp.npy_intp *dims, Py_ssize_t *address):
    """_fast_rows for a PyTorch tensor: an exact torch.Tensor on the CPU, strided (sparse and
    MKL-DNN layouts are not), contiguous, without a negative bit (a lazy negation its memory
    does not hold), of a storage type, with memory (a ZeroTensor has none: address 0) - the
    tensors whose .numpy() view fastln would read - and a non-empty last axis. dims gets its
    shape, address its data."""
    if _torch_tensor is None or type(x) is not _torch_tensor:
        return False
    storage = _torch_storages.get(x.dtype)
    if storage is None or not x.is_cpu or x.layout is not _torch_strided:
        return False
    try:
        # A nested tensor has no shape, and torch.func's wrappers no data pointer: both raise.
        if x.is_neg() or not x.is_contiguous():
            return False
        shape = x.shape
        address[0] = x.data_ptr()
    except RuntimeError:
        return False
    rows.ndim = len(shape)
    if rows.ndim == 0 or rows.ndim > cnp.NPY_MAXDIMS or address[0] == 0:
        return False
    cdef Py_ssize_t size = 1
    cdef int axis
    for axis in range(rows.ndim):
        dims[axis] = shape[axis]
        size *= dims[axis]
    rows.n_cols = dims[rows.ndim - 1]
    if size == 0:
        return False
    rows.n_rows = size // rows.n_cols
    rows.storage = <int>storage
    rows.param_typenum = cnp.NPY_FLOAT64 if rows.storage == FASTLN_FLOAT64 else cnp.NPY_FLOAT32
    # x's NumPy type, for _as_param to know parameters given in x's own format; a bfloat16
    # result is made as int16 (NumPy has no bfloat16 of its own).
    rows.typenum = (cnp.NPY_FLOAT16 if rows.storage == FASTLN_FLOAT16
                    else _bfloat16_typenum if rows.storage == FASTLN_BFLOAT16
                    else rows.param_typenum)
    if num_threads is None:
        rows.threads = min(fastln_get_num_threads(), fastln_thread_cap())
    elif type(num_threads) is int and 1 <= num_threads <= fastln_thread_cap():
        rows.threads = <int>num_threads
    else:
        return False
    return True


def row_norm_forward_tensor(int op, object x, Py_ssize_t width, object gamma, object beta,
                            object eps, object num_threads):
    """y (a tensor) of LayerNorm (op LAYER_NORM) or RMSNorm (RMS_NORM, beta None) of a PyTorch
    tensor x over its last axis of `width` elements, without a cache, as fastln.torch's
    inference calls make it: the same entry and the same bits as row_norm_forward_fast on
    x.numpy(). gamma and beta are NumPy arrays (or None). None when the call needs the general
    path (which raises for what is wrong, a width that is not x's among it)."""
    cdef _FastRows rows
    cdef cnp.npy_intp dims[cnp.NPY_MAXDIMS]
    cdef Py_ssize_t address = 0
    memset(&rows, 0, sizeof(rows))  # set by _fast_tensor_rows; zeroed for the compiler's sake
    if op != FASTLN_LAYER_NORM_FORWARD and (op != FASTLN_RMS_NORM_FORWARD or beta is not None):
        return None
    if not _fast_tensor_rows(x, num_threads, &rows, dims, &address) or rows.n_cols != width:
        return None
    gamma, beta = _as_param(gamma, &rows, rows.n_cols), _as_param(beta, &rows, rows.n_cols)
    if (not _is_fast_eps(eps) or not _is_param(gamma, rows.param_typenum, rows.n_cols)
            or not _is_param(beta, rows.param_typenum, rows.n_cols)):
        return None
    cdef Py_ssize_t n_bytes = rows.n_rows * rows.n_cols * _storage_bytes(rows.storage)
    cdef bint bfloat16 = rows.storage == FASTLN_BFLOAT16
    y = new_output(rows.ndim, dims, cnp.NPY_INT16 if bfloat16 else rows.typenum, n_bytes)
    cdef fastln_rows_call call
    _rows_call(&call, <const void*>address, rows.n_rows, rows.n_cols, n_bytes, <double>eps)
    if op == FASTLN_LAYER_NORM_FORWARD:
        _layer_norm_forward(&call, gamma, beta, cnp.PyArray_DATA(<cnp.ndarray>y), None, None,
                            rows.storage, rows.threads)
    else:
        _rms_norm_forward(&call, gamma, cnp.PyArray_DATA(<cnp.ndarray>y), None, rows.storage,
                          rows.threads)
    result = _torch_from_numpy(y)
    return result.view(_torch_bfloat16) if bfloat16 else result


cdef inline bint _is_running(object value, Py_ssize_t n_features, bint training):
    """A running statistic the recogniser takes: a 1-D float32 or float64 kernel array of
    n_features values, writeable in training mode (which updates it)."""
    if not (_is_param(value, cnp.NPY_FLOAT32, n_features)
            or _is_param(value, cnp.NPY_FLOAT64, n_features)):
        return False
    return not training or cnp.PyArray_ISWRITEABLE(<cnp.ndarray>value)


cdef void _update_running(cnp.ndarray running, double momentum, cnp.ndarray batch_stat):
    """running = momentum * running + (1 - momentum) * batch_stat in double, stored in its own
    dtype: the general path's update_running (fastln/_batch_norm.py), operation for operation."""
    if momentum == 1.0:
        return
    cdef const double *stat = <const double*>cnp.PyArray_DATA(batch_stat)
    cdef Py_ssize_t c, n = cnp.PyArray_SIZE(running)
    cdef float *single = <float*>cnp.PyArray_DATA(running)
    cdef double *double_ = <double*>cnp.PyArray_DATA(running)
    cdef double weight = 1.0 - momentum
    cdef bint is_float = cnp.PyArray_TYPE(running) == cnp.NPY_FLOAT32
    for c in range(n):
        if is_float:
            single[c] = <float>(stat[c] if momentum == 0.0
                                else momentum * <double>single[c] + weight * stat[c])
        else:
            double_[c] = (stat[c] if momentum == 0.0
                          else momentum * double_[c] + weight * stat[c])


cdef inline void _feature_layout(cnp.ndarray x, Py_ssize_t feature_axis, Py_ssize_t *n_outer,
                                 Py_ssize_t *n_features, Py_ssize_t *n_inner) noexcept:
    """x as a C-order (n_outer, n_features, n_inner) block around its feature axis (the general
    path's feature_layout)."""
    cdef Py_ssize_t d
    n_outer[0] = n_inner[0] = 1
    n_features[0] = cnp.PyArray_DIM(x, feature_axis)
    for d in range(feature_axis):
        n_outer[0] *= cnp.PyArray_DIM(x, d)
    for d in range(feature_axis + 1, cnp.PyArray_NDIM(x)):
        n_inner[0] *= cnp.PyArray_DIM(x, d)


def batch_norm_forward_fast(object x, object gamma, object beta, object running_mean,
                            object running_var, object training, object momentum, object eps,
                            object axis, object out, object num_threads):
    """(y, mean, rstd, axis) of BatchNorm's forward, the running statistics updated in training
    mode, when its arguments are kernel-ready (axis the normalized feature axis); None when the
    call needs the general path (fastln/_batch_norm.py), which holds every rule and message."""
    cdef _FastRows rows
    if (not _fast_rows(x, num_threads, &rows) or type(training) is not bool
            or type(momentum) is not float or not 0.0 <= <double>momentum <= 1.0
            or not _is_fast_eps(eps) or type(axis) is not int
            or not -rows.ndim <= axis < rows.ndim):
        return None
    cdef cnp.ndarray x_array = <cnp.ndarray>x
    cdef Py_ssize_t feature_axis = <Py_ssize_t>axis + (rows.ndim if axis < 0 else 0)
    if cnp.PyArray_SIZE(x_array) == 0:
        return None
    cdef Py_ssize_t n_outer, n_features, n_inner
    _feature_layout(x_array, feature_axis, &n_outer, &n_features, &n_inner)
    cdef bint train = training
    gamma, beta = _as_param(gamma, &rows, n_features), _as_param(beta, &rows, n_features)
    if (not _is_param(gamma, rows.param_typenum, n_features)
            or not _is_param(beta, rows.param_typenum, n_features)
            or (running_mean is None) != (running_var is None)
            or (running_mean is None and not train)):
        return None
    if running_mean is not None and (
            not _is_running(running_mean, n_features, train)
            or not _is_running(running_var, n_features, train)
            or _overlaps(running_mean, running_var)):
        return None
    if (not _is_fast_out(out, x_array) or _overlaps(out, x) or _overlaps(out, gamma)
            or _overlaps(out, beta) or _overlaps(out, running_mean)
            or _overlaps(out, running_var)):
        return None
    y = out if out is not None else _new_like(x_array, rows.typenum)
    # every feature's statistics are written by the kernels (var only in training mode)
    cdef cnp.npy_intp shape = n_features
    mean = cnp.PyArray_EMPTY(1, &shape, cnp.NPY_FLOAT64, 0)
    var = cnp.PyArray_EMPTY(1, &shape, cnp.NPY_FLOAT64, 0) if train else None
    rstd = cnp.PyArray_EMPTY(1, &shape, cnp.NPY_FLOAT64, 0)
    batch_norm_forward(x_array, y, n_outer, n_features, n_inner, gamma, beta,
                       None if train else running_mean, None if train else running_var, mean,
                       var, rstd, train, <double>eps, rows.storage, rows.threads)
    if train and running_mean is not None:
        _update_running(<cnp.ndarray>running_mean, <double>momentum, mean)
        _update_running(<cnp.ndarray>running_var, <double>momentum, var)
    return y, mean, rstd, feature_axis


def batch_norm_backward_fast(object dy, object x, object mean, object rstd, object axis,
                             object dtype, object eps, object training, object gamma,
                             object out, object num_threads):
    """(dx, dgamma, dbeta) of BatchNorm's backward when the cache's fields (x, mean, rstd, axis,
    dtype, eps, training) are as batch_norm_forward made them and the arguments are
    kernel-ready; None when the call needs the general path (fastln/_batch_norm.py), which
    holds every rule and message."""
    cdef _FastRows rows
    if (not _fast_rows(x, num_threads, &rows) or type(axis) is not int
            or not 0 <= axis < rows.ndim or type(training) is not bool
            or not _is_fast_eps(eps) or dtype is None or not _is_cache_dtype(dtype, x)
            or not _is_kernel_array(dy, rows.typenum)
            or not _same_shape(<cnp.ndarray>dy, <cnp.ndarray>x)):
        return None
    cdef cnp.ndarray x_array = <cnp.ndarray>x
    if cnp.PyArray_SIZE(x_array) == 0:
        return None
    cdef Py_ssize_t n_outer, n_features, n_inner
    _feature_layout(x_array, <Py_ssize_t>axis, &n_outer, &n_features, &n_inner)
    gamma = _as_param(gamma, &rows, n_features)
    if (mean is None or rstd is None or not _is_param(mean, cnp.NPY_FLOAT64, n_features)
            or not _is_param(rstd, cnp.NPY_FLOAT64, n_features)
            or not _is_param(gamma, rows.param_typenum, n_features)):
        return None
    outputs = _backward_outputs(out, x_array, dy, gamma, mean, rstd, n_features, rows.typenum,
                                rows.param_typenum)
    if outputs is None:
        return None
    dx, dgamma, dbeta = outputs
    batch_norm_backward(<cnp.ndarray>dy, x_array, dx, dgamma, dbeta, n_outer, n_features,
                        n_inner, gamma, mean, rstd, <bint>training, <double>eps,
                        rows.storage, rows.threads)
    return outputs


cdef inline bint _group_layout_of(cnp.ndarray x, int ndim, Py_ssize_t axis, object num_groups,
                                  Py_ssize_t *n_samples, Py_ssize_t *n_channels,
                                  Py_ssize_t *n_groups, Py_ssize_t *n_spatial):
    """The GroupNorm layout of x, its channels on axis (normalized: 1, or ndim - 1 for channels
    last), in num_groups groups (an int, or None: one per channel); False when x is empty or the
    groups do not divide the channels: the general path's to refuse."""
    if axis != 1 and axis != ndim - 1:
        return False
    n_samples[0] = cnp.PyArray_DIM(x, 0)
    n_channels[0] = cnp.PyArray_DIM(x, axis)
    if n_samples[0] == 0 or n_channels[0] == 0 or cnp.PyArray_SIZE(x) == 0:
        return False
    n_spatial[0] = cnp.PyArray_SIZE(x) // (n_samples[0] * n_channels[0])
    if num_groups is None:
        n_groups[0] = n_channels[0]
        return True
    if not 1 <= num_groups <= n_channels[0] or n_channels[0] % <Py_ssize_t>num_groups != 0:
        return False
    n_groups[0] = num_groups
    return True


def group_norm_forward_fast(object x, object num_groups, object gamma, object beta, object eps,
                            object channel_axis, object out, object num_threads,
                            bint keep_cache):
    """(y, mean, rstd, channel_axis, num_groups) of GroupNorm's forward - mean and rstd of
    shape (N, num_groups), None without keep_cache; channel_axis normalized (1 or x.ndim - 1);
    num_groups None: one group per channel (InstanceNorm) - when its arguments are
    kernel-ready; None when the call needs the general path (fastln/_group_norm.py), which
    holds every rule and message."""
    cdef _FastRows rows
    if (not _fast_rows(x, num_threads, &rows) or rows.ndim < 2
            or (num_groups is not None and type(num_groups) is not int)
            or type(channel_axis) is not int or not -rows.ndim <= channel_axis < rows.ndim
            or not _is_fast_eps(eps)):
        return None
    cdef cnp.ndarray x_array = <cnp.ndarray>x
    # As the general path: channel_axis=-1 of a 2-D x is axis 1, channels first.
    cdef Py_ssize_t axis = rows.ndim - 1 if channel_axis == -1 else channel_axis
    cdef Py_ssize_t n_samples, n_channels, n_groups, n_spatial
    if not _group_layout_of(x_array, rows.ndim, axis, num_groups, &n_samples, &n_channels,
                            &n_groups, &n_spatial):
        return None
    gamma, beta = _as_param(gamma, &rows, n_channels), _as_param(beta, &rows, n_channels)
    if (not _is_param(gamma, rows.param_typenum, n_channels)
            or not _is_param(beta, rows.param_typenum, n_channels)):
        return None
    if (not _is_fast_out(out, x_array) or _overlaps(out, x) or _overlaps(out, gamma)
            or _overlaps(out, beta)):
        return None
    y = out if out is not None else _new_like(x_array, rows.typenum)
    cdef cnp.npy_intp statistics_shape[2]
    statistics_shape[0], statistics_shape[1] = n_samples, n_groups
    mean = cnp.PyArray_EMPTY(2, statistics_shape, rows.param_typenum, 0) if keep_cache else None
    rstd = cnp.PyArray_EMPTY(2, statistics_shape, rows.param_typenum, 0) if keep_cache else None
    group_norm_forward(x_array, gamma, beta, y, mean, rstd, n_samples, n_channels, n_groups,
                       n_spatial, axis != 1, <double>eps, rows.storage, rows.threads)
    return y, mean, rstd, axis, n_groups


cdef inline bint _is_group_stats(object value, int typenum, Py_ssize_t n_samples,
                                 Py_ssize_t n_groups):
    """A GroupNorm cache's mean or rstd: a kernel array of typenum and shape (N, num_groups)."""
    return (_is_kernel_array(value, typenum) and cnp.PyArray_NDIM(<cnp.ndarray>value) == 2
            and cnp.PyArray_DIM(<cnp.ndarray>value, 0) == n_samples
            and cnp.PyArray_DIM(<cnp.ndarray>value, 1) == n_groups)


def group_norm_backward_fast(object dy, object x, object mean, object rstd, object num_groups,
                             object channel_axis, object eps, object dtype, object gamma,
                             object out, object num_threads, bint one_group_per_channel):
    """(dx, dgamma, dbeta) of GroupNorm's backward when the cache's fields (x, mean, rstd,
    num_groups, channel_axis, eps, dtype) are as group_norm_forward made them and the arguments
    are kernel-ready (one_group_per_channel: InstanceNorm's backward, whose cache must have a
    group per channel); None when the call needs the general path (fastln/_group_norm.py),
    which holds every rule and message."""
    cdef _FastRows rows
    if (not _fast_rows(x, num_threads, &rows) or rows.ndim < 2 or type(num_groups) is not int
            or type(channel_axis) is not int or not 0 <= channel_axis < rows.ndim
            or not _is_fast_eps(eps) or dtype is None
            or not _is_cache_dtype(dtype, x) or not _is_kernel_array(dy, rows.typenum)
            or not _same_shape(<cnp.ndarray>dy, <cnp.ndarray>x)):
        return None
    cdef cnp.ndarray x_array = <cnp.ndarray>x
    # A cache's channel_axis is normalized already: -1 there is a forged cache.
    cdef Py_ssize_t n_samples, n_channels, n_groups, n_spatial
    if (not _group_layout_of(x_array, rows.ndim, channel_axis, num_groups, &n_samples,
                             &n_channels, &n_groups, &n_spatial)
            or (one_group_per_channel and n_groups != n_channels)):
        return None
    gamma = _as_param(gamma, &rows, n_channels)
    if (not _is_group_stats(mean, rows.param_typenum, n_samples, n_groups)
            or not _is_group_stats(rstd, rows.param_typenum, n_samples, n_groups)
            or not _is_param(gamma, rows.param_typenum, n_channels)):
        return None
    outputs = _backward_outputs(out, x_array, dy, gamma, mean, rstd, n_channels, rows.typenum,
                                rows.param_typenum)
    if outputs is None:
        return None
    dx, dgamma, dbeta = outputs
    group_norm_backward(<cnp.ndarray>dy, x_array, gamma, <cnp.ndarray>mean, <cnp.ndarray>rstd,
                        dx, dgamma, dbeta, n_samples, n_channels, n_groups, n_spatial,
                        channel_axis > 1, <double>eps, rows.storage, rows.threads)
    return outputs


def storage_code(cnp.dtype dtype):
    """The storage type of a kernel dtype: native float16, bfloat16 (ml_dtypes), float32 or
    float64, as the Python layer has checked. Meeting bfloat16 lets the recognisers take it."""
    cdef int code = _storage_of(dtype.num)
    if code < 0 and dtype.kind == "V" and dtype.itemsize == 2 and dtype.name == "bfloat16":
        register_bfloat16(dtype.num)
        code = FASTLN_BFLOAT16
    if code < 0:
        raise TypeError(f"fastln has no kernel for dtype {dtype}")
    return code

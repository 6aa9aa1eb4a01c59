/* Recycled memory for fastln's large outputs (issue 4).
 *
 * A fresh output of tens of MiB costs more to fault in (the kernel maps and zeroes every page
 * on first touch) than to compute, and glibc gives every block over 32 MiB back to the system
 * on free, so each call pays that again. These functions are the allocator behind a NumPy
 * data-memory handler (fastln/_output_cache.pyx): every block is its own anonymous mapping,
 * and a freed block goes into a small cache instead of back to the system; a later request of
 * the same size or smaller gets it back (cut down to size), already faulted in.
 *
 * The signatures are NumPy's PyDataMemAllocator's, ctx being the fastln_output_cache. There
 * is no Python here: NumPy's wrappers around the handler do the tracemalloc bookkeeping (a
 * block is tracked while an array owns it, untracked once freed, cached or not).
 *
 * Thread safety: one mutex guards the cache's list; the system calls (mmap, munmap, madvise)
 * and the copies run outside it. The functions may be called from any thread.
 */
#ifndef FASTLN_OUTPUT_CACHE_H
#define FASTLN_OUTPUT_CACHE_H

#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* Outputs of at least this many bytes come from the cache (fastln/_output_cache.pxd). It is
 * glibc's largest mmap threshold: smaller blocks come from glibc's heap once a first one was
 * freed, already paged in, and reused for any size (measured: a fresh 12 MiB output costs what
 * out= does). There a cache of 8 blocks of fixed sizes could only lose - 2 to 5 times slower
 * than glibc when a dozen sizes between 1 and 24 MiB take turns. From this size on glibc maps
 * and unmaps every block, and the cache wins. A block shrunk below it by realloc is not kept. */
#define FASTLN_OUTPUT_CACHE_MIN_BYTES (32 << 20)
/* The most blocks the cache holds, whatever their size: a training step of a transformer
 * block with the fused add-norms frees up to six outputs of one shape at once (s, y and dx of
 * two norms); the byte cap (max_bytes) is the real bound. */
#define FASTLN_OUTPUT_CACHE_MAX_BLOCKS 8
/* As NumPy's default allocator: ask for transparent huge pages from 4 MiB up. */
#define FASTLN_HUGEPAGE_MIN_BYTES ((size_t)4 << 20)

#ifndef MADV_HUGEPAGE
#define MADV_HUGEPAGE 14 /* Linux's value, as NumPy does when the headers lack it */
#endif

/* A block is one mapping: this header, alone in the first page, then the data from the second
 * page on. One page per block of 32 MiB or more buys page-aligned data: more than any vector
 * needs (NumPy's default is 16 bytes), and each data page is a whole page of the output. */
typedef struct {
    size_t mapped_bytes;    /* the whole mapping, header page included: what munmap needs */
    size_t requested_bytes; /* what its current owner asked for: what realloc copies */
} fastln_block_header;

/* What fastln.output_cache_info() reports. */
typedef struct {
    size_t max_bytes;      /* cap on the cached bytes; 0 caches nothing */
    int n_blocks;          /* blocks in the cache now */
    size_t cached_bytes;   /* their mapped bytes */
    uint64_t hits;         /* requests served from the cache */
    uint64_t misses;       /* requests that mapped a fresh block */
} fastln_output_cache_stats;

typedef struct {
    pthread_mutex_t lock;  /* guards everything below but the two constants */
    fastln_output_cache_stats stats;
    fastln_block_header *blocks[FASTLN_OUTPUT_CACHE_MAX_BLOCKS]; /* oldest first */
    size_t page_bytes;     /* constant after init */
    int advise_hugepages;  /* constant after init: madvise(MADV_HUGEPAGE) fresh blocks >= 4 MiB */
} fastln_output_cache;

static inline void fastln_output_cache_init(fastln_output_cache *cache, size_t max_bytes,
                                            int advise_hugepages)
{
    memset(cache, 0, sizeof(*cache));
    pthread_mutex_init(&cache->lock, NULL);
    cache->stats.max_bytes = max_bytes;
    cache->page_bytes = (size_t)sysconf(_SC_PAGESIZE);
    cache->advise_hugepages = advise_hugepages;
}

static inline void *fastln_block_data(const fastln_output_cache *cache,
                                      fastln_block_header *block)
{
    return (char *)block + cache->page_bytes;
}

static inline fastln_block_header *fastln_block_of(const fastln_output_cache *cache, void *data)
{
    return (fastln_block_header *)((char *)data - cache->page_bytes);
}

/* The header page plus size (at least 1) rounded up to whole pages; 0 when that overflows. */
static inline size_t fastln_block_bytes(const fastln_output_cache *cache, size_t size)
{
    const size_t page = cache->page_bytes;
    if (size == 0) size = 1;
    if (size > SIZE_MAX - 2 * page) return 0;
    return page + (size + page - 1) / page * page;
}

/* A cached block fits a request of block_bytes as it is when it wastes at most an eighth of
 * them: slack for shapes that differ by a few rows. A larger block is cut down to size first
 * (fastln_output_cache_get), so that a small output never holds a large block. */
static inline int fastln_block_fits(size_t cached_bytes, size_t block_bytes)
{
    return cached_bytes >= block_bytes && cached_bytes - block_bytes <= block_bytes / 8;
}

static inline void fastln_unmap_blocks(fastln_block_header **blocks, int n_blocks)
{
    for (int i = 0; i < n_blocks; i++) munmap(blocks[i], blocks[i]->mapped_bytes);
}

/* Take the cached blocks out, oldest first, until the cache holds at most max_blocks blocks
 * and max_bytes bytes; they are returned in evicted (unmapped by the caller, outside the
 * lock). Call with the lock held. */
static inline int fastln_output_cache_evict(fastln_output_cache *cache, int max_blocks,
                                            size_t max_bytes, fastln_block_header **evicted)
{
    fastln_output_cache_stats *stats = &cache->stats;
    int n_evicted = 0;
    while (stats->n_blocks > 0
           && (stats->n_blocks > max_blocks || stats->cached_bytes > max_bytes)) {
        fastln_block_header *oldest = cache->blocks[0];
        stats->cached_bytes -= oldest->mapped_bytes;
        stats->n_blocks--;
        memmove(cache->blocks, cache->blocks + 1, stats->n_blocks * sizeof(cache->blocks[0]));
        evicted[n_evicted++] = oldest;
    }
    return n_evicted;
}

/* The smallest cached block of at least block_bytes, taken out of the cache; NULL if none.
 * Call with the lock held. */
static inline fastln_block_header *fastln_output_cache_take(fastln_output_cache *cache,
                                                            size_t block_bytes)
{
    fastln_output_cache_stats *stats = &cache->stats;
    int best = -1;
    for (int i = 0; i < stats->n_blocks; i++) {
        const size_t mapped = cache->blocks[i]->mapped_bytes;
        if (mapped >= block_bytes && (best < 0 || mapped < cache->blocks[best]->mapped_bytes)) {
            best = i;
        }
    }
    if (best < 0) return NULL;
    fastln_block_header *block = cache->blocks[best];
    stats->cached_bytes -= block->mapped_bytes;
    stats->n_blocks--;
    memmove(cache->blocks + best, cache->blocks + best + 1,
            (stats->n_blocks - best) * sizeof(cache->blocks[0]));
    return block;
}

static inline fastln_block_header *fastln_map_block(size_t block_bytes, int advise_hugepages)
{
    void *mapping = mmap(NULL, block_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                         -1, 0);
    if (mapping == MAP_FAILED) return NULL;
    if (advise_hugepages && block_bytes >= FASTLN_HUGEPAGE_MIN_BYTES) {
        madvise(mapping, block_bytes, MADV_HUGEPAGE); /* advice only: errors do not matter */
    }
    fastln_block_header *block = (fastln_block_header *)mapping;
    block->mapped_bytes = block_bytes;
    return block;
}

/* Give the pages of a block beyond new_bytes (a multiple of the page size) back. */
static inline void fastln_block_shrink(fastln_block_header *block, size_t new_bytes)
{
    if (new_bytes < block->mapped_bytes) {
        munmap((char *)block + new_bytes, block->mapped_bytes - new_bytes);
        block->mapped_bytes = new_bytes;
    }
}

/* A block for size bytes: a cached one when one is large enough (cut down to size when it is
 * more than 1/8 too large: its first pages are paged in all the same), else a fresh mapping
 * (its pages are zero; *is_fresh says which). NULL when out of memory. */
static inline void *fastln_output_cache_get(fastln_output_cache *cache, size_t size,
                                            int *is_fresh)
{
    const size_t block_bytes = fastln_block_bytes(cache, size);
    if (block_bytes == 0) return NULL;
    pthread_mutex_lock(&cache->lock);
    fastln_block_header *block = fastln_output_cache_take(cache, block_bytes);
    if (block != NULL) cache->stats.hits++; else cache->stats.misses++;
    pthread_mutex_unlock(&cache->lock);
    *is_fresh = block == NULL;
    const int advise_hugepages = cache->advise_hugepages;
    if (block != NULL && !fastln_block_fits(block->mapped_bytes, block_bytes)) {
        fastln_block_shrink(block, block_bytes);
    }
    if (block == NULL) {
        block = fastln_map_block(block_bytes, advise_hugepages);
    }
    if (block == NULL) {
        /* Out of memory: the cached blocks (of other sizes) are the first thing to give up. */
        fastln_block_header *evicted[FASTLN_OUTPUT_CACHE_MAX_BLOCKS];
        pthread_mutex_lock(&cache->lock);
        const int n_evicted = fastln_output_cache_evict(cache, 0, 0, evicted);
        pthread_mutex_unlock(&cache->lock);
        if (n_evicted == 0) return NULL;
        fastln_unmap_blocks(evicted, n_evicted);
        block = fastln_map_block(block_bytes, advise_hugepages);
        if (block == NULL) return NULL;
    }
    block->requested_bytes = size;
    return fastln_block_data(cache, block);
}

static inline void *fastln_output_cache_malloc(void *ctx, size_t size)
{
    int is_fresh;
    return fastln_output_cache_get((fastln_output_cache *)ctx, size, &is_fresh);
}

static inline void *fastln_output_cache_calloc(void *ctx, size_t n_elements, size_t element_size)
{
    if (element_size != 0 && n_elements > SIZE_MAX / element_size) return NULL;
    const size_t size = n_elements * element_size;
    int is_fresh;
    void *data = fastln_output_cache_get((fastln_output_cache *)ctx, size, &is_fresh);
    if (data != NULL && !is_fresh) memset(data, 0, size); /* fresh pages are zero already */
    return data;
}

static inline void fastln_output_cache_free(void *ctx, void *data, size_t size)
{
    (void)size; /* NumPy's idea of the size; the header knows the block's */
    if (data == NULL) return;
    fastln_output_cache *cache = (fastln_output_cache *)ctx;
    fastln_block_header *block = fastln_block_of(cache, data);
    fastln_output_cache_stats *stats = &cache->stats;
    fastln_block_header *evicted[FASTLN_OUTPUT_CACHE_MAX_BLOCKS];
    int n_evicted;
    pthread_mutex_lock(&cache->lock);
    if (block->mapped_bytes <= stats->max_bytes
            && block->mapped_bytes >= FASTLN_OUTPUT_CACHE_MIN_BYTES) {
        /* Make room first (the oldest blocks go), then add the block as the newest. */
        n_evicted = fastln_output_cache_evict(cache, FASTLN_OUTPUT_CACHE_MAX_BLOCKS - 1,
                                              stats->max_bytes - block->mapped_bytes, evicted);
        cache->blocks[stats->n_blocks++] = block;
        stats->cached_bytes += block->mapped_bytes;
    } else {
        evicted[0] = block;
        n_evicted = 1;
    }
    pthread_mutex_unlock(&cache->lock);
    fastln_unmap_blocks(evicted, n_evicted);
}

static inline void *fastln_output_cache_realloc(void *ctx, void *data, size_t new_size)
{
    if (data == NULL) return fastln_output_cache_malloc(ctx, new_size);
    fastln_output_cache *cache = (fastln_output_cache *)ctx;
    fastln_block_header *block = fastln_block_of(cache, data);
    const size_t block_bytes = fastln_block_bytes(cache, new_size);
    if (block_bytes == 0) return NULL;
    if (block_bytes <= block->mapped_bytes) { /* shrinking: the data stays where it is */
        fastln_block_shrink(block, block_bytes);
        block->requested_bytes = new_size;
        return data;
    }
    void *new_data = fastln_output_cache_malloc(ctx, new_size);
    if (new_data == NULL) return NULL; /* as realloc: the old block stays valid */
    memcpy(new_data, data, block->requested_bytes); /* smaller than new_size: it grew */
    fastln_output_cache_free(ctx, data, block->requested_bytes);
    return new_data;
}

/* Change the byte cap; the blocks over it are unmapped at once (0: all of them). */
static inline void fastln_output_cache_set_max_bytes(fastln_output_cache *cache,
                                                     size_t max_bytes)
{
    fastln_block_header *evicted[FASTLN_OUTPUT_CACHE_MAX_BLOCKS];
    pthread_mutex_lock(&cache->lock);
    cache->stats.max_bytes = max_bytes;
    const int n_evicted = fastln_output_cache_evict(cache, FASTLN_OUTPUT_CACHE_MAX_BLOCKS,
                                                    max_bytes, evicted);
    pthread_mutex_unlock(&cache->lock);
    fastln_unmap_blocks(evicted, n_evicted);
}

/* A consistent copy of the statistics. */
static inline fastln_output_cache_stats fastln_output_cache_get_stats(fastln_output_cache *cache)
{
    pthread_mutex_lock(&cache->lock);
    const fastln_output_cache_stats stats = cache->stats;
    pthread_mutex_unlock(&cache->lock);
    return stats;
}

#endif /* FASTLN_OUTPUT_CACHE_H */

/* The audit's fast path: fold an epoch's stored rows in C when every rule holds (see intact_fold.py).
 *
 * fold_epoch(num_blocks, genesis_hash, key_rows, chunks) walks the rows the chunks iterator yields
 * (each a list of (seq, kind, owner, record, hash, last_seq, records) tuples, in seq order from seq 1),
 * inflates packed rows, names their keys back (key_refs), verifies the hash chain, and applies each
 * record as replay's inlined cases do (replay_state.apply_intact_rows, cache_replay). It answers
 * (True, "", state) only when it can prove that the Python replay finds nothing wrong and ends in
 * `state`; at the first thing it does not handle or that breaks a rule it stops and answers
 * (False, why, None): the Python replay then audits the epoch and names what is wrong.
 * It is stricter than the Python path, never looser: numbers must be canonical, keys sha256 in
 * base64url, every kind one of the inlined ones.
 *
 * Built by intact_fold_build.py with the system compiler, linked with zlib and OpenSSL's libcrypto.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/sha.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zlib.h>

#define HASH_BYTES 32
#define KEY_BYTES 32
#define KEY_TEXT 43 /* base64url of 32 bytes, unpadded */
#define NUM_FIELDS 9
#define MARKER 0x1f
#define MAX_HELPERS 3 /* threads besides the caller's that inflate and chain rows */

typedef struct {
    char *data;
    size_t len, cap;
} Buffer;

static int buffer_reserve(Buffer *b, size_t extra) {
    if (b->len + extra <= b->cap) return 1;
    size_t cap = b->cap ? b->cap : 1 << 16;
    while (cap < b->len + extra) cap *= 2;
    char *data = realloc(b->data, cap);
    if (!data) return 0;
    b->data = data;
    b->cap = cap;
    return 1;
}

static int buffer_put(Buffer *b, const char *text, size_t len) {
    if (!buffer_reserve(b, len)) return 0;
    memcpy(b->data + b->len, text, len);
    b->len += len;
    return 1;
}

/* ---- owners: interned texts ---- */

typedef struct {
    char *arena; /* the owners' UTF-8, back to back */
    size_t arena_len, arena_cap;
    size_t *start;
    size_t *len;
    PyObject **text; /* made when the state is handed out */
    int32_t count, cap;
    int32_t *slots; /* open addressing: owner id + 1, 0 empty */
    size_t num_slots;
} Owners;

static uint64_t text_hash(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ULL;
    return h ^ (h >> 29);
}

static int owners_grow_slots(Owners *o) {
    size_t num = o->num_slots ? o->num_slots * 2 : 1024;
    int32_t *slots = calloc(num, sizeof(int32_t));
    if (!slots) return 0;
    for (int32_t id = 0; id < o->count; id++) {
        size_t at = text_hash(o->arena + o->start[id], o->len[id]) & (num - 1);
        while (slots[at]) at = (at + 1) & (num - 1);
        slots[at] = id + 1;
    }
    free(o->slots);
    o->slots = slots;
    o->num_slots = num;
    return 1;
}

/* The id of owner text s[0..n), added when new; -1 when out of memory. */
static int32_t owner_id(Owners *o, const char *s, size_t n) {
    if ((size_t)(o->count + 1) * 2 > o->num_slots && !owners_grow_slots(o)) return -1;
    size_t at = text_hash(s, n) & (o->num_slots - 1);
    while (o->slots[at]) {
        int32_t id = o->slots[at] - 1;
        if (o->len[id] == n && memcmp(o->arena + o->start[id], s, n) == 0) return id;
        at = (at + 1) & (o->num_slots - 1);
    }
    if (o->count == o->cap) {
        int32_t cap = o->cap ? o->cap * 2 : 1024;
        size_t *start = realloc(o->start, cap * sizeof(size_t));
        if (!start) return -1;
        o->start = start;
        size_t *len = realloc(o->len, cap * sizeof(size_t));
        if (!len) return -1;
        o->len = len;
        PyObject **text = realloc(o->text, cap * sizeof(PyObject *));
        if (!text) return -1;
        o->text = text;
        o->cap = cap;
    }
    if (o->arena_len + n > o->arena_cap) {
        size_t cap = o->arena_cap ? o->arena_cap : 1 << 16;
        while (cap < o->arena_len + n) cap *= 2;
        char *arena = realloc(o->arena, cap);
        if (!arena) return -1;
        o->arena = arena;
        o->arena_cap = cap;
    }
    int32_t id = o->count++;
    memcpy(o->arena + o->arena_len, s, n);
    o->start[id] = o->arena_len;
    o->len[id] = n;
    o->text[id] = NULL;
    o->arena_len += n;
    o->slots[at] = id + 1;
    return id;
}

static PyObject *owner_text(Owners *o, int32_t id) {
    if (!o->text[id]) o->text[id] = PyUnicode_DecodeUTF8(o->arena + o->start[id], o->len[id], "strict");
    Py_XINCREF(o->text[id]);
    return o->text[id];
}

/* ---- the pool ---- */

typedef struct {
    int32_t num_blocks;
    int32_t *free_stack; /* bottom .. top */
    int32_t num_free;
    int32_t *owner;      /* block -> owner id, -1 free */
    int32_t **sharers;   /* block -> other holders in order */
    int32_t *num_sharers, *sharers_cap;
    int32_t *lru_prev, *lru_next; /* cached-free list, oldest first; -1 ends */
    int32_t lru_head, lru_tail, num_cached;
    uint8_t *cached;
    uint8_t *registered;
    uint8_t *key;        /* block -> its key's 32 bytes */
    char *key_text;      /* block -> its key's 43 base64url characters */
    uint8_t *parent;     /* block -> its parent key's 32 bytes */
    uint8_t *has_parent;
    int32_t *bucket, *chain; /* key -> block: hash buckets chained through the blocks */
    int32_t num_buckets;
    /* insertion stamps: the order Python's dicts hold their keys in (owners, sharers, block_keys) */
    int64_t *owner_stamp, *sharers_stamp, *key_stamp;
    int64_t stamp;
    int32_t *mark; /* block -> the event that last named it, to find a block named twice */
    int32_t event_mark;
} Pool;

static uint32_t key_bucket(const Pool *p, const uint8_t *key) {
    uint64_t h;
    memcpy(&h, key, sizeof h);
    h ^= h >> 31;
    h *= 0x9E3779B97F4A7C15ULL;
    return (uint32_t)(h >> 32) & (uint32_t)(p->num_buckets - 1);
}

static int32_t key_block(const Pool *p, const uint8_t *key) {
    for (int32_t b = p->bucket[key_bucket(p, key)]; b >= 0; b = p->chain[b])
        if (memcmp(p->key + (size_t)b * KEY_BYTES, key, KEY_BYTES) == 0) return b;
    return -1;
}

static void key_unlink(Pool *p, int32_t block) {
    int32_t *at = &p->bucket[key_bucket(p, p->key + (size_t)block * KEY_BYTES)];
    while (*at >= 0 && *at != block) at = &p->chain[*at];
    if (*at == block) *at = p->chain[block];
}

static void lru_remove(Pool *p, int32_t b) {
    int32_t prev = p->lru_prev[b], next = p->lru_next[b];
    if (prev >= 0) p->lru_next[prev] = next; else p->lru_head = next;
    if (next >= 0) p->lru_prev[next] = prev; else p->lru_tail = prev;
    p->cached[b] = 0;
    p->num_cached--;
}

static void lru_append(Pool *p, int32_t b) {
    p->lru_prev[b] = p->lru_tail;
    p->lru_next[b] = -1;
    if (p->lru_tail >= 0) p->lru_next[p->lru_tail] = b; else p->lru_head = b;
    p->lru_tail = b;
    p->cached[b] = 1;
    p->num_cached++;
}

static int sharers_push(Pool *p, int32_t b, int32_t owner) {
    if (p->num_sharers[b] == p->sharers_cap[b]) {
        int32_t cap = p->sharers_cap[b] ? p->sharers_cap[b] * 2 : 4;
        int32_t *list = realloc(p->sharers[b], cap * sizeof(int32_t));
        if (!list) return 0;
        p->sharers[b] = list;
        p->sharers_cap[b] = cap;
    }
    if (p->num_sharers[b] == 0) p->sharers_stamp[b] = p->stamp++;
    p->sharers[b][p->num_sharers[b]++] = owner;
    return 1;
}

static int shares(const Pool *p, int32_t b, int32_t owner) {
    for (int32_t i = 0; i < p->num_sharers[b]; i++)
        if (p->sharers[b][i] == owner) return 1;
    return 0;
}

static int pool_init(Pool *p, int32_t num_blocks) {
    memset(p, 0, sizeof *p);
    size_t n = (size_t)num_blocks > 0 ? (size_t)num_blocks : 1;
    p->num_blocks = num_blocks;
    p->num_buckets = 1;
    while (p->num_buckets < 2 * num_blocks) p->num_buckets *= 2;
    p->free_stack = malloc(n * sizeof(int32_t));
    p->owner = malloc(n * sizeof(int32_t));
    p->sharers = calloc(n, sizeof(int32_t *));
    p->num_sharers = calloc(n, sizeof(int32_t));
    p->sharers_cap = calloc(n, sizeof(int32_t));
    p->lru_prev = malloc(n * sizeof(int32_t));
    p->lru_next = malloc(n * sizeof(int32_t));
    p->cached = calloc(n, 1);
    p->registered = calloc(n, 1);
    p->key = malloc(n * KEY_BYTES);
    p->key_text = malloc(n * KEY_TEXT);
    p->parent = malloc(n * KEY_BYTES);
    p->has_parent = calloc(n, 1);
    p->bucket = malloc((size_t)p->num_buckets * sizeof(int32_t));
    p->chain = malloc(n * sizeof(int32_t));
    p->owner_stamp = calloc(n, sizeof(int64_t));
    p->sharers_stamp = calloc(n, sizeof(int64_t));
    p->key_stamp = calloc(n, sizeof(int64_t));
    p->mark = calloc(n, sizeof(int32_t));
    if (!p->free_stack || !p->owner || !p->sharers || !p->num_sharers || !p->sharers_cap || !p->lru_prev ||
        !p->lru_next || !p->cached || !p->registered || !p->key || !p->key_text || !p->parent || !p->has_parent ||
        !p->bucket || !p->chain || !p->owner_stamp || !p->sharers_stamp || !p->key_stamp || !p->mark)
        return 0;
    for (int32_t i = 0; i < num_blocks; i++) {
        p->free_stack[i] = num_blocks - 1 - i; /* a fresh pool hands out 0, 1, 2, ... */
        p->owner[i] = -1;
        p->chain[i] = -1;
    }
    for (int32_t i = 0; i < p->num_buckets; i++) p->bucket[i] = -1;
    p->num_free = num_blocks;
    p->lru_head = p->lru_tail = -1;
    return 1;
}

static void pool_free(Pool *p) {
    if (p->sharers)
        for (int32_t i = 0; i < p->num_blocks; i++) free(p->sharers[i]);
    free(p->free_stack); free(p->owner); free(p->sharers); free(p->num_sharers); free(p->sharers_cap);
    free(p->lru_prev); free(p->lru_next); free(p->cached); free(p->registered); free(p->key); free(p->key_text);
    free(p->parent); free(p->has_parent); free(p->bucket); free(p->chain); free(p->owner_stamp);
    free(p->sharers_stamp); free(p->key_stamp); free(p->mark);
}

/* ---- text ---- */

/* v >= 0 in decimal into out (20 bytes at least); its length. */
static size_t decimal(int64_t v, char *out) {
    char digits[20];
    size_t n = 0;
    do {
        digits[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    for (size_t i = 0; i < n; i++) out[i] = digits[n - 1 - i];
    return n;
}

/* A canonical decimal (no sign, no leading zero, at most 18 digits) into *value. */
static int parse_uint(const char *s, size_t n, int64_t *value) {
    if (n == 0 || n > 18 || (n > 1 && s[0] == '0')) return 0;
    int64_t v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return 0;
        v = v * 10 + (s[i] - '0');
    }
    *value = v;
    return 1;
}

static int8_t B64[256];

static void b64_table(void) {
    memset(B64, -1, sizeof B64);
    const char *alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    for (int i = 0; i < 64; i++) B64[(unsigned char)alphabet[i]] = (int8_t)i;
}

/* Canonical unpadded base64url s[0..n) into out (at most n * 3 / 4 bytes); its length, -1 when not. */
static ssize_t b64_decode(const char *s, size_t n, uint8_t *out) {
    if (n % 4 == 1) return -1;
    size_t o = 0;
    uint32_t acc = 0;
    int bits = 0;
    for (size_t i = 0; i < n; i++) {
        int8_t v = B64[(unsigned char)s[i]];
        if (v < 0) return -1;
        acc = (acc << 6) | (uint32_t)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out[o++] = (uint8_t)(acc >> bits);
        }
    }
    if (bits && (acc & ((1u << bits) - 1))) return -1; /* bits past the last byte: not canonical */
    return (ssize_t)o;
}

/* The 32 bytes of a key's 43 base64url characters. */
static int key_decode(const char *s, size_t n, uint8_t *out) {
    uint8_t raw[33];
    return n == KEY_TEXT && b64_decode(s, n, raw) == KEY_BYTES && (memcpy(out, raw, KEY_BYTES), 1);
}

static void key_encode(const uint8_t *key, char *out) {
    static const char *alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    int o = 0;
    for (int i = 0; i < 30; i += 3) {
        uint32_t v = ((uint32_t)key[i] << 16) | ((uint32_t)key[i + 1] << 8) | key[i + 2];
        out[o++] = alphabet[v >> 18];
        out[o++] = alphabet[(v >> 12) & 63];
        out[o++] = alphabet[(v >> 6) & 63];
        out[o++] = alphabet[v & 63];
    }
    uint32_t v = ((uint32_t)key[30] << 16) | ((uint32_t)key[31] << 8);
    out[o++] = alphabet[v >> 18];
    out[o++] = alphabet[(v >> 12) & 63];
    out[o++] = alphabet[(v >> 6) & 63];
}

/* Whether the block's token ids are LEB128 varints in canonical base64url, the last one whole: every
 * character of the alphabet, and the last group decodes without bits to spare to a byte below 0x80. */
static int tokens_valid(const char *s, size_t n) {
    if (n == 0) return 1;
    if (n % 4 == 1) return 0;
    for (size_t i = 0; i < n; i++)
        if (B64[(unsigned char)s[i]] < 0) return 0;
    size_t last = n % 4 ? n % 4 : 4;
    uint8_t out[3];
    ssize_t len = b64_decode(s + n - last, last, out);
    return len > 0 && out[len - 1] < 0x80;
}

/* Strict UTF-8 (what Python's bytes.decode() takes: no overlong form, no surrogate, at most U+10FFFF). */
static int utf8_valid(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (i + 8 <= n) {
            uint64_t word;
            memcpy(&word, s + i, 8);
            if (!(word & 0x8080808080808080ULL)) {
                i += 8;
                continue;
            }
        }
        unsigned char c = s[i];
        if (c < 0x80) {
            i++;
        } else if (c >= 0xC2 && c <= 0xDF) {
            if (i + 1 >= n || (s[i + 1] & 0xC0) != 0x80) return 0;
            i += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (i + 2 >= n || (s[i + 1] & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80) return 0;
            if (c == 0xE0 && s[i + 1] < 0xA0) return 0;
            if (c == 0xED && s[i + 1] >= 0xA0) return 0;
            i += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (i + 3 >= n || (s[i + 1] & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80 || (s[i + 3] & 0xC0) != 0x80)
                return 0;
            if (c == 0xF0 && s[i + 1] < 0x90) return 0;
            if (c == 0xF4 && s[i + 1] >= 0x90) return 0;
            i += 4;
        } else {
            return 0;
        }
    }
    return 1;
}

/* ---- the fold ---- */

struct Slot;
typedef struct {
    z_stream zs;
    int mode; /* 0 none yet, 15 zlib, -15 raw deflate */
    Buffer inflated; /* a keyed row's packed text */
} Inflater;

typedef struct Fold {
    Pool pool;
    Owners owners;
    uint8_t genesis[HASH_BYTES], previous[HASH_BYTES];
    int64_t expected_seq, batch_end, closed_seq, num_events;
    int saw_draft;
    const char *why;
    /* the epoch's stored keys, contiguous from id 0 */
    const uint8_t *keys;
    int64_t num_keys;
    Buffer json;
    /* reading: the seq the next row must start at, the stored hash it chains from */
    int64_t read_seq;
    const uint8_t *read_previous;
    struct Slot *slots;
    size_t slots_cap;
    int num_helpers;
    Inflater inflaters[MAX_HELPERS + 1];
    int32_t *blocks; /* the record's block ids, and per block: */
    int32_t *counts;          /* a SHARE's or RELEASE's reference count after it */
    uint8_t *keys_of, *parents_of; /* a REGISTER's keys and parent keys, 32 bytes each */
    const char **key_texts_of;     /* ... its keys as written */
    uint8_t *has_parent_of;
    size_t blocks_cap;
} Fold;

#define FAIL(f, text) return ((f)->why = (text), 0)

static const char *REASONS[] = {"", "finished", "aborted", "preempted", "rejected_draft", "draft"};

static int is_reason(Fold *f, const char *s, size_t n) {
    for (size_t i = 0; i < sizeof REASONS / sizeof *REASONS; i++)
        if (strlen(REASONS[i]) == n && memcmp(REASONS[i], s, n) == 0) {
            if (i >= 4) f->saw_draft = 1;
            return 1;
        }
    return 0;
}

enum Kind { ALLOCATE, FREE, REGISTER, SHARE, RELEASE, EVICT, INIT, SNAPSHOT, CLOSE, UNKNOWN };

static enum Kind kind_of(const char *s, size_t n) {
#define IS(text) (n == sizeof(text) - 1 && memcmp(s, text, n) == 0)
    if (IS("allocate_for") || IS("allocate")) return ALLOCATE;
    if (IS("free_all") || IS("free")) return FREE;
    if (IS("register")) return REGISTER;
    if (IS("share")) return SHARE;
    if (IS("release")) return RELEASE;
    if (IS("evict")) return EVICT;
    if (IS("pool_init")) return INIT;
    if (IS("snapshot")) return SNAPSHOT;
    if (IS("pool_close")) return CLOSE;
    return UNKNOWN;
#undef IS
}

/* The block ids of a record, each in the pool and named once; their number, -1 when not. */
static ssize_t parse_blocks(Fold *f, const char *s, size_t n) {
    size_t count = 1;
    for (size_t i = 0; i < n; i++) count += s[i] == ',';
    if (count > f->blocks_cap) {
        free(f->blocks); free(f->counts); free(f->keys_of); free(f->parents_of); free(f->key_texts_of);
        free(f->has_parent_of);
        f->blocks = malloc(count * sizeof(int32_t));
        f->counts = malloc(count * sizeof(int32_t));
        f->keys_of = malloc(count * KEY_BYTES);
        f->parents_of = malloc(count * KEY_BYTES);
        f->key_texts_of = malloc(count * sizeof(char *));
        f->has_parent_of = malloc(count);
        f->blocks_cap = count;
        if (!f->blocks || !f->counts || !f->keys_of || !f->parents_of || !f->key_texts_of || !f->has_parent_of) {
            f->blocks_cap = 0;
            return -1;
        }
    }
    Pool *p = &f->pool;
    p->event_mark++;
    size_t at = 0, k = 0;
    while (k < count) {
        size_t end = at;
        while (end < n && s[end] != ',') end++;
        int64_t b;
        if (!parse_uint(s + at, end - at, &b) || b >= p->num_blocks || p->mark[b] == p->event_mark) return -1;
        p->mark[b] = p->event_mark;
        f->blocks[k++] = (int32_t)b;
        at = end + 1;
    }
    return (ssize_t)count;
}

/* SHARE, RELEASE, EVICT: whether the entries are each block's key as written now (~base64url), with the
 * count after the event when counts is not NULL. */
static int entries_are(Fold *f, const char *s, size_t n, size_t num, const int32_t *counts) {
    size_t at = 0;
    const Pool *p = &f->pool;
    for (size_t i = 0; i < num; i++) {
        if (i) {
            if (at >= n || s[at] != ',') return 0;
            at++;
        }
        if (at + 1 + KEY_TEXT > n || s[at] != '~' ||
            memcmp(s + at + 1, p->key_text + (size_t)f->blocks[i] * KEY_TEXT, KEY_TEXT) != 0)
            return 0;
        at += 1 + KEY_TEXT;
        if (counts) {
            char text[24];
            text[0] = '=';
            size_t len = 1 + decimal(counts[i], text + 1);
            if (at + len > n || memcmp(s + at, text, len) != 0) return 0;
            at += len;
        }
    }
    return at == n;
}

static int apply_register(Fold *f, size_t num, const char *s, size_t n, int32_t owner) {
    Pool *p = &f->pool;
    uint8_t(*keys)[KEY_BYTES] = (uint8_t(*)[KEY_BYTES])f->keys_of;
    uint8_t(*parents)[KEY_BYTES] = (uint8_t(*)[KEY_BYTES])f->parents_of;
    const char **key_texts = f->key_texts_of;
    uint8_t *has_parent = f->has_parent_of;
    size_t at = 0;
    for (size_t i = 0; i < num; i++) {
        size_t end = at;
        while (end < n && s[end] != ',') end++;
        if ((end < n) != (i + 1 < num)) FAIL(f, "register entries do not match its blocks");
        /* ~key:parent:tokens */
        const char *e = s + at;
        size_t len = end - at;
        if (len < 1 + KEY_TEXT + 2 || e[0] != '~' || e[1 + KEY_TEXT] != ':') FAIL(f, "register entry not ~key:...");
        if (!key_decode(e + 1, KEY_TEXT, keys[i])) FAIL(f, "register key not base64url of 32 bytes");
        key_texts[i] = e + 1;
        const char *rest = e + 2 + KEY_TEXT;
        size_t rest_len = len - 2 - KEY_TEXT;
        const char *colon = memchr(rest, ':', rest_len);
        if (!colon) FAIL(f, "register entry lacks its tokens");
        size_t parent_len = (size_t)(colon - rest);
        if (parent_len == 0) {
            has_parent[i] = 0;
        } else if (parent_len == 1 && rest[0] == '^') {
            if (i == 0) FAIL(f, "^ in a first register entry");
            memcpy(parents[i], keys[i - 1], KEY_BYTES);
            has_parent[i] = 1;
        } else if (key_decode(rest, parent_len, parents[i])) {
            has_parent[i] = 1;
        } else {
            FAIL(f, "register parent not base64url of 32 bytes");
        }
        const char *tokens = colon + 1;
        size_t tokens_len = rest_len - parent_len - 1;
        if (memchr(tokens, ':', tokens_len) || !tokens_valid(tokens, tokens_len)) FAIL(f, "register tokens");
        at = end + 1;
    }
    for (size_t i = 0; i < num; i++) {
        for (size_t j = 0; j < i; j++)
            if (memcmp(keys[i], keys[j], KEY_BYTES) == 0) FAIL(f, "register names a key twice");
        int32_t b = f->blocks[i];
        int32_t holder = p->owner[b];
        if (holder < 0 || (holder != owner && !shares(p, b, owner))) FAIL(f, "register of a block not held");
        if (p->registered[b] || key_block(p, keys[i]) >= 0) FAIL(f, "register of a registered block or key");
    }
    for (size_t i = 0; i < num; i++) {
        int32_t b = f->blocks[i];
        p->registered[b] = 1;
        memcpy(p->key + (size_t)b * KEY_BYTES, keys[i], KEY_BYTES);
        memcpy(p->key_text + (size_t)b * KEY_TEXT, key_texts[i], KEY_TEXT);
        p->has_parent[b] = has_parent[i];
        if (has_parent[i]) memcpy(p->parent + (size_t)b * KEY_BYTES, parents[i], KEY_BYTES);
        p->key_stamp[b] = p->stamp++;
        uint32_t h = key_bucket(p, keys[i]);
        p->chain[b] = p->bucket[h];
        p->bucket[h] = b;
    }
    return 1;
}

static int apply_share(Fold *f, size_t num, const char *s, size_t n, int32_t owner) {
    Pool *p = &f->pool;
    int32_t *counts = f->counts;
    for (size_t i = 0; i < num; i++) {
        int32_t b = f->blocks[i];
        if (!p->registered[b]) FAIL(f, "share of an unregistered block");
        int32_t holder = p->owner[b];
        if (holder < 0) {
            if (!p->cached[b]) FAIL(f, "share of a free block");
            counts[i] = 1 + p->num_sharers[b];
        } else {
            if (holder == owner || shares(p, b, owner)) FAIL(f, "share of a block held");
            counts[i] = 2 + p->num_sharers[b];
        }
    }
    if (!entries_are(f, s, n, num, counts)) FAIL(f, "share entries");
    for (size_t i = 0; i < num; i++) {
        int32_t b = f->blocks[i];
        if (p->owner[b] >= 0) {
            if (!sharers_push(p, b, owner)) FAIL(f, "out of memory");
        } else {
            lru_remove(p, b);
            p->owner[b] = owner;
            p->owner_stamp[b] = p->stamp++;
        }
    }
    return 1;
}

static int apply_release(Fold *f, size_t num, const char *s, size_t n, int32_t owner) {
    Pool *p = &f->pool;
    int32_t *counts = f->counts;
    for (size_t i = 0; i < num; i++) {
        int32_t b = f->blocks[i];
        int32_t holder = p->owner[b];
        if (holder < 0 || (holder != owner && !shares(p, b, owner)) || !p->registered[b])
            FAIL(f, "release of a block not held");
        counts[i] = p->num_sharers[b];
    }
    if (!entries_are(f, s, n, num, counts)) FAIL(f, "release entries");
    for (size_t i = 0; i < num; i++) {
        int32_t b = f->blocks[i];
        int32_t *list = p->sharers[b];
        if (p->owner[b] == owner) {
            if (p->num_sharers[b]) {
                p->owner[b] = list[0];
                memmove(list, list + 1, (size_t)(p->num_sharers[b] - 1) * sizeof(int32_t));
                p->num_sharers[b]--;
            } else {
                p->owner[b] = -1;
                lru_append(p, b);
            }
        } else {
            int32_t k = 0;
            while (list[k] != owner) k++;
            memmove(list + k, list + k + 1, (size_t)(p->num_sharers[b] - k - 1) * sizeof(int32_t));
            p->num_sharers[b]--;
        }
    }
    return 1;
}

static int apply_evict(Fold *f, size_t num, const char *s, size_t n) {
    Pool *p = &f->pool;
    for (size_t i = 0; i < num; i++) {
        int32_t b = f->blocks[i];
        if (p->owner[b] >= 0 || !p->registered[b] || !p->cached[b]) FAIL(f, "evict of a block not cached-free");
    }
    if (!entries_are(f, s, n, num, NULL)) FAIL(f, "evict entries");
    for (size_t i = 0; i < num; i++) {
        int32_t b = f->blocks[i];
        lru_remove(p, b);
        key_unlink(p, b);
        p->registered[b] = 0;
        p->free_stack[p->num_free++] = b;
    }
    return 1;
}

/* ---- the snapshot's JSON, as snapshot_codec and json.dumps(sort_keys=True) write it ---- */

static int json_int(Buffer *b, int64_t v) {
    char text[24];
    return buffer_put(b, text, decimal(v, text));
}

static int json_escaped(Buffer *b, const char *s, size_t n) {
    static const char *hex = "0123456789abcdef";
    if (!buffer_put(b, "\"", 1)) return 0;
    size_t i = 0;
    while (i < n) {
        unsigned char c = (unsigned char)s[i];
        uint32_t cp;
        if (c < 0x80) {
            cp = c;
            i++;
        } else if (c < 0xE0) {
            cp = ((uint32_t)(c & 0x1F) << 6) | (s[i + 1] & 0x3F);
            i += 2;
        } else if (c < 0xF0) {
            cp = ((uint32_t)(c & 0x0F) << 12) | ((uint32_t)(s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F);
            i += 3;
        } else {
            cp = ((uint32_t)(c & 0x07) << 18) | ((uint32_t)(s[i + 1] & 0x3F) << 12) |
                 ((uint32_t)(s[i + 2] & 0x3F) << 6) | (s[i + 3] & 0x3F);
            i += 4;
        }
        char out[12];
        size_t len = 0;
        if (cp == '"' || cp == '\\') {
            out[0] = '\\';
            out[1] = (char)cp;
            len = 2;
        } else if (cp >= 0x20 && cp < 0x7F) {
            out[0] = (char)cp;
            len = 1;
        } else if (cp == '\n' || cp == '\r' || cp == '\t' || cp == '\b' || cp == '\f') {
            out[0] = '\\';
            out[1] = cp == '\n' ? 'n' : cp == '\r' ? 'r' : cp == '\t' ? 't' : cp == '\b' ? 'b' : 'f';
            len = 2;
        } else {
            uint32_t units[2] = {cp, 0};
            int num_units = 1;
            if (cp >= 0x10000) {
                units[0] = 0xD800 | ((cp - 0x10000) >> 10);
                units[1] = 0xDC00 | ((cp - 0x10000) & 0x3FF);
                num_units = 2;
            }
            for (int u = 0; u < num_units; u++) {
                out[len++] = '\\';
                out[len++] = 'u';
                for (int shift = 12; shift >= 0; shift -= 4) out[len++] = hex[(units[u] >> shift) & 15];
            }
        }
        if (!buffer_put(b, out, len)) return 0;
    }
    return buffer_put(b, "\"", 1);
}

static int json_hex(Buffer *b, const uint8_t *key) {
    static const char *hex = "0123456789abcdef";
    char out[2 + 2 * KEY_BYTES];
    out[0] = out[1 + 2 * KEY_BYTES] = '"';
    for (int i = 0; i < KEY_BYTES; i++) {
        out[1 + 2 * i] = hex[key[i] >> 4];
        out[2 + 2 * i] = hex[key[i] & 15];
    }
    return buffer_put(b, out, sizeof out);
}

static int json_owner(Buffer *b, Owners *o, int32_t id) { return json_escaped(b, o->arena + o->start[id], o->len[id]); }

/* The pool as the tail of a SNAPSHOT record holds it (snapshot_codec.snapshot_data, canonical JSON). */
static int snapshot_json(Fold *f) {
    Pool *p = &f->pool;
    Buffer *b = &f->json;
    b->len = 0;
    int cache = p->num_cached > 0;
    for (int32_t i = 0; i < p->num_blocks && !cache; i++) cache = p->registered[i] || p->num_sharers[i];
    int first;
#define PUT(text) if (!buffer_put(b, text, sizeof(text) - 1)) return 0
#define SEP() do { if (!first) PUT(","); first = 0; } while (0)
    PUT("{");
    if (cache) {
        PUT("\"block_keys\":{");
        first = 1;
        for (int32_t i = 0; i < p->num_blocks; i++) {
            if (!p->registered[i]) continue;
            SEP();
            PUT("\"");
            if (!json_int(b, i)) return 0;
            PUT("\":[");
            if (!json_hex(b, p->key + (size_t)i * KEY_BYTES)) return 0;
            PUT(",");
            if (p->has_parent[i]) {
                if (!json_hex(b, p->parent + (size_t)i * KEY_BYTES)) return 0;
            } else {
                PUT("null");
            }
            PUT("]");
        }
        PUT("},\"cached_free\":[");
        first = 1;
        for (int32_t i = p->lru_head; i >= 0; i = p->lru_next[i]) {
            SEP();
            if (!json_int(b, i)) return 0;
        }
        PUT("],");
    }
    PUT("\"free_block_ids\":[");
    first = 1;
    for (int32_t i = 0; i < p->num_free; i++) {
        SEP();
        if (!json_int(b, p->free_stack[i])) return 0;
    }
    PUT("],\"owners\":{");
    first = 1;
    for (int32_t i = 0; i < p->num_blocks; i++) {
        if (p->owner[i] < 0) continue;
        SEP();
        PUT("\"");
        if (!json_int(b, i)) return 0;
        PUT("\":");
        if (!json_owner(b, &f->owners, p->owner[i])) return 0;
    }
    PUT("}");
    if (cache) {
        PUT(",\"sharers\":{");
        first = 1;
        for (int32_t i = 0; i < p->num_blocks; i++) {
            if (!p->num_sharers[i]) continue;
            SEP();
            PUT("\"");
            if (!json_int(b, i)) return 0;
            PUT("\":[");
            for (int32_t k = 0; k < p->num_sharers[i]; k++) {
                if (k) PUT(",");
                if (!json_owner(b, &f->owners, p->sharers[i][k])) return 0;
            }
            PUT("]");
        }
        PUT("}");
    }
    PUT("}");
#undef PUT
#undef SEP
    return 1;
}

/* ---- one record ---- */

/* A row's kind and owner columns as UTF-8 (owner NULL: SQL NULL), read while the GIL is held. */
typedef struct {
    const char *kind, *owner;
    Py_ssize_t kind_len, owner_len;
} Columns;

/* Apply one record at seq; columns: a row of its own's (NULL for a packed row's records). */
static int apply_record(Fold *f, const char *r, size_t n, int64_t seq, const Columns *columns) {
    const char *field[NUM_FIELDS];
    size_t len[NUM_FIELDS];
    size_t at = 0;
    for (int i = 0; i < NUM_FIELDS - 1; i++) {
        const char *bar = memchr(r + at, '|', n - at);
        if (!bar) FAIL(f, "record has fewer than 9 fields");
        field[i] = r + at;
        len[i] = (size_t)(bar - (r + at));
        at = len[i] + at + 1;
    }
    field[NUM_FIELDS - 1] = r + at;
    len[NUM_FIELDS - 1] = n - at;
    int64_t record_seq, batch_seq;
    if (!parse_uint(field[0], len[0], &record_seq) || record_seq != seq) FAIL(f, "record seq");
    if (!parse_uint(field[1], len[1], &batch_seq)) FAIL(f, "batch seq");
    enum Kind kind = kind_of(field[2], len[2]);
    if (kind == UNKNOWN) FAIL(f, "a kind the fast path does not fold");
    int data = kind >= INIT;
    if (columns) {
        if ((size_t)columns->kind_len != len[2] || memcmp(columns->kind, field[2], len[2]) != 0)
            FAIL(f, "kind column differs from the record");
        if (data ? columns->owner != NULL
                 : !columns->owner || (size_t)columns->owner_len != len[8] ||
                       memcmp(columns->owner, field[8], len[8]) != 0)
            FAIL(f, "owner column differs from the record");
    }
    if (seq > f->batch_end) {
        if (batch_seq < seq) FAIL(f, "torn batch");
        f->batch_end = batch_seq;
    } else if (batch_seq != f->batch_end) {
        FAIL(f, "torn batch");
    }
    if (f->closed_seq >= 0) FAIL(f, "a record after POOL_CLOSE");
    Pool *p = &f->pool;
    if (data) {
        if (kind == INIT) {
            if (seq != 1) FAIL(f, "POOL_INIT not first");
        } else if (kind == CLOSE) {
            f->closed_seq = seq;
        } else {
            if (!snapshot_json(f)) FAIL(f, "out of memory");
            if (f->json.len != len[8] || memcmp(f->json.data, field[8], len[8]) != 0)
                FAIL(f, "snapshot not written as the replayed state encodes");
        }
        return 1;
    }
    ssize_t num = parse_blocks(f, field[3], len[3]);
    if (num < 1) FAIL(f, "block ids");
    int32_t owner = owner_id(&f->owners, field[8], len[8]);
    if (owner < 0) FAIL(f, "out of memory");
    const char *reason = field[5], *entries = NULL;
    size_t reason_len = len[5], entries_len = 0;
    if (kind >= REGISTER) {
        const char *semicolon = memchr(reason, ';', reason_len);
        if (!semicolon) FAIL(f, "prefix-cache record without entries");
        entries = semicolon + 1;
        entries_len = reason_len - (size_t)(entries - reason);
        reason_len = (size_t)(semicolon - reason);
        if (!entries_len) FAIL(f, "prefix-cache record without entries");
    }
    if (!is_reason(f, reason, reason_len)) FAIL(f, "reason is not a FreeReason");
    switch (kind) {
    case ALLOCATE:
        if (num > p->num_free) FAIL(f, "allocation of more blocks than are free");
        for (ssize_t i = 0; i < num; i++)
            if (p->free_stack[p->num_free - 1 - i] != f->blocks[i]) FAIL(f, "allocation not from the free stack's top");
        p->num_free -= (int32_t)num;
        for (ssize_t i = 0; i < num; i++) {
            p->owner[f->blocks[i]] = owner;
            p->owner_stamp[f->blocks[i]] = p->stamp++;
        }
        return 1;
    case FREE:
        for (ssize_t i = 0; i < num; i++) {
            int32_t b = f->blocks[i];
            if (p->registered[b] || p->num_sharers[b]) FAIL(f, "free of a prefix-cache block");
            if (p->owner[b] != owner) FAIL(f, "free of a block the owner does not hold");
        }
        for (ssize_t i = 0; i < num; i++) {
            p->owner[f->blocks[i]] = -1;
            p->free_stack[p->num_free++] = f->blocks[i];
        }
        return 1;
    case REGISTER:
        return apply_register(f, (size_t)num, entries, entries_len, owner);
    case SHARE:
        return apply_share(f, (size_t)num, entries, entries_len, owner);
    case RELEASE:
        return apply_release(f, (size_t)num, entries, entries_len, owner);
    case EVICT:
        return apply_evict(f, (size_t)num, entries, entries_len);
    default:
        FAIL(f, "a kind the fast path does not fold");
    }
}

static void chain(uint8_t *previous, const char *record, size_t n) {
    SHA256_CTX ctx;
    SHA256_Init(&ctx);
    SHA256_Update(&ctx, previous, HASH_BYTES);
    SHA256_Update(&ctx, record, n);
    SHA256_Final(previous, &ctx);
}

/* Inflate all of in[0..n) into out: mode 15 a zlib stream, -15 raw deflate, ending with the input. */
static int inflate_all(Inflater *z, Buffer *out, const uint8_t *in, size_t n, int mode) {
    z_stream *zs = &z->zs;
    if (z->mode != mode) {
        if (z->mode) inflateEnd(zs);
        memset(zs, 0, sizeof *zs);
        z->mode = 0;
        if (inflateInit2(zs, mode) != Z_OK) return 0;
        z->mode = mode;
    } else if (inflateReset(zs) != Z_OK) {
        return 0;
    }
    out->len = 0;
    zs->next_in = (Bytef *)in;
    zs->avail_in = (uInt)n;
    for (;;) {
        if (!buffer_reserve(out, n * 4 + 4096)) return 0;
        zs->next_out = (Bytef *)out->data + out->len;
        zs->avail_out = (uInt)(out->cap - out->len);
        int status = inflate(zs, Z_NO_FLUSH);
        out->len = out->cap - zs->avail_out;
        if (status == Z_STREAM_END) return zs->avail_in == 0;
        if (status != Z_OK && status != Z_BUF_ERROR) return 0;
        if (status == Z_BUF_ERROR && zs->avail_out) return 0; /* input cut short */
    }
}

/* The text a keyed row's packed text s[0..n) names, into out: each marker and key id replaced by the
 * key's text (key_refs). NULL when done, else why not. */
static const char *expand_keys(const Fold *f, Buffer *out, const char *s, size_t n) {
    out->len = 0;
    if (!buffer_reserve(out, n + n / 2)) return "out of memory";
    size_t at = 0;
    while (at < n) {
        const char *marker = memchr(s + at, MARKER, n - at);
        size_t end = marker ? (size_t)(marker - s) : n;
        if (!buffer_put(out, s + at, end - at)) return "out of memory";
        if (!marker) break;
        at = end + 1;
        if (at < n && s[at] == MARKER) {
            if (!buffer_put(out, s + end, 1)) return "out of memory";
            at++;
            continue;
        }
        int bare = at < n && s[at] == '^';
        size_t digits = at + bare;
        size_t stop = digits;
        while (stop < n && s[stop] >= '0' && s[stop] <= '9') stop++;
        if (stop == digits) { /* no reference: the marker stays */
            if (!buffer_put(out, s + end, 1)) return "out of memory";
            continue;
        }
        int64_t key_id = 0;
        for (size_t i = digits; i < stop; i++) {
            key_id = key_id * 10 + (s[i] - '0');
            if (key_id >= f->num_keys) return "a key id no stored row holds";
        }
        char text[1 + KEY_TEXT];
        text[0] = '~';
        key_encode(f->keys + key_id * KEY_BYTES, text + 1);
        if (!buffer_put(out, bare ? text + 1 : text, bare ? KEY_TEXT : 1 + KEY_TEXT)) return "out of memory";
        at = stop;
    }
    return NULL;
}

/* One stored row of a chunk: read with the GIL, prepared (inflated, chained) by any thread, applied in order. */
typedef struct Slot {
    int64_t seq, last_seq;
    int packed;
    Py_buffer blob; /* a packed row's records, held until the chunk is done */
    int has_blob;
    const char *record; /* a row of its own's record as UTF-8 */
    Py_ssize_t record_len;
    Columns columns;
    const uint8_t *previous, *stored; /* the stored hash of the row before, and its own */
    Buffer text;                       /* a packed row's records, newline-separated */
    size_t *ends;                      /* where each record ends in text */
    size_t ends_cap;
    const char *why; /* after prepare: NULL when its records chain to its stored hash */
    atomic_int state; /* UNCLAIMED, PREPARING or PREPARED (fold_chunk) */
} Slot;

/* Inflate (and name the keys of) one row, split its records, and check that they chain from the hash of
 * the row before to its own stored hash. */
static void prepare(const Fold *f, Slot *s, Inflater *z) {
    uint8_t hash[HASH_BYTES];
    memcpy(hash, s->previous, HASH_BYTES);
    if (!s->packed) {
        chain(hash, s->record, (size_t)s->record_len);
        s->why = memcmp(hash, s->stored, HASH_BYTES) ? "hash mismatch" : NULL;
        return;
    }
    const uint8_t *blob = s->blob.buf;
    size_t blob_len = (size_t)s->blob.len;
    int keyed = blob_len && (blob[0] == 1 || blob[0] == 2);
    Buffer *inflated = keyed ? &z->inflated : &s->text;
    if (!blob_len || !inflate_all(z, inflated, blob + keyed, blob_len - keyed, keyed && blob[0] == 2 ? -15 : 15)) {
        s->why = "records do not inflate";
        return;
    }
    if (!utf8_valid((const unsigned char *)inflated->data, inflated->len)) {
        s->why = "records are not UTF-8";
        return;
    }
    if (keyed && (s->why = expand_keys(f, &s->text, inflated->data, inflated->len))) return;
    const char *text = s->text.data;
    size_t n = s->text.len;
    size_t num = (size_t)(s->last_seq - s->seq + 1);
    if (num > s->ends_cap) {
        free(s->ends);
        s->ends = malloc(num * sizeof(size_t));
        s->ends_cap = s->ends ? num : 0;
        if (!s->ends) {
            s->why = "out of memory";
            return;
        }
    }
    size_t at = 0, k = 0;
    for (;;) {
        const char *newline = memchr(text + at, '\n', n - at);
        size_t end = newline ? (size_t)(newline - text) : n;
        if (k == num) {
            s->why = "more records than seqs";
            return;
        }
        chain(hash, text + at, end - at);
        s->ends[k++] = end;
        if (!newline) break;
        at = end + 1;
    }
    if (k != num) s->why = "fewer records than seqs";
    else s->why = memcmp(hash, s->stored, HASH_BYTES) ? "hash mismatch" : NULL;
}

/* Read one stored row (seq, kind, owner, record, hash, last_seq, records) into s, with the GIL. */
static int read_row(Fold *f, Slot *s, PyObject *row) {
    s->has_blob = 0;
    if (!PyTuple_CheckExact(row) || PyTuple_GET_SIZE(row) != 7) FAIL(f, "row shape");
    PyObject *seq = PyTuple_GET_ITEM(row, 0), *last_seq = PyTuple_GET_ITEM(row, 5), *stored = PyTuple_GET_ITEM(row, 4);
    if (!PyLong_CheckExact(seq) || (last_seq != Py_None && !PyLong_CheckExact(last_seq))) FAIL(f, "seq type");
    s->seq = PyLong_AsLongLong(seq);
    s->last_seq = last_seq == Py_None ? s->seq : PyLong_AsLongLong(last_seq);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        FAIL(f, "seq out of range");
    }
    if (s->seq != f->read_seq || s->last_seq < s->seq) FAIL(f, "seqs not in line");
    if (!PyBytes_CheckExact(stored) || PyBytes_GET_SIZE(stored) != HASH_BYTES) FAIL(f, "stored hash not 32 bytes");
    s->stored = (const uint8_t *)PyBytes_AS_STRING(stored);
    s->previous = f->read_previous;
    f->read_previous = s->stored;
    f->read_seq = s->last_seq + 1;
    s->packed = last_seq != Py_None;
    s->why = "not prepared";
    atomic_store(&s->state, 0); /* UNCLAIMED */
    if (s->packed) {
        PyObject *blob = PyTuple_GET_ITEM(row, 6);
        if ((!PyBytes_CheckExact(blob) && !PyMemoryView_Check(blob)) ||
            PyObject_GetBuffer(blob, &s->blob, PyBUF_SIMPLE) < 0) {
            PyErr_Clear();
            FAIL(f, "records not bytes");
        }
        s->has_blob = 1;
        return 1;
    }
    PyObject *record = PyTuple_GET_ITEM(row, 3), *kind = PyTuple_GET_ITEM(row, 1), *owner = PyTuple_GET_ITEM(row, 2);
    s->record = PyUnicode_CheckExact(record) ? PyUnicode_AsUTF8AndSize(record, &s->record_len) : NULL;
    s->columns.kind = PyUnicode_CheckExact(kind) ? PyUnicode_AsUTF8AndSize(kind, &s->columns.kind_len) : NULL;
    s->columns.owner = PyUnicode_CheckExact(owner) ? PyUnicode_AsUTF8AndSize(owner, &s->columns.owner_len) : NULL;
    if (!s->record || !s->columns.kind || (owner != Py_None && !s->columns.owner)) {
        PyErr_Clear();
        FAIL(f, "record or columns not text");
    }
    return 1;
}

/* Apply a prepared row's records in seq order. */
static int apply_row(Fold *f, Slot *s) {
    if (s->why) FAIL(f, s->why);
    if (!s->packed) {
        if (!apply_record(f, s->record, (size_t)s->record_len, s->seq, &s->columns)) return 0;
    } else {
        size_t start = 0;
        for (int64_t seq = s->seq; seq <= s->last_seq; seq++) {
            size_t end = s->ends[seq - s->seq];
            if (!apply_record(f, s->text.data + start, end - start, seq, NULL)) return 0;
            start = end + 1;
        }
    }
    f->expected_seq = s->last_seq + 1;
    f->num_events += s->last_seq - s->seq + 1;
    return 1;
}

/* The rows of one chunk, prepared by this thread and the helpers together, applied by this one.
 *
 * This thread claims rows from the front, in the order it applies them, the helpers from the back: it
 * waits on a helper only for the row where they meet, so a helper the machine does not run (a busy
 * machine) delays at most one row a chunk. A row is claimed by moving its state from UNCLAIMED. */
enum { UNCLAIMED, PREPARING, PREPARED };

typedef struct {
    const Fold *f;
    Slot *slots;
    atomic_long back; /* the helpers' next row is back - 1 */
    atomic_int stop;  /* a row failed: prepare no more */
} Work;

typedef struct {
    Work *work;
    Inflater *inflater;
} Helper;

static int claim(Slot *s) {
    int unclaimed = UNCLAIMED;
    return atomic_compare_exchange_strong(&s->state, &unclaimed, PREPARING);
}

static void *help(void *arg) {
    Helper *h = arg;
    Work *w = h->work;
    while (!atomic_load(&w->stop)) {
        long i = atomic_fetch_sub(&w->back, 1) - 1;
        if (i < 0 || !claim(&w->slots[i])) return NULL; /* the rows before it are the caller's */
        prepare(w->f, &w->slots[i], h->inflater);
        atomic_store(&w->slots[i].state, PREPARED);
    }
    return NULL;
}

static void fold_chunk(Fold *f, size_t num_rows) {
    Work w = {.f = f, .slots = f->slots};
    atomic_init(&w.back, (long)num_rows);
    atomic_init(&w.stop, 0);
    pthread_t threads[MAX_HELPERS];
    Helper helpers[MAX_HELPERS];
    int num_started = 0;
    int wanted = num_rows > 1 ? f->num_helpers : 0;
    for (int k = 0; k < wanted; k++) {
        helpers[k] = (Helper){&w, &f->inflaters[k + 1]};
        if (pthread_create(&threads[k], NULL, help, &helpers[k]) != 0) break;
        num_started++;
    }
    for (size_t i = 0; i < num_rows && !f->why; i++) {
        Slot *s = &f->slots[i];
        if (claim(s)) {
            prepare(f, s, &f->inflaters[0]);
            atomic_store(&s->state, PREPARED);
        }
        for (unsigned spins = 0; atomic_load(&s->state) != PREPARED; spins++) { /* a helper prepares it */
            if (spins < 64) {
                sched_yield();
            } else {
                struct timespec pause = {0, 20000};
                nanosleep(&pause, NULL);
            }
        }
        apply_row(f, s);
    }
    atomic_store(&w.stop, 1);
    for (int k = 0; k < num_started; k++) pthread_join(threads[k], NULL);
}

/* ---- handing the state out: Python's containers, in the order its replay fills them ---- */

typedef struct {
    int64_t stamp;
    int32_t block;
} Stamped;

static int by_stamp(const void *a, const void *b) {
    int64_t x = ((const Stamped *)a)->stamp, y = ((const Stamped *)b)->stamp;
    return (x > y) - (x < y);
}

static PyObject *hex_text(const uint8_t *key) {
    static const char *hex = "0123456789abcdef";
    char out[2 * KEY_BYTES];
    for (int i = 0; i < KEY_BYTES; i++) {
        out[2 * i] = hex[key[i] >> 4];
        out[2 * i + 1] = hex[key[i] & 15];
    }
    return PyUnicode_FromStringAndSize(out, sizeof out);
}

/* Blocks with a stamp in stamps (selected), in stamp order, into order; their number. */
static int32_t ordered(const Pool *p, const int64_t *stamps, const uint8_t *selected_u8, const int32_t *selected_i32,
                       int select_owner, Stamped *order) {
    int32_t count = 0;
    for (int32_t b = 0; b < p->num_blocks; b++) {
        int in = select_owner ? p->owner[b] >= 0 : selected_u8 ? selected_u8[b] != 0 : selected_i32[b] != 0;
        if (in) order[count++] = (Stamped){stamps[b], b};
    }
    qsort(order, (size_t)count, sizeof *order, by_stamp);
    return count;
}

#define CHECK(x) if (!(x)) goto error

static PyObject *state_of(Fold *f) {
    Pool *p = &f->pool;
    Owners *o = &f->owners;
    PyObject *free_ids = NULL, *owners = NULL, *sharers = NULL, *cached = NULL, *block_keys = NULL, *key_blocks = NULL;
    Stamped *order = malloc(((size_t)p->num_blocks + 1) * sizeof *order);
    CHECK(order);
    CHECK(free_ids = PyList_New(p->num_free));
    for (int32_t i = 0; i < p->num_free; i++) {
        PyObject *v = PyLong_FromLong(p->free_stack[i]);
        CHECK(v);
        PyList_SET_ITEM(free_ids, i, v);
    }
    CHECK(owners = PyDict_New());
    int32_t count = ordered(p, p->owner_stamp, NULL, NULL, 1, order);
    for (int32_t i = 0; i < count; i++) {
        int32_t b = order[i].block;
        PyObject *k = PyLong_FromLong(b), *v = owner_text(o, p->owner[b]);
        int bad = !k || !v || PyDict_SetItem(owners, k, v) < 0;
        Py_XDECREF(k);
        Py_XDECREF(v);
        CHECK(!bad);
    }
    CHECK(sharers = PyDict_New());
    count = ordered(p, p->sharers_stamp, NULL, p->num_sharers, 0, order);
    for (int32_t i = 0; i < count; i++) {
        int32_t b = order[i].block;
        PyObject *list = PyList_New(p->num_sharers[b]);
        CHECK(list);
        for (int32_t k = 0; k < p->num_sharers[b]; k++) {
            PyObject *v = owner_text(o, p->sharers[b][k]);
            if (!v) {
                Py_DECREF(list);
                goto error;
            }
            PyList_SET_ITEM(list, k, v);
        }
        PyObject *k = PyLong_FromLong(b);
        int bad = !k || PyDict_SetItem(sharers, k, list) < 0;
        Py_XDECREF(k);
        Py_DECREF(list);
        CHECK(!bad);
    }
    CHECK(cached = PyList_New(0));
    for (int32_t b = p->lru_head; b >= 0; b = p->lru_next[b]) {
        PyObject *v = PyLong_FromLong(b);
        int bad = !v || PyList_Append(cached, v) < 0;
        Py_XDECREF(v);
        CHECK(!bad);
    }
    CHECK(block_keys = PyDict_New());
    CHECK(key_blocks = PyDict_New());
    count = ordered(p, p->key_stamp, p->registered, NULL, 0, order);
    for (int32_t i = 0; i < count; i++) {
        int32_t b = order[i].block;
        PyObject *k = PyLong_FromLong(b), *key = hex_text(p->key + (size_t)b * KEY_BYTES);
        PyObject *parent = p->has_parent[b] ? hex_text(p->parent + (size_t)b * KEY_BYTES) : Py_NewRef(Py_None);
        PyObject *entry = k && key && parent ? PyTuple_Pack(2, key, parent) : NULL;
        int bad = !entry || PyDict_SetItem(block_keys, k, entry) < 0 || PyDict_SetItem(key_blocks, key, k) < 0;
        Py_XDECREF(k);
        Py_XDECREF(key);
        Py_XDECREF(parent);
        Py_XDECREF(entry);
        CHECK(!bad);
    }
    free(order);
    uint8_t *h = f->previous;
    return Py_BuildValue("(NNNNNNLLy#NLO)", free_ids, owners, sharers, cached, block_keys, key_blocks,
                         (long long)f->expected_seq, (long long)f->batch_end, (const char *)h, (Py_ssize_t)HASH_BYTES,
                         f->closed_seq >= 0 ? PyLong_FromLongLong(f->closed_seq) : Py_NewRef(Py_None),
                         (long long)f->num_events, f->saw_draft ? Py_True : Py_False);
error:
    free(order);
    Py_XDECREF(free_ids);
    Py_XDECREF(owners);
    Py_XDECREF(sharers);
    Py_XDECREF(cached);
    Py_XDECREF(block_keys);
    Py_XDECREF(key_blocks);
    return NULL;
}

static void fold_free(Fold *f) {
    pool_free(&f->pool);
    Owners *o = &f->owners;
    for (int32_t i = 0; i < o->count; i++) Py_XDECREF(o->text[i]);
    free(o->arena); free(o->start); free(o->len); free(o->text); free(o->slots);
    free(f->json.data); free(f->blocks);
    free(f->counts); free(f->keys_of); free(f->parents_of); free(f->key_texts_of); free(f->has_parent_of);
    for (size_t i = 0; i < f->slots_cap; i++) {
        free(f->slots[i].text.data);
        free(f->slots[i].ends);
    }
    free(f->slots);
    for (int k = 0; k <= MAX_HELPERS; k++) {
        if (f->inflaters[k].mode) inflateEnd(&f->inflaters[k].zs);
        free(f->inflaters[k].inflated.data);
    }
}

static PyObject *fold_epoch(PyObject *self, PyObject *args) {
    (void)self;
    int num_blocks, num_helpers;
    Py_buffer genesis, keys;
    PyObject *chunks;
    if (!PyArg_ParseTuple(args, "iy*y*Oi", &num_blocks, &genesis, &keys, &chunks, &num_helpers)) return NULL;
    Fold f;
    memset(&f, 0, sizeof f);
    PyObject *result = NULL, *iterator = NULL;
    if (num_blocks < 0 || genesis.len != HASH_BYTES || keys.len % KEY_BYTES) {
        f.why = "pool or keys out of shape";
        goto done;
    }
    if (!pool_init(&f.pool, num_blocks)) {
        PyErr_NoMemory();
        goto done;
    }
    f.num_helpers = num_helpers < 0 ? 0 : num_helpers > MAX_HELPERS ? MAX_HELPERS : num_helpers;
    memcpy(f.genesis, genesis.buf, HASH_BYTES);
    f.read_previous = f.genesis;
    f.keys = keys.buf;
    f.num_keys = keys.len / KEY_BYTES;
    f.expected_seq = f.read_seq = 1;
    f.batch_end = 0;
    f.closed_seq = -1;
    iterator = PyObject_GetIter(chunks);
    if (!iterator) goto done;
    PyObject *chunk;
    uint8_t last_stored[HASH_BYTES];
    while (!f.why && (chunk = PyIter_Next(iterator))) {
        PyObject *rows = PySequence_Fast(chunk, "a chunk of rows is a sequence");
        Py_DECREF(chunk);
        if (!rows) goto done;
        size_t num_rows = (size_t)PySequence_Fast_GET_SIZE(rows);
        PyObject **items = PySequence_Fast_ITEMS(rows);
        if (num_rows > f.slots_cap) {
            Slot *slots = realloc(f.slots, num_rows * sizeof(Slot));
            if (!slots) {
                Py_DECREF(rows);
                PyErr_NoMemory();
                goto done;
            }
            memset(slots + f.slots_cap, 0, (num_rows - f.slots_cap) * sizeof(Slot));
            f.slots = slots;
            f.slots_cap = num_rows;
        }
        size_t num_read = 0;
        while (num_read < num_rows && read_row(&f, &f.slots[num_read], items[num_read])) num_read++;
        if (!f.why && num_read) {
            Py_BEGIN_ALLOW_THREADS
            fold_chunk(&f, num_read);
            Py_END_ALLOW_THREADS
            memcpy(last_stored, f.slots[num_read - 1].stored, HASH_BYTES);
            f.read_previous = last_stored; /* the next chunk chains from this one's last stored hash */
        }
        for (size_t i = 0; i < num_rows; i++)
            if (i < f.slots_cap && f.slots[i].has_blob) {
                PyBuffer_Release(&f.slots[i].blob);
                f.slots[i].has_blob = 0;
            }
        Py_DECREF(rows);
    }
    if (PyErr_Occurred()) goto done;
    if (f.why) {
        result = Py_BuildValue("(Os)", Py_False, f.why);
    } else {
        memcpy(f.previous, f.read_previous, HASH_BYTES);
        PyObject *state = state_of(&f);
        if (state) result = Py_BuildValue("(OsN)", Py_True, "", state);
    }
done:
    if (!result && !PyErr_Occurred()) result = Py_BuildValue("(Os)", Py_False, f.why ? f.why : "not folded");
    Py_XDECREF(iterator);
    fold_free(&f);
    PyBuffer_Release(&genesis);
    PyBuffer_Release(&keys);
    return result;
}

static PyMethodDef methods[] = {
    {"fold_epoch", fold_epoch, METH_VARARGS,
     "fold_epoch(num_blocks, genesis_hash, keys, chunks, num_helpers) -> (True, '', state) or (False, why)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "nanoserve_intact_fold", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_nanoserve_intact_fold(void) {
    b64_table();
    return PyModule_Create(&module);
}

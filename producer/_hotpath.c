/* The producer's side of a rank's ring, compiled: one call per record, each part copied once.
 *
 * The layout is ring.py's (header words, length-prefixed 8-byte aligned records, pad records
 * at the wrap) and the frame format frames.py's (header words, then the parts, each 8-byte
 * aligned); the consumer side stays in Python, and the tests write here and read there.
 * Written in C because each Python-level step of a frame (a struct pack, a memoryview slice,
 * a numpy call) costs 1-7 us on the engine thread; the whole frame costs that here.
 *
 * Runs with the interpreter lock held: a record is reserved, filled and published in one call,
 * so no other thread of the engine interleaves a record of its own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define HEADER_BYTES 128
#define W_CAPACITY 1
#define W_HEAD 2
#define W_TAIL 3
#define W_PUBLISHED 4
#define W_DROPPED 5
#define LENGTH_BYTES 8
#define PAD_BIT (1ULL << 63)
#define FRAME_WORDS 3 /* kind | parts << 8, seq, emitted_at_us */
#define MAX_PARTS 256

enum part_type { PART_U8 = 1, PART_I32 = 2, PART_I64 = 3 };

static inline uint64_t align8(uint64_t n) { return (n + 7) & ~(uint64_t)7; }

typedef struct {
    Py_buffer view;
    uint64_t *words;    /* the ring's header words */
    uint8_t *data;      /* its data bytes */
    uint64_t capacity;
    uint64_t pos;       /* the reserved record's length word, as an offset into data */
    uint64_t total;     /* bytes the record takes, a pad before it included */
    uint64_t size;      /* its payload's bytes */
} ring_t;

/* Map `obj` (the ring's mmap) for writing; -1 with an exception set. */
static int ring_open(ring_t *r, PyObject *obj) {
    if (PyObject_GetBuffer(obj, &r->view, PyBUF_WRITABLE) < 0)
        return -1;
    if (r->view.len < HEADER_BYTES) {
        PyBuffer_Release(&r->view);
        PyErr_SetString(PyExc_ValueError, "shorter than a ring's header");
        return -1;
    }
    r->words = (uint64_t *)r->view.buf;
    r->data = (uint8_t *)r->view.buf + HEADER_BYTES;
    r->capacity = r->words[W_CAPACITY];
    if (r->capacity == 0 || r->capacity % 8 || (uint64_t)r->view.len != HEADER_BYTES + r->capacity) {
        PyBuffer_Release(&r->view);
        PyErr_SetString(PyExc_ValueError, "not a ring: its capacity does not match its mapping");
        return -1;
    }
    return 0;
}

/* Room for `size` payload bytes at the head, or NULL when the ring is full (counted as dropped). */
static uint8_t *ring_reserve(ring_t *r, uint64_t size) {
    uint64_t head = r->words[W_HEAD]; /* written by this side only */
    uint64_t tail = __atomic_load_n(&r->words[W_TAIL], __ATOMIC_ACQUIRE);
    uint64_t need = align8(LENGTH_BYTES + size);
    uint64_t pos = head % r->capacity;
    uint64_t to_end = r->capacity - pos;
    uint64_t skip = to_end < need ? to_end : 0;
    if (head + skip + need - tail > r->capacity) {
        __atomic_store_n(&r->words[W_DROPPED], r->words[W_DROPPED] + 1, __ATOMIC_RELEASE);
        return NULL;
    }
    if (skip) { /* a record never wraps: a pad record sends the reader to the start */
        *(uint64_t *)(r->data + pos) = PAD_BIT | to_end;
        pos = 0;
    }
    r->pos = pos;
    r->total = skip + need;
    r->size = size;
    return r->data + pos + LENGTH_BYTES;
}

/* Make the reserved record visible: its bytes before the head that covers them. */
static void ring_publish(ring_t *r) {
    *(uint64_t *)(r->data + r->pos) = r->size;
    __atomic_store_n(&r->words[W_HEAD], r->words[W_HEAD] + r->total, __ATOMIC_RELEASE);
    __atomic_store_n(&r->words[W_PUBLISHED], r->words[W_PUBLISHED] + 1, __ATOMIC_RELEASE);
}

/* A part's type from its buffer format (numpy's or bytes'); 0 when frames carry no such part. */
static int part_type(const Py_buffer *v) {
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    if (f[0] == '\0' || f[1] != '\0')
        return 0;
    switch (f[0]) {
    case 'B':
        return v->itemsize == 1 ? PART_U8 : 0;
    case 'i':
    case 'l':
    case 'q':
        return v->itemsize == 4 ? PART_I32 : v->itemsize == 8 ? PART_I64 : 0;
    default:
        return 0;
    }
}

/* One part of a frame: a whole buffer, or a prefix of one (the first `rows` rows and `cols`
 * columns of a 2-D array of any row stride; a 1-D prefix is one row), copied without a slice. */
typedef struct {
    Py_buffer view;
    uint64_t type;
    Py_ssize_t rows, cols;   /* items copied: rows x cols */
    Py_ssize_t row_stride;   /* bytes between rows in the source */
    PyObject *owner;         /* what `converter` made of the part, or NULL */
    Py_ssize_t sub_at, sub_n; /* a part of parts (write_frame): its parts, packed in place; sub_n -1 for none */
} part_t;

/* What makes a part this module refuses (another integer width, a strided view, a host tensor)
 * one it takes: set once by the caller (frames.as_array), called only for such a part. */
static PyObject *converter = NULL;

static int refused(void) {
    return converter != NULL && (PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_BufferError));
}

static Py_ssize_t count_arg(PyObject *spec, Py_ssize_t i) {
    Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(spec, i));
    if (n < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "a part's prefix cannot be negative");
    return n;
}

/* Make `p` (its view open) the first `p->cols` items of a 1-D contiguous array; -1 if it is not. */
static int prefix_check(part_t *p) {
    if (p->view.ndim != 1 || p->view.strides[0] != p->view.itemsize) {
        PyErr_SetString(PyExc_BufferError, "a 1-D prefix of an array that is not 1-D and contiguous");
        return -1;
    }
    if (p->cols > p->view.shape[0]) {
        PyErr_Format(PyExc_ValueError, "a prefix of %zd items of an array of %zd", p->cols, p->view.shape[0]);
        return -1;
    }
    p->rows = 1;
    p->row_stride = p->cols * p->view.itemsize;
    return 0;
}

static Py_ssize_t widest(PyObject *lens, Py_ssize_t rows);

/* Parse `spec`: a buffer (whole: contiguous, or 2-D with contiguous rows), (array, n) (its first n items) or (array, rows,
 * cols) (a 2-D array's top-left block; cols a count, or an array of row lengths: the longest of its
 * first `rows`). -1 with an exception set (the view released). */
static int part_open_as_is(part_t *p, PyObject *spec) {
    Py_ssize_t arity = PyTuple_Check(spec) ? PyTuple_GET_SIZE(spec) : 0;
    if (arity != 0 && arity != 2 && arity != 3) {
        PyErr_SetString(PyExc_TypeError, "a part is a buffer, (array, n) or (array, rows, cols)");
        return -1;
    }
    if (PyObject_GetBuffer(arity == 0 ? spec : PyTuple_GET_ITEM(spec, 0), &p->view, PyBUF_STRIDES | PyBUF_FORMAT) < 0)
        return -1;
    p->type = (uint64_t)part_type(&p->view);
    if (p->type == 0) {
        PyErr_Format(PyExc_TypeError, "format %s is not a frame part's", p->view.format ? p->view.format : "B");
        goto fail;
    }
    Py_ssize_t item = p->view.itemsize;
    if (arity == 0 && PyBuffer_IsContiguous(&p->view, 'C')) {
        p->rows = 1;
        p->cols = p->view.len / item;
        p->row_stride = p->view.len;
        return 0;
    }
    if (arity == 0) { /* a 2-D view with contiguous rows (a column slice) is copied row by row */
        if (p->view.ndim != 2 || p->view.strides[1] != item || p->view.strides[0] < 0) {
            PyErr_SetString(PyExc_BufferError, "a part laid out neither contiguously nor in contiguous rows");
            goto fail;
        }
        p->rows = p->view.shape[0];
        p->cols = p->view.shape[1];
        p->row_stride = p->view.strides[0];
        return 0;
    }
    if (arity == 2) { /* a 1-D prefix */
        if ((p->cols = count_arg(spec, 1)) < 0 || prefix_check(p) < 0)
            goto fail;
        return 0;
    }
    if ((p->rows = count_arg(spec, 1)) < 0)
        goto fail;
    PyObject *cols = PyTuple_GET_ITEM(spec, 2); /* a count, or the rows' lengths: as wide as the longest */
    if ((p->cols = PyLong_Check(cols) ? count_arg(spec, 2) : widest(cols, p->rows)) < 0)
        goto fail;
    if (p->view.ndim != 2 || p->view.strides[1] != item || p->view.strides[0] < 0) {
        PyErr_SetString(PyExc_BufferError, "a block of an array that is not 2-D with contiguous rows");
        goto fail;
    }
    if (p->rows > p->view.shape[0] || p->cols > p->view.shape[1]) {
        PyErr_Format(PyExc_ValueError, "a %zd x %zd block of a %zd x %zd array", p->rows, p->cols,
                     p->view.shape[0], p->view.shape[1]);
        goto fail;
    }
    p->row_stride = p->view.strides[0];
    return 0;
fail:
    PyBuffer_Release(&p->view);
    return -1;
}

/* `part_open_as_is`, or of what `converter` makes of a part refused so. */
static int part_open(part_t *p, PyObject *spec) {
    p->owner = NULL;
    p->sub_n = -1;
    if (part_open_as_is(p, spec) == 0)
        return 0;
    if (!refused())
        return -1;
    PyErr_Clear();
    PyObject *converted = PyObject_CallOneArg(converter, spec);
    if (converted == NULL)
        return -1;
    if (part_open_as_is(p, converted) < 0) {
        Py_DECREF(converted);
        return -1;
    }
    p->owner = converted;
    return 0;
}

static inline uint64_t part_items(const part_t *p) { return (uint64_t)(p->rows * p->cols); }
static inline uint64_t part_bytes(const part_t *p) { return part_items(p) * (uint64_t)p->view.itemsize; }

static void parts_release(part_t *parts, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyBuffer_Release(&parts[i].view);
        Py_XDECREF(parts[i].owner);
    }
}

/* Open every spec of `seq` (a sequence); the number opened, or -1 with all released. With `sub`
 * (write_frame), a list among them is a part of parts: its parts opened into `sub` from `*used` on,
 * packed in place when the frame is filled (no bytes object of its own). */
static Py_ssize_t parts_open(part_t *parts, PyObject *seq, uint64_t *bytes, part_t *sub, Py_ssize_t *used) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAX_PARTS) {
        PyErr_Format(PyExc_ValueError, "a frame holds at most %d parts, not %zd", MAX_PARTS, n);
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    *bytes = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        part_t *p = &parts[i];
        if (sub == NULL || !PyList_CheckExact(items[i])) {
            if (part_open(p, items[i]) < 0)
                goto fail;
        } else {
            uint64_t inner;
            Py_ssize_t k = PyList_GET_SIZE(items[i]);
            if (k > MAX_PARTS - *used) {
                PyErr_Format(PyExc_ValueError, "a frame's parts of parts hold at most %d parts", MAX_PARTS);
                goto fail;
            }
            if ((k = parts_open(sub + *used, items[i], &inner, NULL, NULL)) < 0)
                goto fail;
            memset(&p->view, 0, sizeof p->view); /* nothing of its own to release */
            p->view.itemsize = 1;
            p->owner = NULL;
            p->type = PART_U8;
            p->rows = 1;
            p->cols = (Py_ssize_t)(8 * (1 + (uint64_t)k) + inner);
            p->sub_at = *used;
            p->sub_n = k;
            *used += k;
        }
        *bytes += align8(part_bytes(p));
        continue;
    fail:
        parts_release(parts, i);
        if (sub != NULL) {
            parts_release(sub, *used);
            *used = 0;
        }
        return -1;
    }
    return n;
}

/* The parts' type words, then each part 8-byte aligned (the padding left as it was); a part of
 * parts as `pack_parts` lays them out, of `sub`. */
static void parts_fill(uint64_t *words, const part_t *parts, Py_ssize_t n, const part_t *sub) {
    uint8_t *at = (uint8_t *)(words + n);
    for (Py_ssize_t i = 0; i < n; i++) {
        const part_t *p = &parts[i];
        words[i] = p->type | part_items(p) << 8;
        if (p->sub_n >= 0) {
            *(uint64_t *)at = (uint64_t)p->sub_n;
            parts_fill((uint64_t *)at + 1, sub + p->sub_at, p->sub_n, NULL);
            at += align8(part_bytes(p));
            continue;
        }
        size_t row = (size_t)(p->cols * p->view.itemsize);
        const uint8_t *src = p->view.buf;
        for (Py_ssize_t r = 0; r < p->rows; r++, src += p->row_stride)
            memcpy(at + r * row, src, row);
        at += align8(part_bytes(p));
    }
}

PyDoc_STRVAR(write_frame_doc,
             "write_frame(mapping, kind, seq, emitted_at_us, parts) -> bool\n\n"
             "Copy `parts` into the ring as one frame; False when the ring has no room (counted as\n"
             "dropped). A part is bytes or a uint8/int32/int64 array: whole (contiguous, or 2-D with\n"
             "contiguous rows), (array, n) for\n"
             "its first n items, or (array, rows, cols) for a 2-D array's top-left block (cols a\n"
             "count, or a 1-D array of row lengths: as wide as the longest of its first rows). A part of\n"
             "another type or layout goes through the converter (set_converter), else TypeError or\n"
             "BufferError. A list among the parts is one part of those parts, packed in place as\n"
             "pack_parts packs them.");

static PyObject *write_frame(PyObject *self, PyObject *args) {
    PyObject *mapping, *specs;
    unsigned long long kind, seq, at_us;
    if (!PyArg_ParseTuple(args, "OKKKO", &mapping, &kind, &seq, &at_us, &specs))
        return NULL;
    PyObject *seq_parts = PySequence_Fast(specs, "parts must be a sequence");
    if (seq_parts == NULL)
        return NULL;
    part_t parts[MAX_PARTS], sub[MAX_PARTS];
    uint64_t bytes;
    Py_ssize_t used = 0, n = parts_open(parts, seq_parts, &bytes, sub, &used);
    Py_DECREF(seq_parts);
    if (n < 0)
        return NULL;
    ring_t ring;
    if (ring_open(&ring, mapping) < 0) {
        parts_release(parts, n);
        parts_release(sub, used);
        return NULL;
    }
    uint8_t *room = ring_reserve(&ring, 8 * (FRAME_WORDS + (uint64_t)n) + bytes);
    if (room != NULL) {
        uint64_t *words = (uint64_t *)room;
        words[0] = kind | (uint64_t)n << 8;
        words[1] = seq;
        words[2] = at_us;
        parts_fill(words + FRAME_WORDS, parts, n, sub);
        ring_publish(&ring);
    }
    PyBuffer_Release(&ring.view);
    parts_release(parts, n);
    parts_release(sub, used);
    return PyBool_FromLong(room != NULL);
}

PyDoc_STRVAR(pack_parts_doc,
             "pack_parts(parts) -> bytes\n\n"
             "`parts` (as write_frame takes them) as one buffer in a frame's own layout: their count,\n"
             "their type words, each part 8-byte aligned. A frame carries it as one part.");

static PyObject *pack_parts(PyObject *self, PyObject *specs) {
    PyObject *seq_parts = PySequence_Fast(specs, "parts must be a sequence");
    if (seq_parts == NULL)
        return NULL;
    part_t parts[MAX_PARTS];
    uint64_t bytes;
    Py_ssize_t n = parts_open(parts, seq_parts, &bytes, NULL, NULL);
    Py_DECREF(seq_parts);
    if (n < 0)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(8 * (1 + (uint64_t)n) + bytes));
    if (out != NULL) {
        uint64_t *words = (uint64_t *)PyBytes_AS_STRING(out); /* bytes objects are 8-aligned */
        memset(words, 0, (size_t)PyBytes_GET_SIZE(out));
        words[0] = (uint64_t)n;
        parts_fill(words + 1, parts, n, NULL);
    }
    parts_release(parts, n);
    return out;
}

/* The largest of a 1-D part's items, 0 for none. */
static long long part_max(const part_t *p) {
    long long best = 0;
    Py_ssize_t n = p->cols;
    if (p->type == PART_I32) {
        const int32_t *v = p->view.buf;
        for (Py_ssize_t i = 0; i < n; i++)
            best = v[i] > best ? v[i] : best;
    } else if (p->type == PART_I64) {
        const int64_t *v = p->view.buf;
        for (Py_ssize_t i = 0; i < n; i++)
            best = v[i] > best ? v[i] : best;
    } else {
        const uint8_t *v = p->view.buf;
        for (Py_ssize_t i = 0; i < n; i++)
            best = v[i] > best ? v[i] : best;
    }
    return best;
}

/* The largest of `lens[:rows]` (a 1-D integer array; another width converted), or -1 with an
 * exception set: the width of a block table's rows that hold anything. */
static Py_ssize_t widest(PyObject *lens, Py_ssize_t rows) {
    PyObject *spec = Py_BuildValue("(On)", lens, rows);
    if (spec == NULL)
        return -1;
    part_t p;
    int opened = part_open(&p, spec);
    Py_DECREF(spec);
    if (opened < 0)
        return -1;
    long long best = part_max(&p);
    parts_release(&p, 1);
    return (Py_ssize_t)best;
}

PyDoc_STRVAR(prefix_max_doc,
             "prefix_max(array, n) -> int\n\n"
             "The largest of a 1-D integer array's first n items (0 when n is 0): the widest row of a\n"
             "block table, without a numpy reduction's fixed cost (a block part given its rows' lengths\n"
             "finds it so too).");

static PyObject *prefix_max(PyObject *self, PyObject *args) {
    PyObject *array;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "On", &array, &n))
        return NULL;
    if (n < 0)
        return PyErr_Format(PyExc_ValueError, "a prefix cannot be negative");
    Py_ssize_t best = widest(array, n);
    return best < 0 ? NULL : PyLong_FromSsize_t(best);
}

PyDoc_STRVAR(write_record_doc,
             "write_record(mapping, payload) -> bool\n\n"
             "Copy one record (any contiguous bytes-like object) into the ring and publish it;\n"
             "False when the ring has no room (counted as dropped).");

static PyObject *write_record(PyObject *self, PyObject *args) {
    PyObject *mapping;
    Py_buffer payload;
    if (!PyArg_ParseTuple(args, "Oy*", &mapping, &payload))
        return NULL;
    ring_t ring;
    if (ring_open(&ring, mapping) < 0) {
        PyBuffer_Release(&payload);
        return NULL;
    }
    uint8_t *room = ring_reserve(&ring, (uint64_t)payload.len);
    if (room != NULL) {
        memcpy(room, payload.buf, (size_t)payload.len);
        ring_publish(&ring);
    }
    PyBuffer_Release(&ring.view);
    PyBuffer_Release(&payload);
    return PyBool_FromLong(room != NULL);
}

PyDoc_STRVAR(set_converter_doc,
             "set_converter(fn)\n\n"
             "What write_frame, pack_parts and prefix_max call with a part they refuse (another type,\n"
             "another layout), to take what it returns instead; once, by the module that owns the rule.");

static PyObject *set_converter(PyObject *self, PyObject *fn) {
    if (!PyCallable_Check(fn))
        return PyErr_Format(PyExc_TypeError, "a converter is callable");
    Py_INCREF(fn);
    Py_XSETREF(converter, fn);
    Py_RETURN_NONE;
}


/* -- a step's scheduler fields -------------------------------------------------------------------- */

/* Attribute names, interned once at import. */
static PyObject *s_cached, *s_new, *s_counts, *s_copies, *s_req_ids, *s_resumed, *s_new_blocks, *s_computed,
    *s_finished, *s_preempted, *s_zero, *s_req_id, *s_block_ids, *s_prompt, *s_src, *s_dst, *s_lora, *s_lora_name,
    *s_mm, *s_embeds, *s_mm_position, *s_identifier, *s_offset, *s_length;

/* An optional field: its value, or () where it is None or empty; where `obj` (a vLLM `owner`)
 * has no such attribute, () and "owner.name" added to the set `missing`, or, without a set, the
 * AttributeError (a field this vLLM lacks, or renamed, never reads as empty unannounced).
 * A new reference, NULL with an exception set. */
static PyObject *attr_or_missing(PyObject *obj, PyObject *name, const char *owner, PyObject *missing) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) {
        if (missing == NULL || !PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        PyErr_Clear();
        PyObject *field = PyUnicode_FromFormat("%s.%U", owner, name);
        int added = field == NULL ? -1 : PySet_Add(missing, field);
        Py_XDECREF(field);
        return added < 0 ? NULL : PyTuple_New(0);
    }
    int truth = PyObject_IsTrue(v);
    if (truth <= 0) {
        Py_DECREF(v);
        return truth < 0 ? NULL : PyTuple_New(0);
    }
    return v;
}

/* A list of `fn(item, ctx)` per item of the sequence `items`; NULL with an exception set. */
static PyObject *list_of(PyObject *items, const char *what, PyObject *(*fn)(PyObject *, PyObject *), PyObject *ctx) {
    PyObject *seq = PySequence_Fast(items, what);
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *item = fn(PySequence_Fast_GET_ITEM(seq, i), ctx);
        if (item == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, item);
    }
    Py_DECREF(seq);
    return out;
}

/* `obj.name`, or None where it has no such attribute (an older vLLM). A new reference, NULL with
 * an exception set. */
static PyObject *attr_or_none(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        v = Py_NewRef(Py_None);
    }
    return v;
}

/* A multimodal item as (identifier, first position, length). */
static PyObject *mm_item(PyObject *f, PyObject *unused) {
    PyObject *pos = PyObject_GetAttr(f, s_mm_position);
    if (pos == NULL)
        return NULL;
    PyObject *out = Py_BuildValue("(NNN)", PyObject_GetAttr(f, s_identifier), PyObject_GetAttr(pos, s_offset),
                                  PyObject_GetAttr(pos, s_length));
    Py_DECREF(pos);
    return out;
}

/* What a request's KV depends on beyond its token ids (its prefix chains' extra keys): () for
 * nothing (most requests), else (LoRA name or None, [(identifier, offset, length) per multimodal
 * item], whether the prompt came as embeddings). A new reference, NULL with an exception set. */
static PyObject *extra_keys(PyObject *r) {
    PyObject *lora = attr_or_none(r, s_lora), *mm = NULL, *embeds = NULL, *name = NULL, *items = NULL, *out = NULL;
    if (lora == NULL || (mm = attr_or_none(r, s_mm)) == NULL || (embeds = attr_or_none(r, s_embeds)) == NULL)
        goto done;
    int has_mm = mm != Py_None && PyObject_IsTrue(mm);
    if (lora == Py_None && !has_mm && embeds == Py_None) {
        out = PyTuple_New(0);
        goto done;
    }
    name = lora == Py_None ? Py_NewRef(Py_None) : PyObject_GetAttr(lora, s_lora_name);
    items = has_mm ? list_of(mm, "mm_features must be a sequence", mm_item, NULL) : PyList_New(0);
    if (name != NULL && items != NULL)
        out = Py_BuildValue("(OOO)", name, items, embeds == Py_None ? Py_False : Py_True);
done:
    Py_XDECREF(lora);
    Py_XDECREF(mm);
    Py_XDECREF(embeds);
    Py_XDECREF(name);
    Py_XDECREF(items);
    return out;
}

/* Token ids (a sequence of ints) packed as little-endian int32: one pass in C, ~1 ns a token, and
 * the recorder reads them with one frombuffer (no Python int per token on either side). */
static PyObject *packed_tokens(PyObject *tokens) {
    PyObject *seq = PySequence_Fast(tokens, "prompt_token_ids must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out != NULL) {
        unsigned char *at = (unsigned char *)PyBytes_AS_STRING(out);
        PyObject **items = PySequence_Fast_ITEMS(seq);
        for (Py_ssize_t i = 0; i < n; i++) {
            long v = PyLong_AsLong(items[i]);
            if (v == -1 && PyErr_Occurred()) {
                Py_CLEAR(out);
                break;
            }
            uint32_t u = (uint32_t)(int32_t)v;
            at[4 * i] = u & 0xff;
            at[4 * i + 1] = (u >> 8) & 0xff;
            at[4 * i + 2] = (u >> 16) & 0xff;
            at[4 * i + 3] = u >> 24;
        }
    }
    Py_DECREF(seq);
    return out;
}

/* A new request as (req_id, block_ids, num_computed_tokens, prompt token ids packed int32, extra
 * keys); `missing` as in attr_or_missing. The recorder computes the prompt's prefix chains. */
static PyObject *new_request(PyObject *r, PyObject *missing) {
    PyObject *prompt = attr_or_missing(r, s_prompt, "NewRequestData", missing);
    if (prompt == NULL)
        return NULL;
    PyObject *packed = packed_tokens(prompt);
    Py_DECREF(prompt);
    if (packed == NULL)
        return NULL;
    return Py_BuildValue("(NNNNN)", PyObject_GetAttr(r, s_req_id), PyObject_GetAttr(r, s_block_ids),
                         PyObject_GetAttr(r, s_computed), packed, extra_keys(r));
}

/* The counts' values as a list when `counts` (a dict) names exactly `ids` (a list), in order;
 * else `counts` itself. A new reference, NULL with an exception set. */
static PyObject *aligned_counts(PyObject *counts, PyObject *ids) {
    if (!PyDict_Check(counts) || !PyList_Check(ids) || PyDict_GET_SIZE(counts) != PyList_GET_SIZE(ids))
        return Py_NewRef(counts);
    PyObject *values = PyList_New(PyList_GET_SIZE(ids));
    PyObject *key, *value;
    Py_ssize_t pos = 0, i = 0;
    while (values != NULL && PyDict_Next(counts, &pos, &key, &value)) {
        PyObject *id = PyList_GET_ITEM(ids, i);
        int same = key == id ? 1 : PyObject_RichCompareBool(key, id, Py_EQ);
        if (same <= 0) {
            Py_DECREF(values);
            return same < 0 ? NULL : Py_NewRef(counts);
        }
        PyList_SET_ITEM(values, i++, Py_NewRef(value));
    }
    return values;
}

/* A block copy as (src, dst): of an object with those attributes, or of a pair's first two. */
static PyObject *block_copy(PyObject *c, PyObject *unused) {
    if (PyObject_HasAttr(c, s_src))
        return Py_BuildValue("(NN)", PyObject_GetAttr(c, s_src), PyObject_GetAttr(c, s_dst));
    PyObject *whole = PySequence_Tuple(c);
    PyObject *pair = whole == NULL ? NULL : PyTuple_GetSlice(whole, 0, 2);
    Py_XDECREF(whole);
    return pair;
}

PyDoc_STRVAR(scheduler_fields_doc,
             "scheduler_fields(scheduler_output, cached_ids=None, missing=None) -> tuple\n\n"
             "The SchedulerOutput fields a StepInput is built from, as MessagePack encodes them (the\n"
             "lists themselves, not copies), in this order: the new requests as (id, block ids,\n"
             "computed tokens, prompt token ids packed int32, extra keys); the cached requests' ids (`cached_ids(ids)` when given:\n"
             "a RepeatedIds encodes them ahead); their resumed ids, new block ids and computed tokens;\n"
             "the tokens scheduled per request; the finished, the preempted, the blocks to zero; the\n"
             "block copies as (src, dst). The tokens per request go as a list aligned with the cached\n"
             "requests when the dict names exactly those, in their order, and no request is new (a\n"
             "decoding step): their ids are not encoded a second time. An optional field this vLLM\n"
             "lacks (an older vLLM, or a rename) is no capability to read: with a set `missing` it\n"
             "reads as () and its name, as 'SchedulerOutput.preempted_req_ids', is added to the set\n"
             "(the caller declares it); without one it raises AttributeError, as a required field does.");

static PyObject *scheduler_fields(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 3)
        return PyErr_Format(PyExc_TypeError, "scheduler_fields takes 1 to 3 arguments, not %zd", nargs);
    PyObject *so = args[0], *cached_ids = nargs >= 2 && args[1] != Py_None ? args[1] : NULL;
    PyObject *missing = nargs == 3 && args[2] != Py_None ? args[2] : NULL;
    if (missing != NULL && !PySet_Check(missing))
        return PyErr_Format(PyExc_TypeError, "scheduler_fields: missing must be a set, not %.200s",
                            Py_TYPE(missing)->tp_name);
    PyObject *f[10] = {NULL};
    PyObject *cached = PyObject_GetAttr(so, s_cached), *new = PyObject_GetAttr(so, s_new);
    PyObject *counts = PyObject_GetAttr(so, s_counts), *ids = NULL, *out = NULL;
    if (cached == NULL || new == NULL || counts == NULL || (ids = PyObject_GetAttr(cached, s_req_ids)) == NULL)
        goto done;
    if ((f[0] = list_of(new, "scheduled_new_reqs must be a sequence", new_request, missing)) == NULL)
        goto done;
    Py_ssize_t num_new = PyList_GET_SIZE(f[0]);
    f[1] = cached_ids != NULL ? PyObject_CallOneArg(cached_ids, ids) : Py_NewRef(ids);
    if (f[1] == NULL || (f[2] = attr_or_missing(cached, s_resumed, "CachedRequestData", missing)) == NULL ||
        (f[3] = PyObject_GetAttr(cached, s_new_blocks)) == NULL || (f[4] = PyObject_GetAttr(cached, s_computed)) == NULL)
        goto done;
    if ((f[5] = num_new ? Py_NewRef(counts) : aligned_counts(counts, ids)) == NULL ||
        (f[6] = PyObject_GetAttr(so, s_finished)) == NULL ||
        (f[7] = attr_or_missing(so, s_preempted, "SchedulerOutput", missing)) == NULL ||
        (f[8] = attr_or_missing(so, s_zero, "SchedulerOutput", missing)) == NULL)
        goto done;
    PyObject *copies = attr_or_missing(so, s_copies, "SchedulerOutput", missing);
    if (copies == NULL)
        goto done;
    f[9] = PyTuple_CheckExact(copies) && PyTuple_GET_SIZE(copies) == 0
               ? Py_NewRef(copies)
               : list_of(copies, "kv_cache_block_copies must be a sequence", block_copy, NULL);
    Py_DECREF(copies);
    if (f[9] == NULL)
        goto done;
    out = PyTuple_New(10);
    for (int i = 0; out != NULL && i < 10; i++) {
        PyTuple_SET_ITEM(out, i, f[i]);
        f[i] = NULL;
    }
done:
    for (int i = 0; i < 10; i++)
        Py_XDECREF(f[i]);
    Py_XDECREF(cached);
    Py_XDECREF(new);
    Py_XDECREF(counts);
    Py_XDECREF(ids);
    return out;
}

/* -- request ids that repeat from step to step ------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *encode; /* ids -> their encoding (frames: msgspec.Raw of the MessagePack) */
    PyObject *ids;    /* a copy of the last list encoded, or NULL */
    PyObject *encoded;
} repeated_t;

/* Whether the `n` ids at `ids` equal the list `last` item by item (the same string objects, mostly). */
static int same_ids(PyObject **ids, Py_ssize_t n, PyObject *last) {
    if (last == NULL || PyList_GET_SIZE(last) != n)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = ids[i], *b = PyList_GET_ITEM(last, i);
        if (a != b) {
            int same = PyObject_RichCompareBool(a, b, Py_EQ);
            if (same <= 0)
                return same;
        }
    }
    return 1;
}

static PyObject *repeated_call(repeated_t *self, PyObject *args, PyObject *kwargs) {
    PyObject *ids, *out = NULL;
    Py_ssize_t n = -1;
    static char *names[] = {"ids", "n", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|n", names, &ids, &n))
        return NULL;
    PyObject *seq = PySequence_Fast(ids, "request ids must be a sequence");
    if (seq == NULL)
        return NULL;
    if (n < 0 || n > PySequence_Fast_GET_SIZE(seq))
        n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int same = same_ids(items, n, self->ids);
    if (same > 0) {
        out = Py_NewRef(self->encoded);
    } else if (same == 0) {
        PyObject *copy = PyList_New(n), *encoded = NULL;
        if (copy != NULL) {
            for (Py_ssize_t i = 0; i < n; i++)
                PyList_SET_ITEM(copy, i, Py_NewRef(items[i]));
            encoded = PyObject_CallOneArg(self->encode, copy);
        }
        if (encoded == NULL) {
            Py_XDECREF(copy);
        } else {
            Py_XSETREF(self->ids, copy);
            Py_XSETREF(self->encoded, encoded);
            out = Py_NewRef(encoded);
        }
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *repeated_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *encode;
    static char *names[] = {"encode", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O", names, &encode))
        return NULL;
    if (!PyCallable_Check(encode))
        return PyErr_Format(PyExc_TypeError, "encode must be callable");
    repeated_t *self = (repeated_t *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->encode = Py_NewRef(encode);
    self->encoded = Py_NewRef(Py_None);
    return (PyObject *)self;
}

static int repeated_traverse(repeated_t *self, visitproc visit, void *arg) {
    Py_VISIT(self->encode);
    Py_VISIT(self->ids);
    Py_VISIT(self->encoded);
    return 0;
}

static int repeated_clear(repeated_t *self) {
    Py_CLEAR(self->encode);
    Py_CLEAR(self->ids);
    Py_CLEAR(self->encoded);
    return 0;
}

static void repeated_dealloc(repeated_t *self) {
    PyObject_GC_UnTrack(self);
    repeated_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(repeated_doc,
             "RepeatedIds(encode)\n\n"
             "A list of request ids that mostly repeats from step to step (a decoding batch's): called\n"
             "with (ids, n=len(ids)), returns encode(ids[:n]) when those ids differ from the last\n"
             "call's, else the last encoding again. Comparing a repeated list costs a pointer per id\n"
             "(the runner and the scheduler hand over the same string objects); encoding it again, or\n"
             "slicing it, with the caches cold after a forward pass, several times that.");

static PyTypeObject repeated_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_hotpath.RepeatedIds",
    .tp_basicsize = sizeof(repeated_t),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = repeated_doc,
    .tp_new = repeated_new,
    .tp_call = (ternaryfunc)repeated_call,
    .tp_traverse = (traverseproc)repeated_traverse,
    .tp_clear = (inquiry)repeated_clear,
    .tp_dealloc = (destructor)repeated_dealloc,
};

static PyMethodDef methods[] = {
    {"set_converter", set_converter, METH_O, set_converter_doc},
    {"write_frame", write_frame, METH_VARARGS, write_frame_doc},
    {"pack_parts", pack_parts, METH_O, pack_parts_doc},
    {"prefix_max", prefix_max, METH_VARARGS, prefix_max_doc},
    {"write_record", write_record, METH_VARARGS, write_record_doc},
    {"scheduler_fields", (PyCFunction)(void (*)(void))scheduler_fields, METH_FASTCALL, scheduler_fields_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hotpath", "The producer's side of a rank's ring, compiled.", -1, methods,
};

static int intern_names(void) {
    struct {
        PyObject **name;
        const char *text;
    } names[] = {
        {&s_cached, "scheduled_cached_reqs"}, {&s_new, "scheduled_new_reqs"},
        {&s_counts, "num_scheduled_tokens"},   {&s_copies, "kv_cache_block_copies"},
        {&s_req_ids, "req_ids"},               {&s_resumed, "resumed_req_ids"},
        {&s_new_blocks, "new_block_ids"},      {&s_computed, "num_computed_tokens"},
        {&s_finished, "finished_req_ids"},     {&s_preempted, "preempted_req_ids"},
        {&s_zero, "new_block_ids_to_zero"},    {&s_req_id, "req_id"},
        {&s_block_ids, "block_ids"},           {&s_prompt, "prompt_token_ids"},
        {&s_src, "src"},                       {&s_dst, "dst"},
        {&s_lora, "lora_request"},             {&s_lora_name, "lora_name"},
        {&s_mm, "mm_features"},                {&s_embeds, "prompt_embeds"},
        {&s_mm_position, "mm_position"},       {&s_identifier, "identifier"},
        {&s_offset, "offset"},                 {&s_length, "length"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((*names[i].name = PyUnicode_InternFromString(names[i].text)) == NULL)
            return -1;
    return 0;
}

PyMODINIT_FUNC PyInit__hotpath(void) {
    if (intern_names() < 0 || PyType_Ready(&repeated_type) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddObjectRef(m, "RepeatedIds", (PyObject *)&repeated_type) < 0))
        Py_CLEAR(m);
    return m;
}

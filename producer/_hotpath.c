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

static void release_all(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        PyBuffer_Release(&views[i]);
}

PyDoc_STRVAR(write_frame_doc,
             "write_frame(mapping, kind, seq, emitted_at_us, parts) -> bool\n\n"
             "Copy `parts` (bytes or C-contiguous uint8/int32/int64 arrays) into the ring as one frame;\n"
             "False when the ring has no room (counted as dropped). TypeError for a part of another type,\n"
             "BufferError for one not contiguous: the caller converts those and calls again.");

static PyObject *write_frame(PyObject *self, PyObject *args) {
    PyObject *mapping, *parts;
    unsigned long long kind, seq, at_us;
    if (!PyArg_ParseTuple(args, "OKKKO", &mapping, &kind, &seq, &at_us, &parts))
        return NULL;
    PyObject *seq_parts = PySequence_Fast(parts, "parts must be a sequence");
    if (seq_parts == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq_parts);
    if (n > MAX_PARTS) {
        Py_DECREF(seq_parts);
        return PyErr_Format(PyExc_ValueError, "a frame holds at most %d parts, not %zd", MAX_PARTS, n);
    }
    Py_buffer views[MAX_PARTS];
    uint64_t types[MAX_PARTS];
    uint64_t size = 8 * (FRAME_WORDS + (uint64_t)n);
    Py_ssize_t got = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq_parts);
    for (; got < n; got++) {
        if (PyObject_GetBuffer(items[got], &views[got], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto fail;
        types[got] = (uint64_t)part_type(&views[got]);
        if (types[got] == 0) {
            PyErr_Format(PyExc_TypeError, "part %zd: format %s is not a frame part's", got,
                         views[got].format ? views[got].format : "B");
            got++;
            goto fail;
        }
        size += align8((uint64_t)views[got].len);
    }
    ring_t ring;
    if (ring_open(&ring, mapping) < 0)
        goto fail;
    uint8_t *room = ring_reserve(&ring, size);
    if (room != NULL) {
        uint64_t *words = (uint64_t *)room;
        words[0] = kind | (uint64_t)n << 8;
        words[1] = seq;
        words[2] = at_us;
        uint8_t *at = room + 8 * (FRAME_WORDS + n);
        for (Py_ssize_t i = 0; i < n; i++) {
            words[FRAME_WORDS + i] = types[i] | (uint64_t)(views[i].len / views[i].itemsize) << 8;
            memcpy(at, views[i].buf, (size_t)views[i].len); /* the padding is left as it was */
            at += align8((uint64_t)views[i].len);
        }
        ring_publish(&ring);
    }
    PyBuffer_Release(&ring.view);
    release_all(views, n);
    Py_DECREF(seq_parts);
    return PyBool_FromLong(room != NULL);
fail:
    release_all(views, got);
    Py_DECREF(seq_parts);
    return NULL;
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

static PyMethodDef methods[] = {
    {"write_frame", write_frame, METH_VARARGS, write_frame_doc},
    {"write_record", write_record, METH_VARARGS, write_record_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hotpath", "The producer's side of a rank's ring, compiled.", -1, methods,
};

PyMODINIT_FUNC PyInit__hotpath(void) { return PyModule_Create(&module); }

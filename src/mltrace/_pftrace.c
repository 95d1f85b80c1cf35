/* The Perfetto exporter's span packets in C (run/perfetto.py, PerfettoEncoder.encode).
 *
 * encode_spans(ks, spans, n_ends, end_tails, begin_heads, blocks, dict_blocks, layer, flowing, fallback)
 * encodes the packets at indices ks (2i: span i's SLICE_BEGIN, 2i + 1: its SLICE_END, from
 * n_ends on: instants and counters) and returns them joined, byte for byte what the Python
 * encoder writes. It does the common packets itself, from the encoder's caches:
 *   - an end whose track has its packet tail in end_tails;
 *   - a begin without flows (its span id not in `flowing`) whose (track, name, level) head is in
 *     begin_heads, and whose attributes are empty or have a cached annotation block: a layer's
 *     in `blocks` (keyed as the Python encoder keys it: attribute names, then the ids of the
 *     values), any span's in `dict_blocks` by the id of its attribute dict (filled here for
 *     layers, and by the Python encoder for a map of another level seen twice).
 * Everything else (a first slice on a track, flows, other levels' annotations, a negative time,
 * instants, counters) goes to fallback(k), the Python encoder, which fills those caches.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Buf;

static int buf_reserve(Buf *b, Py_ssize_t more) {
    if (b->len + more <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 1 << 16;
    while (cap < b->len + more) cap *= 2;
    char *p = PyMem_Realloc(b->data, cap);
    if (!p) { PyErr_NoMemory(); return -1; }
    b->data = p; b->cap = cap;
    return 0;
}

static inline int varint_len(uint64_t v) {
    int n = 1;
    while (v >= 0x80) { v >>= 7; n++; }
    return n;
}

static inline void put_varint(Buf *b, uint64_t v) {  /* room reserved by the caller */
    while (v >= 0x80) { b->data[b->len++] = (char)((v & 0x7F) | 0x80); v >>= 7; }
    b->data[b->len++] = (char)v;
}

static inline void put(Buf *b, const char *s, Py_ssize_t n) {
    memcpy(b->data + b->len, s, n);
    b->len += n;
}

static PyObject *s_track_id, *s_name, *s_level, *s_attrs, *s_id, *s_start_ns, *s_end_ns;

/* An int attribute of a span as int64 (>= 0), or -1 where the fast path does not apply. */
static int64_t nonneg_attr(PyObject *span, PyObject *name) {
    PyObject *v = PyObject_GetAttr(span, name);
    if (!v) return -2;
    int overflow = 0;
    long long x = PyLong_Check(v) ? PyLong_AsLongLongAndOverflow(v, &overflow) : -1;
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred()) return -2;
    return overflow || x < 0 ? -1 : (int64_t)x;
}

static int append_bytes(Buf *b, PyObject *bytes) {
    if (!PyBytes_Check(bytes)) { PyErr_SetString(PyExc_TypeError, "fallback must return bytes"); return -1; }
    Py_ssize_t n = PyBytes_GET_SIZE(bytes);
    if (buf_reserve(b, n) < 0) return -1;
    put(b, PyBytes_AS_STRING(bytes), n);
    return 0;
}

/* The end packet of `span`, or 1 where it needs the fallback, -1 on error. */
static int end_packet(Buf *b, PyObject *span, PyObject *end_tails) {
    PyObject *track = PyObject_GetAttr(span, s_track_id);
    if (!track) return -1;
    PyObject *tail = PyDict_GetItemWithError(end_tails, track);  /* borrowed */
    Py_DECREF(track);
    if (!tail) return PyErr_Occurred() ? -1 : 1;
    int64_t end = nonneg_attr(span, s_end_ns);
    if (end == -2) return -1;
    if (end < 0 || !PyBytes_Check(tail)) return 1;
    Py_ssize_t tlen = PyBytes_GET_SIZE(tail);
    Py_ssize_t body = 1 + varint_len((uint64_t)end) + tlen;
    if (buf_reserve(b, 1 + 10 + body) < 0) return -1;
    b->data[b->len++] = 0x0a;
    put_varint(b, (uint64_t)body);
    b->data[b->len++] = 0x40;
    put_varint(b, (uint64_t)end);
    put(b, PyBytes_AS_STRING(tail), tlen);
    return 0;
}

/* The annotation block of a layer span's attributes (borrowed), NULL where not cached (no error
 * set) or on error (set). */
static PyObject *layer_block(PyObject *attrs, PyObject *blocks, PyObject *dict_blocks) {
    PyObject *dict_id = PyLong_FromVoidPtr(attrs);
    if (!dict_id) return NULL;
    PyObject *block = PyDict_GetItemWithError(dict_blocks, dict_id);
    if (block || PyErr_Occurred()) { Py_DECREF(dict_id); return block; }
    Py_ssize_t n = PyDict_GET_SIZE(attrs), i = 0, pos = 0;
    PyObject *key = PyTuple_New(2 * n), *k, *v;
    if (!key) { Py_DECREF(dict_id); return NULL; }
    while (PyDict_Next(attrs, &pos, &k, &v)) {
        PyObject *vid = PyLong_FromVoidPtr(v);
        if (!vid) { Py_DECREF(key); Py_DECREF(dict_id); return NULL; }
        PyTuple_SET_ITEM(key, i, Py_NewRef(k));
        PyTuple_SET_ITEM(key, n + i, vid);
        i++;
    }
    block = PyDict_GetItemWithError(blocks, key);
    Py_DECREF(key);
    if (block && PyDict_SetItem(dict_blocks, dict_id, block) < 0) block = NULL;
    Py_DECREF(dict_id);
    return block;
}

/* The begin packet of `span`, or 1 where it needs the fallback, -1 on error. */
static int begin_packet(Buf *b, PyObject *span, PyObject *begin_heads, PyObject *blocks, PyObject *dict_blocks,
                        PyObject *layer, PyObject *flowing) {
    PyObject *id = PyObject_GetAttr(span, s_id);
    if (!id) return -1;
    int flows = PySet_Contains(flowing, id);
    Py_DECREF(id);
    if (flows) return flows < 0 ? -1 : 1;
    PyObject *track = PyObject_GetAttr(span, s_track_id);
    PyObject *name = track ? PyObject_GetAttr(span, s_name) : NULL;
    PyObject *level = name ? PyObject_GetAttr(span, s_level) : NULL;
    PyObject *head_key = level ? PyTuple_Pack(3, track, name, level) : NULL;
    Py_XDECREF(track); Py_XDECREF(name);
    if (!head_key) { Py_XDECREF(level); return -1; }
    PyObject *head = PyDict_GetItemWithError(begin_heads, head_key);  /* borrowed */
    Py_DECREF(head_key);
    if (!head || !PyBytes_Check(head)) { Py_DECREF(level); return PyErr_Occurred() ? -1 : 1; }
    Py_INCREF(head);
    PyObject *attrs = PyObject_GetAttr(span, s_attrs);
    if (!attrs) { Py_DECREF(level); Py_DECREF(head); return -1; }
    PyObject *block = NULL;
    int ok = 1;
    if (!PyDict_CheckExact(attrs)) ok = 0;
    else if (PyDict_GET_SIZE(attrs) > 0) {
        if (level == layer) block = layer_block(attrs, blocks, dict_blocks);
        else {  /* another level's map: cached by the Python encoder once seen twice */
            PyObject *map_id = PyLong_FromVoidPtr(attrs);
            block = map_id ? PyDict_GetItemWithError(dict_blocks, map_id) : NULL;
            Py_XDECREF(map_id);
        }
        if (!block) ok = PyErr_Occurred() ? -1 : 0;
        else if (!PyBytes_Check(block)) { ok = 0; block = NULL; }
        else Py_INCREF(block);
    }
    Py_DECREF(level);
    Py_DECREF(attrs);
    int64_t start = ok > 0 ? nonneg_attr(span, s_start_ns) : 0;
    if (ok <= 0 || start < 0) {
        Py_DECREF(head); Py_XDECREF(block);
        return ok < 0 || start == -2 ? -1 : 1;
    }
    Py_ssize_t hlen = PyBytes_GET_SIZE(head), blen = block ? PyBytes_GET_SIZE(block) : 0;
    Py_ssize_t ev = hlen + blen;
    Py_ssize_t body = 1 + varint_len((uint64_t)start) + 2 + 1 + varint_len((uint64_t)ev) + ev + 2;
    if (buf_reserve(b, 1 + 10 + body) < 0) { Py_DECREF(head); Py_XDECREF(block); return -1; }
    b->data[b->len++] = 0x0a;
    put_varint(b, (uint64_t)body);
    b->data[b->len++] = 0x40;
    put_varint(b, (uint64_t)start);
    put(b, "\x50\x01", 2);  /* trusted_packet_sequence_id = 1 */
    b->data[b->len++] = 0x5a;  /* track_event */
    put_varint(b, (uint64_t)ev);
    put(b, PyBytes_AS_STRING(head), hlen);
    if (blen) put(b, PyBytes_AS_STRING(block), blen);
    put(b, "\x68\x02", 2);  /* sequence_flags = SEQ_NEEDS_INCREMENTAL_STATE */
    Py_DECREF(head); Py_XDECREF(block);
    return 0;
}

static PyObject *encode_spans(PyObject *mod, PyObject *args) {
    PyObject *ks, *spans, *end_tails, *begin_heads, *blocks, *dict_blocks, *layer, *flowing, *fallback;
    Py_ssize_t n_ends;
    if (!PyArg_ParseTuple(args, "O!O!nO!O!O!O!OO!O", &PyList_Type, &ks, &PyList_Type, &spans, &n_ends, &PyDict_Type,
                          &end_tails, &PyDict_Type, &begin_heads, &PyDict_Type, &blocks, &PyDict_Type, &dict_blocks, &layer,
                          &PySet_Type, &flowing, &fallback))
        return NULL;
    Buf b = {NULL, 0, 0};
    Py_ssize_t count = PyList_GET_SIZE(ks), n_spans = PyList_GET_SIZE(spans);
    for (Py_ssize_t j = 0; j < count; j++) {
        PyObject *kobj = PyList_GET_ITEM(ks, j);
        Py_ssize_t k = PyLong_AsSsize_t(kobj);
        if (k == -1 && PyErr_Occurred()) goto fail;
        int r = 1;
        if (k >= 0 && k < n_ends && (k >> 1) < n_spans) {
            PyObject *span = PyList_GET_ITEM(spans, k >> 1);
            r = (k & 1) ? end_packet(&b, span, end_tails)
                        : begin_packet(&b, span, begin_heads, blocks, dict_blocks, layer, flowing);
        }
        if (r < 0) goto fail;
        if (r > 0) {
            PyObject *packet = PyObject_CallOneArg(fallback, kobj);
            if (!packet) goto fail;
            int bad = append_bytes(&b, packet);
            Py_DECREF(packet);
            if (bad) goto fail;
        }
    }
    PyObject *out = PyBytes_FromStringAndSize(b.data ? b.data : "", b.len);
    PyMem_Free(b.data);
    return out;
fail:
    PyMem_Free(b.data);
    return NULL;
}

static PyMethodDef methods[] = {
    {"encode_spans", encode_spans, METH_VARARGS,
     "encode_spans(ks, spans, n_ends, end_tails, begin_heads, blocks, dict_blocks, layer, flowing, fallback) -> bytes: "
     "the packets at indices ks, joined; what the caches do not cover comes from fallback(k)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_pftrace", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pftrace(void) {
    if (!(s_track_id = PyUnicode_InternFromString("track_id")) || !(s_name = PyUnicode_InternFromString("name")) ||
        !(s_level = PyUnicode_InternFromString("level")) || !(s_attrs = PyUnicode_InternFromString("attrs")) ||
        !(s_id = PyUnicode_InternFromString("id")) || !(s_start_ns = PyUnicode_InternFromString("start_ns")) ||
        !(s_end_ns = PyUnicode_InternFromString("end_ns")))
        return NULL;
    return PyModule_Create(&moddef);
}

/* The Perfetto exporter's span packets in C (run/perfetto.py, PerfettoEncoder.encode).
 *
 * encode_spans(ks, spans, n_ends, end_tails, begin_heads, blocks, dict_blocks, layer, flowing, fallback,
 *              interned)
 * encodes the packets at indices ks (2i: span i's SLICE_BEGIN, 2i + 1: its SLICE_END, from
 * n_ends on: instants and counters) and returns them joined, byte for byte what the Python
 * encoder writes. It does the common packets itself, from the encoder's caches:
 *   - an end whose track has its packet tail in end_tails;
 *   - a begin without flows (its span id not in `flowing`) whose (track, name, level) head is in
 *     begin_heads, and whose attributes are empty or have a cached annotation block: a layer's
 *     in `blocks` (keyed as the Python encoder keys it: attribute names, then the ids of the
 *     values), any span's in `dict_blocks` by the id of its attribute dict (filled here for
 *     layers, and by the Python encoder for a map of another level seen twice);
 *   - a begin as above whose attribute map is not cached, where `interned` is
 *     (ann_enc, str_values, dumps, seen, seen_max) and every value is None (skipped), a bool, an
 *     int of 64 bits, a float, or a str, list, tuple, dict or larger int (exact types) whose UTF-8
 *     or dumps(value) bytes are in str_values, and every name of a value in ann_enc: the annotations
 *     are then all references to interned data already written, so the packet interns nothing.
 *     A map of another level than `layer` is then counted in `seen`, and its block kept in
 *     dict_blocks, as the Python encoder does.
 * Everything else (a first slice on a track, flows, a name or string value not interned yet,
 * a negative time, instants, counters) goes to fallback(k), the Python encoder, which interns
 * what is new and fills those caches.
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

/* The buffer's bytes as a new bytes object (NULL on error), the buffer freed either way. */
static PyObject *buf_take(Buf *b) {
    PyObject *out = PyBytes_FromStringAndSize(b->data ? b->data : "", b->len);
    PyMem_Free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
    return out;
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

/* What the Python encoder's interning tables hold (PerfettoEncoder._ann_enc, ._str_values), the
 * JSON encoder of other values, and its count of attribute maps seen once (see encode). */
typedef struct {
    PyObject *ann_enc, *str_values, *dumps, *seen;
    Py_ssize_t seen_max;
} Interned;

/* A string annotation value's interned reference (borrowed, from str_values), NULL where the
 * Python encoder must write it (no error set) or on error (set). */
static PyObject *string_ref(PyObject *value, const Interned *in) {
    PyObject *raw;
    if (PyUnicode_CheckExact(value)) raw = PyUnicode_AsUTF8String(value);  /* fails on lone surrogates */
    else if (PyLong_CheckExact(value) || PyList_CheckExact(value) || PyTuple_CheckExact(value) ||
             PyDict_CheckExact(value))  /* an int here is beyond 64 bits */
        raw = PyObject_CallOneArg(in->dumps, value);
    else return NULL;  /* a subclass of int, float or str, or another object: as Python decides */
    if (!raw || !PyBytes_Check(raw)) {  /* the fallback encodes it, or raises what it raised */
        Py_XDECREF(raw);
        PyErr_Clear();
        return NULL;
    }
    PyObject *ref = PyDict_GetItemWithError(in->str_values, raw);
    Py_DECREF(raw);
    return ref && PyBytes_Check(ref) ? ref : NULL;
}

/* One annotation's value fields (PerfettoEncoder._annotations) into out (16 bytes), as their
 * length; 0 for a value written as a string (string_ref), -1 on an error (cleared: the fallback
 * encodes it). */
static int scalar_value(PyObject *value, char *out) {
    if (PyBool_Check(value)) {
        out[0] = 0x10;
        out[1] = value == Py_True;
        return 2;
    }
    if (PyLong_CheckExact(value)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (overflow) return 0;  /* beyond 64 bits: written as JSON */
        if (x == -1 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
        Buf v = {out, 1, 16};
        out[0] = 0x20;
        put_varint(&v, (uint64_t)x);  /* two's complement, as value & 0xFFFFFFFFFFFFFFFF */
        return (int)v.len;
    }
    if (PyFloat_CheckExact(value)) {
        out[0] = 0x29;
#if PY_VERSION_HEX >= 0x030B0000
        if (PyFloat_Pack8(PyFloat_AS_DOUBLE(value), out + 1, 1) < 0) { PyErr_Clear(); return -1; }
#else
        if (_PyFloat_Pack8(PyFloat_AS_DOUBLE(value), (unsigned char *)out + 1, 1) < 0) { PyErr_Clear(); return -1; }
#endif
        return 9;
    }
    return 0;
}

/* The annotation block of `attrs` (a new reference), encoded here where it would intern nothing;
 * NULL where the fallback must encode it (no error set) or on error (set). */
static PyObject *fresh_block(PyObject *attrs, const Interned *in) {
    Buf b = {NULL, 0, 0};
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(attrs, &pos, &key, &value)) {
        if (value == Py_None) continue;
        PyObject *name = PyDict_GetItemWithError(in->ann_enc, key);  /* borrowed */
        if (!name || !PyBytes_Check(name)) goto miss;
        char scalar[16];
        const char *val = scalar;
        Py_ssize_t vlen = scalar_value(value, scalar);
        if (vlen < 0) goto miss;
        if (vlen == 0) {
            PyObject *ref = string_ref(value, in);
            if (!ref) goto miss;
            val = PyBytes_AS_STRING(ref);
            vlen = PyBytes_GET_SIZE(ref);
        }
        Py_ssize_t nlen = PyBytes_GET_SIZE(name), body = nlen + vlen;
        if (buf_reserve(&b, 1 + 10 + body) < 0) { PyMem_Free(b.data); return NULL; }
        b.data[b.len++] = 0x22;  /* TrackEvent.debug_annotations */
        put_varint(&b, (uint64_t)body);
        put(&b, PyBytes_AS_STRING(name), nlen);
        put(&b, val, vlen);
    }
    return buf_take(&b);
miss:
    PyMem_Free(b.data);
    return NULL;
}

/* Keeps a map's block as PerfettoEncoder._slice_begin does: by the map's id once it is seen a
 * second time, else counts it as seen (up to seen_max). 0, or -1 on error. */
static int remember_block(PyObject *attrs, PyObject *block, PyObject *dict_blocks, const Interned *in) {
    PyObject *map_id = PyLong_FromVoidPtr(attrs);
    if (!map_id) return -1;
    int seen = PySet_Contains(in->seen, map_id), r = seen;
    if (seen > 0) r = PyDict_SetItem(dict_blocks, map_id, block);
    else if (seen == 0 && PySet_GET_SIZE(in->seen) < in->seen_max) r = PySet_Add(in->seen, map_id);
    Py_DECREF(map_id);
    return r < 0 ? -1 : 0;
}

/* The begin packet of `span`, or 1 where it needs the fallback, -1 on error. */
static int begin_packet(Buf *b, PyObject *span, PyObject *begin_heads, PyObject *blocks, PyObject *dict_blocks,
                        PyObject *layer, PyObject *flowing, const Interned *in) {
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
    int64_t start = nonneg_attr(span, s_start_ns);
    PyObject *block = NULL;
    int ok = start >= 0 ? 1 : start == -2 ? -1 : 0;
    if (ok <= 0) {}
    else if (!PyDict_CheckExact(attrs)) ok = 0;
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
        if (ok == 0 && in) {  /* a map not cached: encoded here if it interns nothing */
            block = fresh_block(attrs, in);
            ok = block ? 1 : PyErr_Occurred() ? -1 : 0;
            if (block && level != layer && remember_block(attrs, block, dict_blocks, in) < 0) ok = -1;
        }
    }
    Py_DECREF(level);
    Py_DECREF(attrs);
    if (ok <= 0) {
        Py_DECREF(head); Py_XDECREF(block);
        return ok < 0 ? -1 : 1;
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
    PyObject *interned = Py_None;
    Py_ssize_t n_ends;
    if (!PyArg_ParseTuple(args, "O!O!nO!O!O!O!OO!O|O", &PyList_Type, &ks, &PyList_Type, &spans, &n_ends, &PyDict_Type,
                          &end_tails, &PyDict_Type, &begin_heads, &PyDict_Type, &blocks, &PyDict_Type, &dict_blocks, &layer,
                          &PySet_Type, &flowing, &fallback, &interned))
        return NULL;
    Interned in_ = {NULL, NULL, NULL, NULL, 0}, *in = NULL;
    if (interned != Py_None) {
        if (!PyArg_ParseTuple(interned, "O!O!OO!n;interned must be (ann_enc, str_values, dumps, seen, seen_max)",
                              &PyDict_Type, &in_.ann_enc, &PyDict_Type, &in_.str_values, &in_.dumps, &PySet_Type,
                              &in_.seen, &in_.seen_max))
            return NULL;
        in = &in_;
    }
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
                        : begin_packet(&b, span, begin_heads, blocks, dict_blocks, layer, flowing, in);
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
    return buf_take(&b);
fail:
    PyMem_Free(b.data);
    return NULL;
}

static PyMethodDef methods[] = {
    {"encode_spans", encode_spans, METH_VARARGS,
     "encode_spans(ks, spans, n_ends, end_tails, begin_heads, blocks, dict_blocks, layer, flowing, fallback, "
     "interned=None) -> bytes: the packets at indices ks, joined; what the caches do not cover comes from fallback(k)."},
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

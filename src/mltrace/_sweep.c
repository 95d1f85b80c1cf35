/* The correlator's two per-span sweeps in C (tracer/passes/nesting.py, checks.py), the same
 * algorithms as their Python versions, on int64 columns (C-contiguous buffers, one entry a span):
 *
 * containers(ordered, track, start, end, level, user, user_holder, out)
 *     ordered: rows sorted by (track, start, -end, level rank, id). For each row, writes to
 *     out[row] the row of its innermost container on its track (-1: none): see
 *     passes.nesting.innermost_containers, whose stack sweep this is. A span of level
 *     ``user`` holds any span and is held by one of its own level or of a level up to
 *     ``user_holder`` (not by a library call or a kernel).
 * lanes(ordered, track, start, end, out)
 *     ordered: rows sorted by (track, start, -end, id). For each row, writes to out[row] the
 *     first lane of its track where it nests (0: the track itself): passes.checks._place.
 * columns(objects, names, nullable, out)
 *     out: an int64 buffer of len(names) * len(objects) entries; writes attribute names[k] of
 *     objects[i] to out[k * n + i], None as -1 where bit k of nullable is set, as
 *     passes.nesting.span_columns's numpy.fromiter calls would. Reads a __slots__ attribute straight from the object where its type's
 *     descriptor is a plain member, otherwise by getattr; a value that is not an int raises.
 * str_rows(objects, field, key)
 *     The rows (a list) of the objects whose attribute field is a dict holding a str under key:
 *     passes.gpu_library's kernel spans. An attribute that is not a dict raises TypeError.
 * with_parents(objects, rows, parents, cls, field, cleared)
 *     A copy of the list objects where objects[rows[i]] is replaced by a copy of it with
 *     attribute field set to parents[i] (-1: None) and each attribute named in cleared set to
 *     None, every other __slots__ member the same object: what passes.nesting._copy_with_parent
 *     makes of a Span, without running Python code a span. The objects at rows must be of class
 *     cls, a plain one (a direct subclass of object with __slots__ only), else TypeError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>

#define COMPACT_AFTER 32 /* passes.nesting._COMPACT_AFTER */

typedef struct {
    int64_t *rows;
    Py_ssize_t len, cap;
} Stack;

static int push(Stack *s, int64_t row) {
    if (s->len == s->cap) {
        Py_ssize_t cap = s->cap ? 2 * s->cap : 64;
        int64_t *p = PyMem_Realloc(s->rows, cap * sizeof(int64_t));
        if (!p) { PyErr_NoMemory(); return -1; }
        s->rows = p; s->cap = cap;
    }
    s->rows[s->len++] = row;
    return 0;
}

/* Gets n int64 columns of equal length (the first sets it); the last one writable. */
static int columns(PyObject *args, const char *fmt, Py_buffer *bufs, int n, long *extra, long *extra2) {
    int ok = extra ? PyArg_ParseTuple(args, fmt, &bufs[0], &bufs[1], &bufs[2], &bufs[3], &bufs[4], extra, extra2, &bufs[5])
                   : PyArg_ParseTuple(args, fmt, &bufs[0], &bufs[1], &bufs[2], &bufs[3], &bufs[4]);
    if (!ok) return -1;
    Py_ssize_t len = bufs[0].len;
    for (int i = 0; i < n; i++) {
        if (bufs[i].len != len || bufs[i].len % (Py_ssize_t)sizeof(int64_t)) {
            for (int j = 0; j < n; j++) PyBuffer_Release(&bufs[j]);
            PyErr_SetString(PyExc_ValueError, "columns must be int64 arrays of one length");
            return -1;
        }
    }
    return 0;
}

static PyObject *containers(PyObject *mod, PyObject *args) {
    (void)mod;
    Py_buffer b[6];
    long user, user_holder;
    if (columns(args, "y*y*y*y*y*llw*", b, 6, &user, &user_holder) < 0) return NULL;
    const int64_t *ordered = b[0].buf, *track = b[1].buf, *start = b[2].buf, *end = b[3].buf, *level = b[4].buf;
    int64_t *out = b[5].buf;
    Py_ssize_t n = b[0].len / (Py_ssize_t)sizeof(int64_t);
    Stack st = {NULL, 0, 0};
    int failed = 0;
    for (Py_ssize_t i = 0; i < n; i++) out[i] = -1;
    for (Py_ssize_t p = 0; p < n && !failed; p++) {
        int64_t r = ordered[p];
        if (r < 0 || r >= n) { PyErr_SetString(PyExc_ValueError, "a row out of range"); failed = 1; break; }
        if (p == 0 || track[r] != track[ordered[p - 1]]) st.len = 0;  /* a new track */
        int64_t s = start[r], e = end[r], lv = level[r];
        /* Spans that ended by the time this one starts are done (unless it is a zero-length
         * span at their very end, which they still contain). */
        while (st.len) {
            int64_t t = st.rows[st.len - 1];
            if (end[t] <= s && !(start[t] <= s && e <= end[t])) st.len--;
            else break;
        }
        Py_ssize_t dead = 0;
        for (Py_ssize_t j = st.len - 1; j >= 0; j--) {
            int64_t q = st.rows[j];
            if (end[q] >= e && (level[q] == user || level[q] <= (lv == user ? user_holder : lv))) { out[r] = q; break; }
            if (end[q] < s) dead++;
        }
        if (dead > COMPACT_AFTER) {
            Py_ssize_t k = 0;
            for (Py_ssize_t j = 0; j < st.len; j++)
                if (end[st.rows[j]] >= s) st.rows[k++] = st.rows[j];
            st.len = k;
        }
        if (push(&st, r) < 0) failed = 1;
    }
    PyMem_Free(st.rows);
    for (int i = 0; i < 6; i++) PyBuffer_Release(&b[i]);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

static PyObject *lanes(PyObject *mod, PyObject *args) {
    (void)mod;
    Py_buffer b[5];
    if (columns(args, "y*y*y*y*w*", b, 5, NULL, NULL) < 0) return NULL;
    const int64_t *ordered = b[0].buf, *track = b[1].buf, *start = b[2].buf, *end = b[3].buf;
    int64_t *out = b[4].buf;
    Py_ssize_t n = b[0].len / (Py_ssize_t)sizeof(int64_t);
    Stack *ls = NULL;  /* the lanes of the current track, each a stack */
    Py_ssize_t nlanes = 0, cap = 0;
    int failed = 0;
    for (Py_ssize_t p = 0; p < n && !failed; p++) {
        int64_t r = ordered[p];
        if (r < 0 || r >= n) { PyErr_SetString(PyExc_ValueError, "a row out of range"); failed = 1; break; }
        if (p == 0 || track[r] != track[ordered[p - 1]]) {
            for (Py_ssize_t i = 0; i < nlanes; i++) ls[i].len = 0;
            nlanes = 1;
            if (!ls) {
                ls = PyMem_Calloc(1, sizeof(Stack));
                if (!ls) { PyErr_NoMemory(); failed = 1; break; }
                cap = 1;
            }
        }
        Py_ssize_t placed = -1;
        for (Py_ssize_t i = 0; i < nlanes; i++) {
            Stack *s = &ls[i];
            while (s->len && end[s->rows[s->len - 1]] <= start[r]) s->len--;
            if (!s->len || end[r] <= end[s->rows[s->len - 1]]) { placed = i; break; }
        }
        if (placed < 0) {
            if (nlanes == cap) {
                Stack *more = PyMem_Realloc(ls, 2 * cap * sizeof(Stack));
                if (!more) { PyErr_NoMemory(); failed = 1; break; }
                for (Py_ssize_t i = cap; i < 2 * cap; i++) more[i] = (Stack){NULL, 0, 0};
                ls = more; cap *= 2;
            }
            placed = nlanes++;
            ls[placed].len = 0;
        }
        out[r] = placed;
        if (push(&ls[placed], r) < 0) failed = 1;
    }
    for (Py_ssize_t i = 0; i < cap; i++) PyMem_Free(ls[i].rows);
    PyMem_Free(ls);
    for (int i = 0; i < 5; i++) PyBuffer_Release(&b[i]);
    if (failed) return NULL;
    Py_RETURN_NONE;
}


/* One attribute of every object of a list: a __slots__ member is read at its offset when the
 * object is of the type whose member it is, anything else by getattr. */
typedef struct {
    PyObject *name;
    PyTypeObject *type; /* the type of the first object; NULL: always getattr */
    Py_ssize_t offset;
    int nullable; /* None reads as -1 */
} Field;

static int value_of(PyObject *obj, const Field *f, int64_t *out) {
    PyObject *v;
    if (f->type && Py_TYPE(obj) == f->type) {
        v = *(PyObject **)((char *)obj + f->offset);
        if (!v) { PyErr_SetObject(PyExc_AttributeError, f->name); return -1; }
        Py_INCREF(v);
    } else {
        v = PyObject_GetAttr(obj, f->name);
        if (!v) return -1;
    }
    if (v == Py_None && f->nullable) {
        *out = -1;
    } else if (PyLong_Check(v)) {
        long long x = PyLong_AsLongLong(v);
        if (x == -1 && PyErr_Occurred()) { Py_DECREF(v); return -1; }
        *out = (int64_t)x;
    } else {
        Py_DECREF(v);
        PyErr_SetString(PyExc_TypeError, "a column value is not an int");
        return -1;
    }
    Py_DECREF(v);
    return 0;
}

static PyObject *span_columns(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *objects, *names;
    unsigned long long nullable;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "O!O!Kw*", &PyList_Type, &objects, &PyTuple_Type, &names, &nullable, &out)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(objects), k = PyTuple_GET_SIZE(names);
    if (out.len != n * k * (Py_ssize_t)sizeof(int64_t)) {
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "out must hold len(names) * len(objects) int64 entries");
        return NULL;
    }
    Field *fields = PyMem_Calloc(k ? k : 1, sizeof(Field));
    if (!fields) { PyBuffer_Release(&out); return PyErr_NoMemory(); }
    int failed = 0;
    PyTypeObject *type = n ? Py_TYPE(PyList_GET_ITEM(objects, 0)) : NULL;
    for (Py_ssize_t j = 0; j < k && !failed; j++) {
        PyObject *name = PyTuple_GET_ITEM(names, j);
        if (!PyUnicode_Check(name)) { PyErr_SetString(PyExc_TypeError, "names must be str"); failed = 1; break; }
        fields[j].name = name;
        fields[j].nullable = j < 64 && ((nullable >> j) & 1);
        PyObject *descr = type ? _PyType_Lookup(type, name) : NULL; /* borrowed */
        if (descr && Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
            PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
            if (m->type == T_OBJECT_EX && !(m->flags & READ_RESTRICTED)) {
                fields[j].type = type;
                fields[j].offset = m->offset;
            }
        }
    }
    int64_t *dst = out.buf;
    for (Py_ssize_t i = 0; i < n && !failed; i++) {
        PyObject *obj = PyList_GET_ITEM(objects, i);
        for (Py_ssize_t j = 0; j < k; j++)
            if (value_of(obj, &fields[j], &dst[j * n + i]) < 0) { failed = 1; break; }
    }
    PyMem_Free(fields);
    PyBuffer_Release(&out);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

/* The offset of member ``name`` of a __slots__ class, or -1. */
static Py_ssize_t member_offset(PyTypeObject *type, PyObject *name) {
    PyObject *descr = _PyType_Lookup(type, name);
    if (!descr || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) return -1;
    PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
    return m->type == T_OBJECT_EX ? m->offset : -1;
}

static PyObject *str_rows(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *objects, *field, *key;
    if (!PyArg_ParseTuple(args, "O!UU", &PyList_Type, &objects, &field, &key)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(objects);
    Field f = {field, NULL, 0, 0};
    if (n) {
        PyTypeObject *type = Py_TYPE(PyList_GET_ITEM(objects, 0));
        Py_ssize_t off = member_offset(type, field);
        if (off >= 0) { f.type = type; f.offset = off; }
    }
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = PyList_GET_ITEM(objects, i), *d;
        if (f.type && Py_TYPE(obj) == f.type) {
            d = *(PyObject **)((char *)obj + f.offset);
            if (!d) { PyErr_SetObject(PyExc_AttributeError, field); goto fail; }
            Py_INCREF(d);
        } else if (!(d = PyObject_GetAttr(obj, field))) {
            goto fail;
        }
        if (!PyDict_CheckExact(d)) { Py_DECREF(d); PyErr_SetString(PyExc_TypeError, "not a dict"); goto fail; }
        PyObject *v = PyDict_GetItemWithError(d, key); /* borrowed; a str key's hash is cached */
        int hit = v && PyUnicode_Check(v);
        Py_DECREF(d);
        if (!v && PyErr_Occurred()) goto fail;
        if (hit) {
            PyObject *row = PyLong_FromSsize_t(i);
            if (!row || PyList_Append(out, row) < 0) { Py_XDECREF(row); goto fail; }
            Py_DECREF(row);
        }
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *with_parents(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *objects, *cls, *field, *cleared;
    Py_buffer rb, pb;
    if (!PyArg_ParseTuple(args, "O!y*y*O!UO!", &PyList_Type, &objects, &rb, &pb, &PyType_Type, &cls, &field, &PyTuple_Type,
                          &cleared))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t *offs = NULL, count = 0;
    Py_ssize_t n = PyList_GET_SIZE(objects), m = rb.len / (Py_ssize_t)sizeof(int64_t), nc = PyTuple_GET_SIZE(cleared);
    const int64_t *rows = rb.buf, *parents = pb.buf;
    if (rb.len != pb.len || rb.len % (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "rows and parents must be int64 arrays of one length");
        goto done;
    }
    PyTypeObject *type = (PyTypeObject *)cls;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (rows[i] < 0 || rows[i] >= n) { PyErr_SetString(PyExc_ValueError, "a row out of range"); goto done; }
        if (Py_TYPE(PyList_GET_ITEM(objects, rows[i])) != type) { PyErr_SetString(PyExc_TypeError, "an object not of cls"); goto done; }
    }
    {
        PyMemberDef *members = type->tp_members; /* the __slots__, NULL-terminated */
        count = 0;
        while (members && members[count].name) count++;
        if (!(type->tp_flags & Py_TPFLAGS_HEAPTYPE) || type->tp_base != &PyBaseObject_Type || type->tp_dictoffset ||
            type->tp_weaklistoffset) {
            PyErr_SetString(PyExc_TypeError, "not a plain class with __slots__");
            goto done;
        }
        /* offs: the members to copy, then the field, then the cleared ones */
        offs = PyMem_Calloc(count + 1 + nc, sizeof(Py_ssize_t));
        if (!offs) { PyErr_NoMemory(); goto done; }
        for (Py_ssize_t j = 0; j < count; j++) {
            if (members[j].type != T_OBJECT_EX) { PyErr_SetString(PyExc_TypeError, "a member that is no object slot"); goto done; }
            offs[j] = members[j].offset;
        }
        offs[count] = member_offset(type, field);
        for (Py_ssize_t j = 0; j < nc; j++) {
            PyObject *name = PyTuple_GET_ITEM(cleared, j);
            offs[count + 1 + j] = PyUnicode_Check(name) ? member_offset(type, name) : -1;
        }
        for (Py_ssize_t j = count; j < count + 1 + nc; j++)
            if (offs[j] < 0) { PyErr_SetString(PyExc_TypeError, "no such slot"); goto done; }
    }
    out = PyList_GetSlice(objects, 0, n);
    if (!out) goto done;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *src = PyList_GET_ITEM(objects, rows[i]);
        PyObject *parent = parents[i] < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(parents[i]);
        if (!parent) { Py_CLEAR(out); goto done; }
        PyObject *copy = type->tp_alloc(type, 0);
        if (!copy) { Py_DECREF(parent); Py_CLEAR(out); goto done; }
        for (Py_ssize_t j = 0; j < count; j++) {
            PyObject *v = *(PyObject **)((char *)src + offs[j]);
            Py_XINCREF(v);
            *(PyObject **)((char *)copy + offs[j]) = v;
        }
        PyObject **slot = (PyObject **)((char *)copy + offs[count]);
        Py_XSETREF(*slot, parent);
        for (Py_ssize_t j = 0; j < nc; j++) {
            slot = (PyObject **)((char *)copy + offs[count + 1 + j]);
            Py_XSETREF(*slot, Py_NewRef(Py_None));
        }
        PyList_SetItem(out, rows[i], copy); /* steals copy; drops the list's reference to src */
    }
done:
    PyMem_Free(offs);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&pb);
    return out;
}

static PyMethodDef methods[] = {
    {"containers", containers, METH_VARARGS,
     "containers(ordered, track, start, end, level, user, user_holder, out): each row's innermost container row on its "
     "track, into out."},
    {"lanes", lanes, METH_VARARGS, "lanes(ordered, track, start, end, out): each row's lane on its track, into out."},
    {"columns", span_columns, METH_VARARGS,
     "columns(objects, names, nullable, out): attribute names[k] of objects[i] into the int64 out[k * n + i] (None: "
     "-1 where bit k of nullable is set)."},
    {"str_rows", str_rows, METH_VARARGS,
     "str_rows(objects, field, key): rows of the objects whose attribute field (a dict) holds a str under key."},
    {"with_parents", with_parents, METH_VARARGS,
     "with_parents(objects, rows, parents, cls, field, cleared): a copy of the list, objects[rows[i]] replaced by a copy "
     "with field = parents[i] (-1: None) and the cleared slots None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_sweep", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__sweep(void) { return PyModule_Create(&moddef); }

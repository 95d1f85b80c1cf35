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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

static PyMethodDef methods[] = {
    {"containers", containers, METH_VARARGS,
     "containers(ordered, track, start, end, level, user, user_holder, out): each row's innermost container row on its "
     "track, into out."},
    {"lanes", lanes, METH_VARARGS, "lanes(ordered, track, start, end, out): each row's lane on its track, into out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_sweep", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__sweep(void) { return PyModule_Create(&moddef); }

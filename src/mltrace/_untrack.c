/* Takes a finished span out of the cyclic garbage collector's lists.
 *
 * untrack_span(span) -> bool
 *     Untracks the span object and, where nothing in them could take part in a reference
 *     cycle, its attributes' containers: the dict, and the lists, tuples and dicts in it
 *     (torch.Size and other tuple subclasses without an instance dict among them), down to
 *     MAX_DEPTH levels. A container holding anything else the collector tracks (an object
 *     of some other class, a container nested deeper) stays tracked, and so do the
 *     containers that hold it. Returns whether the whole attribute tree was untracked.
 *
 * untrack_record(record) -> None
 *     Untracks a list and the tuples in it, whatever they hold: for a record of mltrace's own
 *     that nothing else refers to, so that no reference cycle can pass through it (a model
 *     call's frame, which its layer calls' frames keep until the flusher drains them).
 *
 * A finished span waits in the recorder's queue until the flusher drains it, a few hundred
 * milliseconds; meanwhile each of the program's young collections would find it alive and
 * promote it, and the oldest generation's growth would bring a full collection (a hundred
 * milliseconds and more with a framework loaded) into the program's thread. Untracked, the
 * span and its attributes are freed by reference counting when the flusher drops them, as
 * before. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define MAX_DEPTH 4

/* 1 where o is a list, dict or tuple (or a tuple subclass without an instance dict) whose
 * every item is either no object the collector tracks or such a container itself, untracked
 * now (each of those is untracked here too); 0 otherwise, o left tracked. */
static int untrack_tree(PyObject *o, int depth) {
    if (!PyObject_IS_GC(o) || !PyObject_GC_IsTracked(o)) return 1;
    if (depth >= MAX_DEPTH) return 0;
    int all = 1;
    if (PyList_CheckExact(o)) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o); i++) all &= untrack_tree(PyList_GET_ITEM(o, i), depth + 1);
    } else if (PyTuple_CheckExact(o) || (PyTuple_Check(o) && Py_TYPE(o)->tp_dictoffset == 0)) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); i++) all &= untrack_tree(PyTuple_GET_ITEM(o, i), depth + 1);
    } else if (PyDict_CheckExact(o)) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(o, &pos, &key, &value)) all &= untrack_tree(key, depth + 1) & untrack_tree(value, depth + 1);
    } else {
        return 0;
    }
    if (all) PyObject_GC_UnTrack(o);
    return all;
}

static PyObject *s_attrs;

static PyObject *untrack_span(PyObject *module, PyObject *span) {
    PyObject *attrs = PyObject_GetAttr(span, s_attrs);
    if (!attrs) return NULL;
    int all = untrack_tree(attrs, 0);
    Py_DECREF(attrs);
    if (PyObject_IS_GC(span) && PyObject_GC_IsTracked(span)) PyObject_GC_UnTrack(span);
    return PyBool_FromLong(all);
}

static PyObject *untrack_record(PyObject *module, PyObject *record) {
    if (!PyList_Check(record)) {
        PyErr_SetString(PyExc_TypeError, "untrack_record: a list is needed");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(record); i++) {
        PyObject *item = PyList_GET_ITEM(record, i);
        if (PyTuple_CheckExact(item) && PyObject_GC_IsTracked(item)) PyObject_GC_UnTrack(item);
    }
    if (PyObject_GC_IsTracked(record)) PyObject_GC_UnTrack(record);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"untrack_span", untrack_span, METH_O, "Untracks a finished span and its attributes' containers."},
    {"untrack_record", untrack_record, METH_O, "Untracks a list of mltrace's own and the tuples in it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_untrack", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__untrack(void) {
    s_attrs = PyUnicode_InternFromString("attrs");
    if (!s_attrs) return NULL;
    return PyModule_Create(&moddef);
}

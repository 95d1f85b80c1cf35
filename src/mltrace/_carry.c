/* CarriedCall: a function called with context variables set around the call, in C.
 *
 * tracer/sources/asyncio_executor.py hands the executor of loop.run_in_executor a
 * CarriedCall(func, ((var, value), ...)) in place of func: in the worker thread it sets each
 * var to its value (mltrace's current span, the OpenTelemetry parent the awaiting task saw),
 * calls func, and resets the vars to what they were, whatever func did. Being C, it adds no
 * Python frame: an exception's traceback and the stack the function sees are those of the
 * call without mltrace. The function's result or exception always reaches the caller; a
 * reset that fails (func changed context, which it cannot from the same thread) is dropped.
 * The Python class of the same name in asyncio_executor.py does the same where this is not
 * built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *func;
    PyObject *pairs; /* tuple of (ContextVar, value) tuples */
} CarriedCall;

static int carried_traverse(CarriedCall *self, visitproc visit, void *arg) {
    Py_VISIT(self->func);
    Py_VISIT(self->pairs);
    return 0;
}

static int carried_clear(CarriedCall *self) {
    Py_CLEAR(self->func);
    Py_CLEAR(self->pairs);
    return 0;
}

static void carried_dealloc(CarriedCall *self) {
    PyObject_GC_UnTrack(self);
    carried_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int carried_init(CarriedCall *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"func", "pairs", NULL};
    PyObject *func, *pairs;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!:CarriedCall", keywords, &func, &PyTuple_Type, &pairs))
        return -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(pairs); i++) {
        PyObject *pair = PyTuple_GET_ITEM(pairs, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyContextVar_CheckExact(PyTuple_GET_ITEM(pair, 0))) {
            PyErr_SetString(PyExc_TypeError, "pairs must be (ContextVar, value) tuples");
            return -1;
        }
    }
    Py_INCREF(func);
    Py_INCREF(pairs);
    Py_XSETREF(self->func, func);
    Py_XSETREF(self->pairs, pairs);
    return 0;
}

/* Resets vars[0..count) in reverse order with their tokens, keeping the pending exception. */
static void reset_all(PyObject *pairs, PyObject **tokens, Py_ssize_t count) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    for (Py_ssize_t i = count - 1; i >= 0; i--) {
        if (PyContextVar_Reset(PyTuple_GET_ITEM(PyTuple_GET_ITEM(pairs, i), 0), tokens[i]) < 0)
            PyErr_Clear();
        Py_DECREF(tokens[i]);
    }
    PyErr_Restore(type, value, traceback);
}

static PyObject *carried_call(CarriedCall *self, PyObject *args, PyObject *kwargs) {
    if (self->func == NULL || self->pairs == NULL) {
        PyErr_SetString(PyExc_TypeError, "CarriedCall was not initialised");
        return NULL;
    }
    PyObject *pairs = self->pairs;
    Py_INCREF(pairs);
    Py_ssize_t n = PyTuple_GET_SIZE(pairs);
    PyObject **tokens = PyMem_Malloc(sizeof(PyObject *) * (size_t)(n > 0 ? n : 1));
    if (tokens == NULL) {
        Py_DECREF(pairs);
        return PyErr_NoMemory();
    }
    Py_ssize_t set = 0;
    for (; set < n; set++) {
        PyObject *pair = PyTuple_GET_ITEM(pairs, set);
        tokens[set] = PyContextVar_Set(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1));
        if (tokens[set] == NULL)
            break;
    }
    PyObject *result = NULL;
    if (set == n)
        result = PyObject_Call(self->func, args, kwargs);
    else /* mltrace's own failure: the function is called as it would be without it */
        PyErr_Clear();
    reset_all(pairs, tokens, set);
    if (set < n)
        result = PyObject_Call(self->func, args, kwargs);
    PyMem_Free(tokens);
    Py_DECREF(pairs);
    return result;
}

static PyMemberDef carried_members[] = {
    {"func", T_OBJECT, offsetof(CarriedCall, func), READONLY, "the function called"},
    {"pairs", T_OBJECT, offsetof(CarriedCall, pairs), READONLY, "the (ContextVar, value) pairs set around the call"},
    {NULL},
};

static PyTypeObject CarriedCallType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mltrace._carry.CarriedCall",
    .tp_basicsize = sizeof(CarriedCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "CarriedCall(func, pairs): func called with each (ContextVar, value) of pairs set, reset after.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)carried_init,
    .tp_dealloc = (destructor)carried_dealloc,
    .tp_traverse = (traverseproc)carried_traverse,
    .tp_clear = (inquiry)carried_clear,
    .tp_call = (ternaryfunc)carried_call,
    .tp_members = carried_members,
};

static struct PyModuleDef carry_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mltrace._carry",
    .m_doc = "A function called with context variables set around the call (see _carry.c).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__carry(void) {
    if (PyType_Ready(&CarriedCallType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&carry_module);
    if (module == NULL)
        return NULL;
    Py_INCREF(&CarriedCallType);
    if (PyModule_AddObject(module, "CarriedCall", (PyObject *)&CarriedCallType) < 0) {
        Py_DECREF(&CarriedCallType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}

/* The layer level's Module.__call__ hot path in C, and (at the end) the flusher's encoder of
 * the frames it makes.
 *
 * TorchModuleSource (tracer/sources/torch_modules.py) installs a LayerCall as
 * torch.nn.Module.__call__. For a nested module call it does what the Python
 * wrapper in _wrap_call_layers does: push a frame
 *   [module, parent frame, id, start ns, end ns, input shapes, output shapes, None, None]
 * on the thread's stack, call the module, end the frame whatever happened, and
 * hand it to the source's deque; the flusher turns frames into spans. The Python wrapper's
 * frame is a list; this one is a LayerFrame, which reads and writes as the same sequence of
 * nine items but keeps the ids and times as C integers and one tensor's shape and dtype
 * inline, so that a call leaves one small object (not tracked by the cyclic garbage
 * collector) instead of a list, three ints, two torch.Size objects and two pairs until the
 * drain. Where torch's Module._call_impl would only call forward (no hooks, no JIT trace:
 * forward_directly), the call is module.forward(...) itself, a Python frame less than torch's
 * own __call__. The outermost call of a thread (the model span) goes to the Python wrapper
 * (`outer`), whose frame is a list. Shapes are kept inline for one tensor, else raw, as
 * raw_shapes returns them. Times are CLOCK_MONOTONIC ns, time.monotonic_ns().
 * mltrace's own failures after the call (a shape that cannot be read) are
 * dropped; the module's own result or exception always reaches the caller.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#define HAVE_DLFCN 1
#endif

/* ---- LayerFrame: one nested module call ---------------------------------------------- */

#define MAX_DIMS 8

/* A frame's input or output shapes: one tensor inline (ndim >= 0: dims and dtype), or `raw`
 * (what raw_shapes returned, or a (shape, dtype) pair whose sizes are not all ints), or
 * nothing (ndim < 0, raw NULL). */
typedef struct {
    int ndim;
    PyObject *raw, *dtype;
    long long dims[MAX_DIMS];
} Shapes;

typedef struct {
    PyObject_HEAD
    PyObject *module, *parent, *kid, *root; /* kid and root: NULL until the drain places the frame */
    long long id, start, end;               /* end: -1 while the call runs */
    Shapes in, out;
    PyObject *site_code;                    /* the call site's code object (NULL: none found) */
    int site_lasti;                         /* and its instruction offset in bytes, as frame.f_lasti */
} LayerFrame;

/* Items of a frame; F_SPAN is the model frame's (a list's) alone, F_SITE the call site. */
enum { F_MODULE, F_PARENT, F_ID, F_START, F_END, F_IN, F_OUT, F_KID, F_ROOT, F_LEN, F_SPAN = F_LEN, F_SITE };

static PyTypeObject LayerFrameType;

static LayerFrame *frame_new(void) {
    LayerFrame *f = PyObject_Malloc(sizeof(LayerFrame));
    if (!f) { PyErr_NoMemory(); return NULL; }
    PyObject_Init((PyObject *)f, &LayerFrameType);
    f->module = f->parent = f->kid = f->root = NULL;
    f->id = f->start = 0;
    f->end = -1;
    f->in.ndim = f->out.ndim = -1;
    f->in.raw = f->in.dtype = f->out.raw = f->out.dtype = NULL;
    f->site_code = NULL;
    f->site_lasti = -1;
    return f;
}

static void shapes_clear(Shapes *s) {
    Py_CLEAR(s->raw); Py_CLEAR(s->dtype);
    s->ndim = -1;
}

static void frame_dealloc(LayerFrame *f) {
    Py_XDECREF(f->module); Py_XDECREF(f->parent); Py_XDECREF(f->kid); Py_XDECREF(f->root);
    shapes_clear(&f->in); shapes_clear(&f->out);
    Py_XDECREF(f->site_code);
    PyObject_Free(f);
}

/* The raw form of s, as the Python wrapper keeps it: (shape tuple, dtype) for one tensor
 * (a tuple of ints where the wrapper has a torch.Size: equal, with the same hash), the raw
 * object, or None. New reference. */
static PyObject *shapes_raw(const Shapes *s) {
    if (s->raw) return Py_NewRef(s->raw);
    if (s->ndim < 0) return Py_NewRef(Py_None);
    PyObject *dims = PyTuple_New(s->ndim);
    if (!dims) return NULL;
    for (int i = 0; i < s->ndim; i++) {
        PyObject *d = PyLong_FromLongLong(s->dims[i]);
        if (!d) { Py_DECREF(dims); return NULL; }
        PyTuple_SET_ITEM(dims, i, d);
    }
    PyObject *pair = PyTuple_Pack(2, dims, s->dtype);
    Py_DECREF(dims);
    return pair;
}

/* 1 where s holds shapes (as truth of the Python wrapper's raw form), 0 if not, -1 on error. */
static int shapes_present(const Shapes *s) {
    if (s->raw) return PyObject_IsTrue(s->raw);
    return s->ndim >= 0;
}

static Py_ssize_t frame_length(PyObject *self) { return F_SITE + 1; }

/* The call site as the Python wrapper keeps it: (code, instruction offset), or None. New reference. */
static PyObject *site_pair(const LayerFrame *f) {
    if (!f->site_code) return Py_NewRef(Py_None);
    return Py_BuildValue("(Oi)", f->site_code, f->site_lasti);
}

static PyObject *frame_item(PyObject *self, Py_ssize_t i) {
    LayerFrame *f = (LayerFrame *)self;
    switch (i) {
    case F_MODULE: return Py_NewRef(f->module ? f->module : Py_None);
    case F_PARENT: return Py_NewRef(f->parent ? f->parent : Py_None);
    case F_ID: return PyLong_FromLongLong(f->id);
    case F_START: return PyLong_FromLongLong(f->start);
    case F_END: return PyLong_FromLongLong(f->end);
    case F_IN: return shapes_raw(&f->in);
    case F_OUT: return shapes_raw(&f->out);
    case F_KID: return Py_NewRef(f->kid ? f->kid : Py_None);
    case F_ROOT: return Py_NewRef(f->root ? f->root : Py_None);
    case F_SPAN: return Py_NewRef(Py_None);
    case F_SITE: return site_pair(f);
    default: PyErr_SetString(PyExc_IndexError, "layer frame index out of range"); return NULL;
    }
}

static int set_int(long long *field, PyObject *v) {
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    *field = x;
    return 0;
}

static void set_object(PyObject **field, PyObject *v) {
    Py_XSETREF(*field, v == Py_None ? NULL : Py_NewRef(v));
}

static int frame_ass_item(PyObject *self, Py_ssize_t i, PyObject *v) {
    LayerFrame *f = (LayerFrame *)self;
    if (v == NULL) { PyErr_SetString(PyExc_TypeError, "layer frame items cannot be deleted"); return -1; }
    switch (i) {
    case F_MODULE: set_object(&f->module, v); return 0;
    case F_PARENT: set_object(&f->parent, v); return 0;
    case F_ID: return set_int(&f->id, v);
    case F_START: return set_int(&f->start, v);
    case F_END: return set_int(&f->end, v);
    case F_IN: case F_OUT: {
        Shapes *s = i == F_IN ? &f->in : &f->out;
        shapes_clear(s);
        if (v != Py_None) s->raw = Py_NewRef(v);
        return 0;
    }
    case F_KID: set_object(&f->kid, v); return 0;
    case F_ROOT: set_object(&f->root, v); return 0;
    case F_SITE: {
        PyObject *code; int lasti;
        if (v != Py_None && !PyArg_ParseTuple(v, "O!i", &PyCode_Type, &code, &lasti)) return -1;
        Py_CLEAR(f->site_code);
        if (v != Py_None) { f->site_code = Py_NewRef(code); f->site_lasti = lasti; }
        return 0;
    }
    default: PyErr_SetString(PyExc_IndexError, "layer frame index out of range"); return -1;
    }
}

static PySequenceMethods frame_as_sequence = {
    .sq_length = frame_length,
    .sq_item = frame_item,
    .sq_ass_item = frame_ass_item,
};

static PyTypeObject LayerFrameType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mltrace._layercall.LayerFrame",
    .tp_basicsize = sizeof(LayerFrame),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)frame_dealloc,
    .tp_as_sequence = &frame_as_sequence,
    .tp_doc = "A nested module call of the layer level, read and written as the 11-item frame list of "
              "torch_modules.py (module, parent, id, start, end, in, out, kid, root, None, site).",
};

/* ---- LayerCall: Module.__call__ ------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *tls, *new_stack, *outer, *raw_shapes, *tensor_type, *next_id, *append_frame, *original;
    int direct;
    /* Calling forward() itself where torch's Module._call_impl would do nothing else (see
     * forward_directly): that function (NULL: never), the tracing check (torch._C._is_tracing,
     * else _get_tracing_state), and the globals _call_impl reads the global hook dicts from. */
    PyObject *call_impl, *tracing_state, *hook_globals;
    /* Call sites: `internal` maps code objects to whether they are a framework's (True) or model
     * code, and `classify(code)` adds one it lacks (TorchModuleSource._is_framework_code). NULL:
     * no call sites recorded. */
    PyObject *internal, *classify;
    /* A callable that is true while a compiler traces the program (TorchDynamo), or NULL. Then
     * class-level access (`nn.Module.__call__`, which Dynamo inlines for every submodule call)
     * gives `original`: Dynamo cannot trace this C function, and would break the graph there. */
    PyObject *compiling, *bound, *owner;  /* owner: the class this is installed on (borrowed use only) */
    /* raw_shapes with any JIT trace of the thread paused (a read inside one is recorded as
     * aten::size nodes in the program's graph), for calls inside a trace; NULL: no shapes there. */
    PyObject *untraced_shapes;
    /* The calling thread's stack (a borrowed reference): TorchModuleSource._stacks keeps every
     * thread's stack alive while this object lives (it holds new_stack, a method of the source),
     * and a thread's stack is never replaced. A thread's first call finds it in tls. */
    Py_tss_t stack_key;
    /* torch.Tensor's shape and dtype getters, called without the attribute lookup (which,
     * between convolutions, misses the caches), or NULL where either is not a plain getter. */
    getter get_shape, get_dtype;
    void *shape_closure, *dtype_closure;
    /* next_id's iterator (next_id.__self__, whose __next__ it is), stepped through its type's
     * tp_iternext without the method wrapper's call; NULL: next_id is called. */
    PyObject *id_iter;
} LayerCall;

static PyObject *s_stack, *s_shape, *s_dtype, *s_call_impl, *s_compiled, *s_forward;
/* What Module._call_impl checks before its early `return forward_call(*args, **kwargs)`:
 * the module's own hook dicts, then the module-global ones. */
static const char *const HOOK_ATTRS[] = {"_backward_hooks", "_backward_pre_hooks", "_forward_hooks", "_forward_pre_hooks"};
static const char *const HOOK_GLOBALS[] = {"_global_backward_pre_hooks", "_global_backward_hooks", "_global_forward_hooks",
                                           "_global_forward_pre_hooks"};
static PyObject *s_hook_attrs[4], *s_hook_globals[4];

/* f(arg) for f a builtin method (deque.append): its C function itself where its flags allow
 * (METH_O with an argument, METH_NOARGS without), else the generic call (pybind11 functions,
 * such as torch's tracing check, take that). New reference, or NULL with an error. */
static PyObject *call_builtin(PyObject *f, PyObject *arg) {
    if (PyCFunction_Check(f)) {
        int flags = PyCFunction_GET_FLAGS(f) & ~(METH_COEXIST | METH_STATIC | METH_CLASS);
        if (arg ? flags == METH_O : flags == METH_NOARGS)
            return PyCFunction_GET_FUNCTION(f)(PyCFunction_GET_SELF(f), arg);
    }
    return arg ? PyObject_CallOneArg(f, arg) : PyObject_CallNoArgs(f);
}

static inline long long clock_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Untracks a raw form a frame keeps until the flusher drains it (tuples and lists of
 * shapes): none of it can be part of a reference cycle, and the cyclic garbage collector
 * would otherwise traverse every live one in each collection of the program's objects. */
static void untrack(PyObject *o) {
    if (PyList_Check(o)) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o); i++) untrack(PyList_GET_ITEM(o, i));
    } else if (PyTuple_Check(o)) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); i++) untrack(PyTuple_GET_ITEM(o, i));
    } else {
        return;
    }
    if (PyObject_GC_IsTracked(o)) PyObject_GC_UnTrack(o);
}

/* One tensor's shape and dtype into s: inline where every size is an int (eager mode), else
 * as a raw (shape, dtype) pair. 0, or -1 with an error (a nested tensor has no shape). The
 * torch.Size is dropped at once: it is freed while still in the caches, and nothing tracked
 * by the garbage collector outlives the call. */
static int read_shapes(LayerCall *self, PyObject *tensor, Shapes *s) {
    int direct = self->get_shape != NULL;
    PyObject *shape = direct ? self->get_shape(tensor, self->shape_closure) : PyObject_GetAttr(tensor, s_shape);
    if (!shape) return -1;
    PyObject *dtype = direct ? self->get_dtype(tensor, self->dtype_closure) : PyObject_GetAttr(tensor, s_dtype);
    if (!dtype) { Py_DECREF(shape); return -1; }
    Py_ssize_t n = PyTuple_Check(shape) ? PyTuple_GET_SIZE(shape) : MAX_DIMS + 1;
    int inline_ok = n <= MAX_DIMS;
    for (Py_ssize_t i = 0; inline_ok && i < n; i++) {
        PyObject *d = PyTuple_GET_ITEM(shape, i);
        long long v = PyLong_CheckExact(d) ? PyLong_AsLongLong(d) : -1;
        if (v < 0) { PyErr_Clear(); inline_ok = 0; }  /* a size that is a 0-dim tensor (JIT tracing) or symbolic */
        else s->dims[i] = v;
    }
    if (inline_ok) {
        s->ndim = (int)n;
        s->dtype = dtype;  /* a torch.dtype singleton */
        Py_DECREF(shape);
        return 0;
    }
    s->raw = PyTuple_Pack(2, shape, dtype);
    Py_DECREF(shape); Py_DECREF(dtype);
    if (!s->raw) return -1;
    untrack(s->raw);
    return 0;
}

/* Appends tensor's (shape, dtype) pair to out, as raw_shapes lists it: 0, also where the
 * tensor has no shape (a nested tensor: left out, its error cleared), -1 on another error. */
static int append_pair(LayerCall *self, PyObject *tensor, PyObject *out) {
    int direct = self->get_shape != NULL;
    PyObject *shape = direct ? self->get_shape(tensor, self->shape_closure) : PyObject_GetAttr(tensor, s_shape);
    if (!shape) {
        if (!PyErr_ExceptionMatches(PyExc_RuntimeError)) return -1;
        PyErr_Clear();
        return 0;
    }
    PyObject *dtype = direct ? self->get_dtype(tensor, self->dtype_closure) : PyObject_GetAttr(tensor, s_dtype);
    if (!dtype) { Py_DECREF(shape); return -1; }
    PyObject *pair = PyTuple_Pack(2, shape, dtype);
    Py_DECREF(shape); Py_DECREF(dtype);
    if (!pair) return -1;
    int r = PyList_Append(out, pair);
    Py_DECREF(pair);
    return r;
}

/* How walk_item treats a value: a plain tensor, another tensor (a subclass: raw_shapes reads
 * it in Python), or no tensor. -1 on error. */
enum { NOT_TENSOR, PLAIN_TENSOR, OTHER_TENSOR };
static int tensor_kind(LayerCall *self, PyObject *v) {
    if (Py_TYPE(v) == (PyTypeObject *)self->tensor_type) return PLAIN_TENSOR;
    if (PyLong_CheckExact(v) || PyFloat_CheckExact(v) || PyUnicode_CheckExact(v) || PyBool_Check(v) || v == Py_None) return NOT_TENSOR;
    int is = PyObject_IsInstance(v, self->tensor_type);
    return is < 0 ? -1 : (is ? OTHER_TENSOR : NOT_TENSOR);
}

/* One item of a tuple, list or dict that raw_shapes walks, into out: a tensor's pair, or the
 * pairs of the tensors in a tuple or list (one level down). 0 done, 1 where raw_shapes must
 * read the whole value in Python (a tensor subclass, a tuple or list subclass), -1 on error. */
static int walk_item(LayerCall *self, PyObject *v, PyObject *out) {
    int kind = tensor_kind(self, v);
    if (kind == PLAIN_TENSOR) return append_pair(self, v, out);
    if (kind != NOT_TENSOR) return kind < 0 ? -1 : 1;
    if (!PyTuple_CheckExact(v) && !PyList_CheckExact(v)) {
        return (PyTuple_Check(v) || PyList_Check(v)) ? 1 : 0;
    }
    PyObject *items = PySequence_Fast(v, "");  /* the list itself, or the tuple: a new reference */
    if (!items) return -1;
    int r = 0;
    for (Py_ssize_t i = 0; r == 0 && i < PySequence_Fast_GET_SIZE(items); i++) {
        PyObject *w = PySequence_Fast_GET_ITEM(items, i);
        int k = tensor_kind(self, w);
        r = k == PLAIN_TENSOR ? append_pair(self, w, out) : (k == OTHER_TENSOR ? 1 : (k < 0 ? -1 : 0));
    }
    Py_DECREF(items);
    return r;
}

/* raw_shapes(value) for the values it takes apart itself: a tuple, list or dict (not a
 * subclass) of plain tensors, and tuples and lists of them; a new list of (shape, dtype)
 * pairs. NULL without an error where raw_shapes must read it in Python, NULL with one on
 * error. Any other value that is no tensor has none: an empty list. */
static PyObject *walk_raw_shapes(LayerCall *self, PyObject *value) {
    int tuple_or_list = PyTuple_CheckExact(value) || PyList_CheckExact(value);
    if (!tuple_or_list && !PyDict_CheckExact(value)) {
        int kind = tensor_kind(self, value);
        if (kind < 0) return NULL;
        if (kind != NOT_TENSOR || PyTuple_Check(value) || PyList_Check(value) || PyDict_Check(value)) return NULL;
        return PyList_New(0);
    }
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    int r = 0;
    if (tuple_or_list) {
        PyObject *items = PySequence_Fast(value, "");
        if (!items) { Py_DECREF(out); return NULL; }
        for (Py_ssize_t i = 0; r == 0 && i < PySequence_Fast_GET_SIZE(items); i++) r = walk_item(self, PySequence_Fast_GET_ITEM(items, i), out);
        Py_DECREF(items);
    } else {
        Py_ssize_t pos = 0;
        PyObject *key, *item;
        while (r == 0 && PyDict_Next(value, &pos, &key, &item)) r = walk_item(self, item, out);
    }
    if (r != 0) Py_CLEAR(out);  /* 1: raw_shapes reads it; -1: the error stays set */
    return out;
}

/* The shapes of a call's arguments (args[1:]) or output into s; errors are cleared (no shapes). */
static void read_value_shapes(LayerCall *self, PyObject *value, Shapes *s) {
    if (Py_TYPE(value) == (PyTypeObject *)self->tensor_type) {
        if (read_shapes(self, value, s) < 0) PyErr_Clear();
        return;
    }
    PyObject *raw = walk_raw_shapes(self, value);
    if (!raw && !PyErr_Occurred()) raw = PyObject_CallOneArg(self->raw_shapes, value);
    if (!raw) { PyErr_Clear(); return; }
    untrack(raw);
    s->raw = raw;
}

/* What untraced_shapes returns for value (args[1:] or the output) into s, as raw shapes; nothing
 * where there is no such function or it fails (cleared). */
static void read_untraced_shapes(LayerCall *self, PyObject *value, Shapes *s) {
    if (!self->untraced_shapes) return;
    PyObject *raw = PyObject_CallOneArg(self->untraced_shapes, value);
    if (!raw) { PyErr_Clear(); return; }
    untrack(raw);
    s->raw = raw;
}

/* object.__getattribute__ (borrowed from object's type dict): a module whose class keeps it
 * reads its attributes as below; one that overrides it gets no instance dict (NULL). */
static PyObject *s_getattribute, *object_getattribute;

/* module.<name> (new reference, or NULL with an error), read from the instance's own `dict`
 * where it holds the name and the type has no data descriptor of that name (what attribute
 * lookup would find first); else the full lookup. nn.Module keeps its hook dicts and
 * _compiled_call_impl in the instance dict; reading them there spares the generic lookup,
 * which goes through Module.__getattr__'s slot on every read. */
static PyObject *instance_attr(PyObject *module, PyObject *dict, PyObject *name, int no_descr) {
    if (dict) {
        PyObject *v = PyDict_GetItemWithError(dict, name);  /* borrowed */
        if (v) {
            PyObject *descr = no_descr ? NULL : _PyType_Lookup(Py_TYPE(module), name);
            if (descr == NULL || Py_TYPE(descr)->tp_descr_set == NULL) return Py_NewRef(v);
        } else if (PyErr_Occurred()) {
            return NULL;
        }
    }
    return PyObject_GetAttr(module, name);
}

/* What the hot path looks up on a module's class, by class and version tag (a class changed
 * since gets a new tag; tags are not reused): whether it keeps object.__getattribute__,
 * whether none of _compiled_call_impl and the hook dicts' names is a data descriptor on it, its
 * _call_impl and its forward where that is a plain function (both borrowed: the class's dict
 * holds them while the tag stands). Direct-mapped; a class without a valid tag is looked up
 * on every call. */
typedef struct {
    PyTypeObject *type;
    unsigned int version;
    int generic, no_descr;
    PyObject *call_impl, *forward;
} TypeFacts;
#define TYPE_SLOTS 256
static TypeFacts type_slots[TYPE_SLOTS];

static TypeFacts type_facts(PyTypeObject *t) {
    TypeFacts *slot = &type_slots[((uintptr_t)t >> 4) % TYPE_SLOTS];
    if (slot->type == t && PyType_HasFeature(t, Py_TPFLAGS_VALID_VERSION_TAG) && slot->version == t->tp_version_tag) return *slot;
    TypeFacts facts = {NULL, 0, 0, 1, NULL, NULL};
    facts.generic = _PyType_Lookup(t, s_getattribute) == object_getattribute;
    for (int i = 0; i < 5; i++) {
        PyObject *descr = _PyType_Lookup(t, i < 4 ? s_hook_attrs[i] : s_compiled);
        if (descr && Py_TYPE(descr)->tp_descr_set != NULL) facts.no_descr = 0;
    }
    facts.call_impl = _PyType_Lookup(t, s_call_impl);
    PyObject *forward = _PyType_Lookup(t, s_forward);
    facts.forward = forward && PyFunction_Check(forward) ? forward : NULL;
    if (PyType_HasFeature(t, Py_TPFLAGS_VALID_VERSION_TAG) && t->tp_version_tag != 0) {  /* the lookups gave it one */
        facts.type = t;
        facts.version = t->tp_version_tag;
        *slot = facts;
    }
    return facts;
}

/* module.forward(*args) (args[0] is the module): the class's plain Python function called
 * with the module as its first argument, as the bound method would, where the module has an
 * instance dict as instance_attr reads it (so no __getattribute__ of its own) that does not
 * shadow it; else the method call. */
static PyObject *call_forward(PyObject *module, PyObject *dict, const TypeFacts *facts, PyObject *const *args, size_t nargsf,
                              PyObject *kwnames) {
    PyObject *func = NULL;  /* borrowed; the facts' only while the class is unchanged since */
    PyTypeObject *t = Py_TYPE(module);
    if (dict && facts->type == t && PyType_HasFeature(t, Py_TPFLAGS_VALID_VERSION_TAG) && t->tp_version_tag == facts->version) {
        func = facts->forward;
    } else if (dict) {
        func = _PyType_Lookup(t, s_forward);
        if (func && !PyFunction_Check(func)) func = NULL;
    }
    if (func) {
        int shadowed = PyDict_Contains(dict, s_forward);
        if (shadowed == 0) {
            Py_INCREF(func);  /* held across the call, whatever it rebinds */
            PyObject *out = PyObject_Vectorcall(func, args, nargsf & ~PY_VECTORCALL_ARGUMENTS_OFFSET, kwnames);
            Py_DECREF(func);
            return out;
        }
        if (shadowed < 0) PyErr_Clear();
    }
    return PyObject_VectorcallMethod(s_forward, args, nargsf, kwnames);
}

/* libtorch's torch::jit::tracer::getTracingState(), where bind_tracing_state found it: it
 * returns a reference to this thread's std::shared_ptr<TracingState>, whose first word is the
 * state's address (libstdc++ and libc++ lay it out so), NULL while no trace is recorded. One
 * call and a load instead of a pybind11 call (torch._C._is_tracing) per module call. */
typedef void *const *(*TracingStateFn)(void);
static TracingStateFn tracing_state_fn = NULL;

/* 1 where a JIT trace is being recorded on this thread (libtorch's state where bound, else
 * torch's tracing check; also where that check fails), 0 where none is or where this hot path
 * has neither (no forward_check). */
static int jit_tracing(LayerCall *self) {
    if (tracing_state_fn != NULL) return *tracing_state_fn() != NULL;
    if (self->tracing_state == NULL) return 0;
    PyObject *tracing = call_builtin(self->tracing_state, NULL);
    int traced = tracing ? PyObject_IsTrue(tracing) : -1;
    Py_XDECREF(tracing);
    if (traced < 0) { PyErr_Clear(); return 1; }
    return traced;
}

/* 1 where torch's Module._call_impl, called now on `module`, would do nothing but
 * `return self.forward(*args, **kwargs)`: it is the module's _call_impl (no subclass overrides
 * it), no JIT trace is being recorded (`traced`, else it calls _slow_forward), and no hook
 * dict, the module's or a global one, has an entry. Then the hot path calls forward itself and
 * spares the Python frame, which torch's own __call__ pays too. 0 otherwise (or on any error). */
static int forward_directly(LayerCall *self, PyObject *module, PyObject *dict, const TypeFacts *facts, int traced) {
    if (self->call_impl == NULL || facts->call_impl != self->call_impl || traced) return 0;
    for (int i = 0; i < 4; i++) {
        PyObject *hooks = instance_attr(module, dict, s_hook_attrs[i], facts->no_descr);
        int some = hooks ? PyObject_IsTrue(hooks) : -1;
        Py_XDECREF(hooks);
        if (some != 0) { PyErr_Clear(); return 0; }
    }
    for (int i = 0; i < 4; i++) {
        PyObject *hooks = PyDict_GetItemWithError(self->hook_globals, s_hook_globals[i]);  /* borrowed */
        int some = hooks ? PyObject_IsTrue(hooks) : -1;
        if (some != 0) { PyErr_Clear(); return 0; }
    }
    return 1;
}

/* What is_framework_code found last, direct-mapped by the code object's address: a dict lookup
 * would hash the code object (its name, bytecode and constants) on every module call. A slot
 * holds its code object, so an address it compares cannot be reused meanwhile. */
#define CODE_SLOTS 1024
typedef struct { PyObject *code; int inside; } CodeSlot;
static CodeSlot code_slots[CODE_SLOTS];

/* 1 where `code` is a framework's (never a call site), 0 where it is model code, -1 on error. */
static int is_framework_code(LayerCall *self, PyObject *code) {
    uintptr_t h = (uintptr_t)code >> 4;
    CodeSlot *slot = &code_slots[(h ^ (h >> 10)) % CODE_SLOTS];
    if (slot->code == code) return slot->inside;
    int inside;
    PyObject *known = PyDict_GetItemWithError(self->internal, code);  /* borrowed */
    if (known) {
        inside = PyObject_IsTrue(known);
    } else if (PyErr_Occurred()) {
        return -1;
    } else {
        PyObject *r = PyObject_CallOneArg(self->classify, code);
        inside = r ? PyObject_IsTrue(r) : -1;
        Py_XDECREF(r);
    }
    if (inside >= 0) {
        Py_XSETREF(slot->code, Py_NewRef(code));
        slot->inside = inside;
    }
    return inside;
}

#if PY_VERSION_HEX < 0x030B0000
static int PyFrame_GetLasti(PyFrameObject *frame) { return frame->f_lasti * (int)sizeof(_Py_CODEUNIT); }
#endif

/* The call site of this module call into f: the code object (new reference) and instruction
 * offset of the innermost Python frame that is not a framework's, as _site_of does; nothing
 * where none is found within 256 frames or on any error (cleared). */
static void find_site(LayerCall *self, LayerFrame *f) {
    if (!self->internal) return;
    PyFrameObject *frame = PyEval_GetFrame();  /* borrowed: the frame that made this call */
    Py_XINCREF(frame);
    for (int depth = 0; frame && depth < 256; depth++) {
        PyCodeObject *code = PyFrame_GetCode(frame);
        int inside = is_framework_code(self, (PyObject *)code);
        if (inside == 0) {
            f->site_code = (PyObject *)code;
            f->site_lasti = PyFrame_GetLasti(frame);
            Py_DECREF(frame);
            return;
        }
        Py_DECREF(code);
        if (inside < 0) break;
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        frame = back;
    }
    Py_XDECREF(frame);
    PyErr_Clear();
}

static PyObject *layer_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    LayerCall *self = (LayerCall *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1) return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    PyObject *module = args[0];
    PyObject *stack = PyThread_tss_get(&self->stack_key);
    if (stack) {
        Py_INCREF(stack);
    } else {
        stack = PyObject_GetAttr(self->tls, s_stack);
        if (!stack) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
            PyErr_Clear();
            stack = PyObject_CallNoArgs(self->new_stack);
            if (!stack) return NULL;
        }
        if (PyList_CheckExact(stack) && PyThread_tss_set(&self->stack_key, stack) != 0) {
            Py_DECREF(stack);
            PyErr_SetString(PyExc_RuntimeError, "mltrace: thread-specific storage failed");
            return NULL;
        }
    }
    if (!PyList_CheckExact(stack) || PyList_GET_SIZE(stack) == 0) {
        Py_DECREF(stack);
        return PyObject_Vectorcall(self->outer, args, nargsf, kwnames);
    }
    LayerFrame *frame = frame_new();
    if (!frame) { Py_DECREF(stack); return NULL; }
    /* Inside a JIT trace a shape read is recorded as aten::size nodes in the program's graph:
     * the call's shapes are read with the trace paused then (untraced_shapes). */
    int traced = jit_tracing(self);
    if (!traced && nargs == 2 && Py_TYPE(args[1]) == (PyTypeObject *)self->tensor_type) {
        read_value_shapes(self, args[1], &frame->in);
    } else if (nargs >= 2) {  /* raw_shapes of the arguments' tuple, as the Python wrapper */
        PyObject *t = PyTuple_New(nargs - 1);
        if (!t) { Py_DECREF(frame); Py_DECREF(stack); return NULL; }
        for (Py_ssize_t i = 1; i < nargs; i++) PyTuple_SET_ITEM(t, i - 1, Py_NewRef(args[i]));
        if (traced) read_untraced_shapes(self, t, &frame->in);
        else read_value_shapes(self, t, &frame->in);
        Py_DECREF(t);
    }
    find_site(self, frame);
    PyObject *id = self->id_iter ? Py_TYPE(self->id_iter)->tp_iternext(self->id_iter) : PyObject_CallNoArgs(self->next_id);
    if (!id && !PyErr_Occurred()) PyErr_SetNone(PyExc_StopIteration);
    if (!id || set_int(&frame->id, id) < 0) { Py_XDECREF(id); Py_DECREF(frame); Py_DECREF(stack); return NULL; }
    Py_DECREF(id);
    frame->start = clock_ns();
    frame->module = Py_NewRef(module);
    frame->parent = Py_NewRef(PyList_GET_ITEM(stack, PyList_GET_SIZE(stack) - 1));
    if (PyList_Append(stack, (PyObject *)frame) < 0) { Py_DECREF(frame); Py_DECREF(stack); return NULL; }

    PyObject *output = NULL;
    int use_direct = 0;
    PyObject *dict = NULL;  /* the module's instance dict, where it has one */
    TypeFacts facts = {NULL, 0, 0, 0, NULL, NULL};
    /* Under a profile function (torch.profiler's with_stack, cProfile), torch's own __call__:
     * the profiler then sees the frames it sees without mltrace, and torch.profiler tells
     * module calls by the frames of Module.__call__'s code (this object's __code__). */
    if (self->direct && PyThreadState_Get()->c_profilefunc == NULL) {
        facts = type_facts(Py_TYPE(module));
        if (facts.generic) {
            dict = PyObject_GenericGetDict(module, NULL);
            if (!dict) PyErr_Clear();
        }
        PyObject *compiled = instance_attr(module, dict, s_compiled, facts.no_descr);
        if (compiled) { use_direct = compiled == Py_None; Py_DECREF(compiled); }
        else PyErr_Clear();
    }
    if (use_direct && forward_directly(self, module, dict, &facts, traced)) output = call_forward(module, dict, &facts, args, nargsf, kwnames);
    else if (use_direct) output = PyObject_VectorcallMethod(s_call_impl, args, nargsf, kwnames);
    else output = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    Py_XDECREF(dict);

    /* finally: end the frame whatever happened, keeping the call's exception */
    frame->end = clock_ns();
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    Py_ssize_t n;
    while ((n = PyList_GET_SIZE(stack)) > 0) {  /* pop up to ours, as list.pop() without the call */
        PyObject *top = PyList_GET_ITEM(stack, n - 1);
        Py_SET_SIZE(stack, n - 1);
        Py_DECREF(top);
        if (top == (PyObject *)frame) break;
    }
    if (output && output != Py_None) {
        if (traced) read_untraced_shapes(self, output, &frame->out);
        else read_value_shapes(self, output, &frame->out);
    }
    PyObject *r = call_builtin(self->append_frame, (PyObject *)frame);
    Py_XDECREF(r);
    PyErr_Clear();  /* mltrace's own failures never reach the program */
    PyErr_Restore(et, ev, tb);
    Py_DECREF(frame);
    Py_DECREF(stack);
    return output;
}

static PyObject *layer_call(PyObject *callable, PyObject *args, PyObject *kwargs) {
    return PyVectorcall_Call(callable, args, kwargs);
}

/* Whether a compiler traces or exports now (`compiling()` is true); errors count as no. */
static int layer_compiling(LayerCall *lc) {
    if (!lc->compiling) return 0;
    PyObject *r = PyObject_CallNoArgs(lc->compiling);
    int yes = r ? PyObject_IsTrue(r) : 0;
    Py_XDECREF(r);
    PyErr_Clear();
    return yes > 0;
}

/* `Module.__call__` and `module.__call__` read as attributes. A call `module(x)` does not read
 * them (the type's call slot calls this object directly), so they only decide what code that
 * takes the attribute gets:
 * - from nn.Module itself (`owner`): this object, always (torch.fx saves and restores
 *   `nn.Module.__call__` around its tracing, also inside a compiler's);
 * - from a subclass: this object, except while a compiler traces (`compiling` is true): then
 *   torch's own. TorchDynamo inlines the module class's `__call__` at every submodule call
 *   of the graph it builds and cannot trace this C function: it would break the graph there;
 * - from an instance: `bound` (a Python function that calls this object, or torch's own
 *   under a compiler), bound to the module, where given; else this object, bound.
 *   torch.compile keeps `model.__call__` as the function it compiles. While a compiler
 *   traces or exports, this object, bound: `module.__call__.__func__ is nn.Module.__call__`
 *   holds then, as without mltrace, which is how TorchDynamo and strict torch.export tell
 *   that a module has no `__call__` of its own and start from its `forward`. */
static PyObject *layer_get(PyObject *self, PyObject *obj, PyObject *type) {
    LayerCall *lc = (LayerCall *)self;
    if (obj != NULL && obj != Py_None) return PyMethod_New(lc->bound && !layer_compiling(lc) ? lc->bound : self, obj);
    if (type != lc->owner && layer_compiling(lc)) return Py_NewRef(lc->original);
    return Py_NewRef(self);
}

static int layer_traverse(LayerCall *self, visitproc visit, void *arg) {
    Py_VISIT(self->tls); Py_VISIT(self->new_stack); Py_VISIT(self->outer); Py_VISIT(self->raw_shapes);
    Py_VISIT(self->tensor_type); Py_VISIT(self->next_id); Py_VISIT(self->append_frame); Py_VISIT(self->original);
    Py_VISIT(self->call_impl); Py_VISIT(self->tracing_state); Py_VISIT(self->hook_globals);
    Py_VISIT(self->internal); Py_VISIT(self->classify); Py_VISIT(self->compiling); Py_VISIT(self->bound); Py_VISIT(self->owner); Py_VISIT(self->id_iter);
    Py_VISIT(self->untraced_shapes);
    return 0;
}
static int layer_clear(LayerCall *self) {
    Py_CLEAR(self->tls); Py_CLEAR(self->new_stack); Py_CLEAR(self->outer); Py_CLEAR(self->raw_shapes);
    Py_CLEAR(self->tensor_type); Py_CLEAR(self->next_id); Py_CLEAR(self->append_frame); Py_CLEAR(self->original);
    Py_CLEAR(self->call_impl); Py_CLEAR(self->tracing_state); Py_CLEAR(self->hook_globals);
    Py_CLEAR(self->internal); Py_CLEAR(self->classify); Py_CLEAR(self->compiling); Py_CLEAR(self->bound); Py_CLEAR(self->owner); Py_CLEAR(self->id_iter);
    Py_CLEAR(self->untraced_shapes);
    return 0;
}
static void layer_dealloc(LayerCall *self) {
    PyObject_GC_UnTrack(self);
    if (PyThread_tss_is_created(&self->stack_key)) PyThread_tss_delete(&self->stack_key);
    layer_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *layer_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"tls", "new_stack", "outer", "raw_shapes", "tensor_type", "next_id", "append_frame", "original", "direct",
                         "forward_check", "internal", "classify", "compiling", "bound", "owner", "untraced_shapes", NULL};
    PyObject *o[8], *forward_check = Py_None, *internal = Py_None, *classify = Py_None, *compiling = Py_None, *bound = Py_None;
    PyObject *owner = Py_None, *untraced_shapes = Py_None;
    int direct;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOOp|OOOOOOO", kw, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &direct,
                                     &forward_check, &internal, &classify, &compiling, &bound, &owner, &untraced_shapes))
        return NULL;
    if ((compiling != Py_None && !PyCallable_Check(compiling)) || (bound != Py_None && !PyCallable_Check(bound))
        || (untraced_shapes != Py_None && !PyCallable_Check(untraced_shapes))) {
        PyErr_SetString(PyExc_TypeError, "compiling, bound and untraced_shapes must be callable");
        return NULL;
    }
    if ((internal == Py_None) != (classify == Py_None) || (internal != Py_None && (!PyDict_Check(internal) || !PyCallable_Check(classify)))) {
        PyErr_SetString(PyExc_TypeError, "internal (a dict) and classify (a callable) come together");
        return NULL;
    }
    if (!PyType_Check(o[4])) { PyErr_SetString(PyExc_TypeError, "tensor_type must be a type"); return NULL; }
    PyObject *call_impl = NULL, *tracing_state = NULL, *hook_globals = NULL;
    if (forward_check != Py_None
        && (!PyArg_ParseTuple(forward_check, "OOO!", &call_impl, &tracing_state, &PyDict_Type, &hook_globals)
            || !PyCallable_Check(tracing_state))) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "forward_check: (call_impl, tracing_state, hook_globals)");
        return NULL;
    }
    LayerCall *self = (LayerCall *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->stack_key = (Py_tss_t)Py_tss_NEEDS_INIT;
    if (PyThread_tss_create(&self->stack_key) != 0) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_RuntimeError, "mltrace: no thread-specific storage key left");
        return NULL;
    }
    /* On the type, a getset descriptor's attribute is the descriptor itself; its PyGetSetDef is
     * static in torch's extension, which stays loaded. */
    PyObject *shape = PyObject_GetAttr(o[4], s_shape), *dtype = shape ? PyObject_GetAttr(o[4], s_dtype) : NULL;
    if (shape && dtype && Py_IS_TYPE(shape, &PyGetSetDescr_Type) && Py_IS_TYPE(dtype, &PyGetSetDescr_Type)) {
        PyGetSetDef *s = ((PyGetSetDescrObject *)shape)->d_getset, *d = ((PyGetSetDescrObject *)dtype)->d_getset;
        if (s->get && d->get) {
            self->get_shape = s->get; self->shape_closure = s->closure;
            self->get_dtype = d->get; self->dtype_closure = d->closure;
        }
    }
    Py_XDECREF(shape); Py_XDECREF(dtype);
    PyErr_Clear();  /* no plain getters: the attribute lookup it is */
    self->vectorcall = layer_vectorcall;
    self->tls = Py_NewRef(o[0]); self->new_stack = Py_NewRef(o[1]); self->outer = Py_NewRef(o[2]);
    self->raw_shapes = Py_NewRef(o[3]); self->tensor_type = Py_NewRef(o[4]); self->next_id = Py_NewRef(o[5]);
    self->append_frame = Py_NewRef(o[6]); self->original = Py_NewRef(o[7]); self->direct = direct;
    self->call_impl = Py_XNewRef(call_impl); self->tracing_state = Py_XNewRef(tracing_state);
    self->hook_globals = Py_XNewRef(hook_globals);
    if (internal != Py_None) { self->internal = Py_NewRef(internal); self->classify = Py_NewRef(classify); }
    if (compiling != Py_None) self->compiling = Py_NewRef(compiling);
    if (untraced_shapes != Py_None) self->untraced_shapes = Py_NewRef(untraced_shapes);
    if (bound != Py_None) self->bound = Py_NewRef(bound);
    if (owner != Py_None) self->owner = Py_NewRef(owner);
    /* next_id as a bound __next__ of an iterator (itertools.count's): step it directly */
    PyObject *it = PyObject_GetAttrString(o[5], "__self__");
    PyObject *name = it ? PyObject_GetAttrString(o[5], "__name__") : NULL;
    if (it && name && PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "__next__") == 0
        && Py_TYPE(it)->tp_iternext != NULL && Py_TYPE(it)->tp_iternext != &_PyObject_NextNotImplemented)
        self->id_iter = Py_NewRef(it);
    Py_XDECREF(it); Py_XDECREF(name);
    PyErr_Clear();
    return (PyObject *)self;
}

/* The replaced __call__'s code object: torch's Python tracer (a profiler with with_stack=True)
 * reads nn.Module.__call__.__code__ to tell module calls apart, and failed on this object. */
static PyObject *layer_code(PyObject *self, void *closure) {
    return PyObject_GetAttrString(((LayerCall *)self)->original, "__code__");
}

/* The replaced __call__ itself (inspect.signature follows __wrapped__: `inspect.signature(model)`
 * found no signature on this object), and its names. */
static PyObject *layer_wrapped(PyObject *self, void *closure) { return Py_NewRef(((LayerCall *)self)->original); }
static PyObject *layer_name(PyObject *self, void *closure) { return PyObject_GetAttrString(((LayerCall *)self)->original, "__name__"); }
static PyObject *layer_qualname(PyObject *self, void *closure) {
    return PyObject_GetAttrString(((LayerCall *)self)->original, "__qualname__");
}

static PyGetSetDef layer_getset[] = {
    {"__code__", layer_code, NULL, "the replaced Module.__call__'s code object", NULL},
    {"__wrapped__", layer_wrapped, NULL, "the replaced Module.__call__", NULL},
    {"__name__", layer_name, NULL, "the replaced Module.__call__'s name", NULL},
    {"__qualname__", layer_qualname, NULL, "the replaced Module.__call__'s qualified name", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject LayerCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mltrace._layercall.LayerCall",
    .tp_getset = layer_getset,
    .tp_basicsize = sizeof(LayerCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_vectorcall_offset = offsetof(LayerCall, vectorcall),
    .tp_call = layer_call,
    .tp_descr_get = layer_get,
    .tp_new = layer_new,
    .tp_traverse = (traverseproc)layer_traverse,
    .tp_clear = (inquiry)layer_clear,
    .tp_dealloc = (destructor)layer_dealloc,
    .tp_doc = "Module.__call__ for the layer level: pushes a frame per nested module call (see torch_modules.py).",
};

/* ---- encode_rows: the flusher's side, frames → events.jsonl rows -------------------------
 *
 * encode_rows(frames, place, shapes_json, in_cache, out_cache, templates, next_template, level, site_json)
 *   -> (template rows, span rows)
 * does what TorchModuleSource._encode_rows_python does, for a list of completed frames
 * (LayerFrames, or the Python wrapper's lists). What
 * the calls of one layer share (its path, attributes and shapes) is a span template, written
 * once as  [template id,path,{attributes,"code.file.path":…,"ml.input.shapes":…,…}]  and kept in `templates`
 * (key: the five encodings, the call site's from site_json(code, lasti); value: the id from
 * next_template()); each frame then gets the row
 *   [id,parent id,level,null,start,end,track,{},template id]
 * Both come back as comma-separated rows. A frame's cache entry comes from its parent's cache
 * (placed(), the common case) or else from place(frame); the shape encodings of a LayerFrame's
 * inline shapes come from shape_texts (below), else from in_cache/out_cache (one-tensor
 * forms), else from shapes_json(raw, cache, kind). If a frame
 * fails, the templates this call added are taken out of `templates` again: rows written later
 * must not refer to a template that never reached the file. In Python the same took ≈ 2 µs a
 * frame, about a third of it formatting. */

typedef struct { char *data; Py_ssize_t len, cap; int nogil; } Buf;

/* Appends n bytes; -1 where memory ran out (with MemoryError set, except in a Buf marked
 * `nogil`, whose writer runs without the GIL and sets it once it holds the GIL again). Raw
 * allocations, which need no GIL. */
static int buf_put(Buf *b, const char *s, Py_ssize_t n) {
    if (b->len + n > b->cap) {
        Py_ssize_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n) cap *= 2;
        char *d = PyMem_RawRealloc(b->data, cap);
        if (!d) { if (!b->nogil) PyErr_NoMemory(); return -1; }
        b->data = d; b->cap = cap;
    }
    memcpy(b->data + b->len, s, n);
    b->len += n;
    return 0;
}

static int buf_str(Buf *b, PyObject *o) {
    if (!PyUnicode_Check(o)) { PyErr_SetString(PyExc_TypeError, "expected an encoded str"); return -1; }
    Py_ssize_t n; const char *s = PyUnicode_AsUTF8AndSize(o, &n);
    return s ? buf_put(b, s, n) : -1;
}

static int buf_ll(Buf *b, long long v, char after) {
    char tmp[24];  /* digits written backwards from the end; snprintf cost more than the rest of a row */
    char *p = tmp + sizeof tmp;
    *--p = after;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do { *--p = (char)('0' + u % 10); u /= 10; } while (u);
    if (v < 0) *--p = '-';
    return buf_put(b, p, tmp + sizeof tmp - p);
}

static int buf_int(Buf *b, PyObject *o, char after) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    return buf_ll(b, v, after);
}

/* The numbers of one span row, read under the GIL and formatted without it (encode_rows). */
typedef struct { long long id, parent_id, start, end, track, tid; } RowNums;

/* An int object's value into *v: 0, or -1 with an error. */
static int as_ll(PyObject *o, long long *v) {
    *v = PyLong_AsLongLong(o);
    return *v == -1 && PyErr_Occurred() ? -1 : 0;
}

static PyObject *s_track_id, *s_input, *s_output, *s_empty, *s_kids, *s_ref;

/* Frames of either kind: a LayerFrame, or a list of at least 9 items. */
static inline int is_layer_frame(PyObject *f) { return Py_IS_TYPE(f, &LayerFrameType); }
static inline int is_frame(PyObject *f) { return is_layer_frame(f) || (PyList_CheckExact(f) && PyList_GET_SIZE(f) >= F_LEN); }

/* Item i of a frame (module, parent, kid, root): borrowed, Py_None where a LayerFrame has none. */
static PyObject *frame_object(PyObject *f, int i) {
    if (!is_layer_frame(f)) return PyList_GET_ITEM(f, i);
    LayerFrame *lf = (LayerFrame *)f;
    PyObject *o = i == F_MODULE ? lf->module : i == F_PARENT ? lf->parent : i == F_KID ? lf->kid : lf->root;
    return o ? o : Py_None;
}

/* Sets item i (kid or root) of a frame to o; steals o. */
static void frame_put(PyObject *f, int i, PyObject *o) {
    if (!is_layer_frame(f)) { PyList_SetItem(f, i, o); return; }
    LayerFrame *lf = (LayerFrame *)f;
    Py_XSETREF(*(i == F_KID ? &lf->kid : &lf->root), o);
}

/* Item i of a frame (id, start, end) into *v: 0, or -1 with an error. */
static int frame_int(PyObject *f, int i, long long *v) {
    if (is_layer_frame(f)) {
        LayerFrame *lf = (LayerFrame *)f;
        *v = i == F_ID ? lf->id : i == F_START ? lf->start : lf->end;
        return 0;
    }
    *v = PyLong_AsLongLong(PyList_GET_ITEM(f, i));
    return *v == -1 && PyErr_Occurred() ? -1 : 0;
}

/* Shape encodings of inline shapes, by kind (input, output): a direct-mapped cache keyed by
 * (dims, dtype), so that the drain neither builds nor hashes a tuple for the common frame. The
 * text depends on nothing else, so the cache serves every session of the process; a slot
 * holds its dtype and text until another shape takes it. */
#define TEXT_SLOTS 512
typedef struct {
    int ndim;
    PyObject *dtype, *text;
    long long dims[MAX_DIMS];
} TextSlot;
static TextSlot shape_texts[2][TEXT_SLOTS];

static TextSlot *text_slot(int kind, const Shapes *s) {
    uint64_t h = 1469598103934665603ULL ^ (uint64_t)(uintptr_t)s->dtype;
    h = (h ^ (uint64_t)s->ndim) * 1099511628211ULL;
    for (int i = 0; i < s->ndim; i++) h = (h ^ (uint64_t)s->dims[i]) * 1099511628211ULL;
    return &shape_texts[kind][(h ^ (h >> 31)) % TEXT_SLOTS];
}

/* The shape encoding of raw (a list frame's IN or OUT, or a LayerFrame's raw form), or NULL
 * with an error; new reference. */
static PyObject *shapes_text(PyObject *raw, PyObject *cache, PyObject *shapes_json, PyObject *kind) {
    if (PyTuple_CheckExact(raw)) {
        PyObject *hit = PyDict_GetItemWithError(cache, raw);
        if (hit) return Py_NewRef(hit);
        if (PyErr_Occurred()) return NULL;
    }
    return PyObject_CallFunctionObjArgs(shapes_json, raw, cache, kind, NULL);
}

/* The shape encoding of item IN or OUT of frame f ("" where it has none); new reference. */
static PyObject *frame_shapes_text(PyObject *f, int i, PyObject *cache, PyObject *shapes_json) {
    PyObject *kind = i == F_IN ? s_input : s_output;
    if (!is_layer_frame(f)) {
        PyObject *raw = PyList_GET_ITEM(f, i);
        int has = PyObject_IsTrue(raw);
        if (has < 0) return NULL;
        return has ? shapes_text(raw, cache, shapes_json, kind) : Py_NewRef(s_empty);
    }
    const Shapes *s = i == F_IN ? &((LayerFrame *)f)->in : &((LayerFrame *)f)->out;
    int has = shapes_present(s);
    if (has <= 0) return has < 0 ? NULL : Py_NewRef(s_empty);
    if (s->raw) return shapes_text(s->raw, cache, shapes_json, kind);
    TextSlot *slot = text_slot(i == F_OUT, s);
    if (slot->text && slot->ndim == s->ndim && slot->dtype == s->dtype
        && memcmp(slot->dims, s->dims, sizeof(long long) * (size_t)s->ndim) == 0)
        return Py_NewRef(slot->text);
    PyObject *raw = shapes_raw(s);
    PyObject *text = raw ? shapes_text(raw, cache, shapes_json, kind) : NULL;
    Py_XDECREF(raw);
    if (!text) return NULL;
    if (!PyUnicode_Check(text)) return text;  /* buf_str says why */
    Py_XSETREF(slot->text, Py_NewRef(text));
    Py_XSETREF(slot->dtype, Py_NewRef(s->dtype));
    slot->ndim = s->ndim;
    memcpy(slot->dims, s->dims, sizeof(long long) * (size_t)s->ndim);
    return text;
}

/* Call-site encodings (site_json(code, lasti)) by code object and offset, direct-mapped; a slot
 * holds its code object, so an address it compares cannot be reused meanwhile. */
#define SITE_SLOTS 1024
typedef struct { PyObject *code, *text; int lasti; } SiteSlot;
static SiteSlot site_slots[SITE_SLOTS];

/* The call-site encoding of frame f ("" where it has none); new reference. */
static PyObject *frame_site_text(PyObject *f, PyObject *site_json) {
    PyObject *code = NULL; int lasti = -1;
    if (is_layer_frame(f)) {
        code = ((LayerFrame *)f)->site_code;
        lasti = ((LayerFrame *)f)->site_lasti;
    } else if (PyList_GET_SIZE(f) > F_SITE) {
        PyObject *site = PyList_GET_ITEM(f, F_SITE);
        if (site != Py_None && !PyArg_ParseTuple(site, "O!i", &PyCode_Type, &code, &lasti)) return NULL;
    }
    if (!code) return Py_NewRef(s_empty);
    uintptr_t h = ((uintptr_t)code >> 4) * 31 + (uintptr_t)lasti;
    SiteSlot *slot = &site_slots[(h ^ (h >> 10)) % SITE_SLOTS];
    if (slot->text && slot->code == code && slot->lasti == lasti) return Py_NewRef(slot->text);
    PyObject *text = PyObject_CallFunction(site_json, "Oi", code, lasti);
    if (!text || !PyUnicode_Check(text)) return text;  /* buf_str says why */
    Py_XSETREF(slot->code, Py_NewRef(code));
    Py_XSETREF(slot->text, Py_NewRef(text));
    slot->lasti = lasti;
    return text;
}

/* Template ids by the addresses of (entry, call-site text, input text, output text), direct-mapped:
 * the common frame's template without building and hashing template_of's key of five strings.
 * The texts and entries come from the caches above, so a frame like the last one brings the same
 * objects. A slot holds them (an address it compares cannot be reused meanwhile) and the
 * `templates` dict it was found in: a session's own dict, whose ids only that session wrote.
 * clear_caches() empties it when a session stops, and a failed drain (whose new ids never
 * reached the file) empties it too. */
#define TEMPLATE_SLOTS 1024
typedef struct { PyObject *kid, *site, *in, *out, *templates, *tid; } TemplateSlot;
static TemplateSlot template_slots[TEMPLATE_SLOTS];

static TemplateSlot *template_slot(PyObject *kid, PyObject *site, PyObject *in, PyObject *out) {
    uintptr_t h = ((uintptr_t)kid >> 4);
    h = h * 31 + ((uintptr_t)site >> 4);
    h = h * 31 + ((uintptr_t)in >> 4);
    h = h * 31 + ((uintptr_t)out >> 4);
    return &template_slots[(h ^ (h >> 13)) % TEMPLATE_SLOTS];
}

static void clear_template_slots(void) {
    for (int i = 0; i < TEMPLATE_SLOTS; i++) {
        TemplateSlot *t = &template_slots[i];
        Py_CLEAR(t->kid); Py_CLEAR(t->site); Py_CLEAR(t->in); Py_CLEAR(t->out); Py_CLEAR(t->templates); Py_CLEAR(t->tid);
    }
}

/* The template id for (path, attributes, call site, input and output shapes): from `templates`,
 * or a new one, whose template row is appended to `defs` and whose key to `added`. New reference. */
static PyObject *template_of(PyObject *kid, PyObject *site_text, PyObject *in_text, PyObject *out_text, PyObject *templates,
                             PyObject *next_template, PyObject *added, Buf *defs) {
    TemplateSlot *slot = template_slot(kid, site_text, in_text, out_text);
    if (slot->tid && slot->kid == kid && slot->site == site_text && slot->in == in_text && slot->out == out_text
        && slot->templates == templates)
        return Py_NewRef(slot->tid);
    PyObject *key = PyTuple_Pack(5, PyTuple_GET_ITEM(kid, 3), PyTuple_GET_ITEM(kid, 4), site_text, in_text, out_text);
    if (!key) return NULL;
    PyObject *tid = PyDict_GetItemWithError(templates, key);
    if (tid) {
        Py_INCREF(tid);
    } else if (PyErr_Occurred()) {
        Py_DECREF(key);
        return NULL;
    } else {
        tid = PyObject_CallNoArgs(next_template);
        int ok = tid && PyDict_SetItem(templates, key, tid) == 0;
        ok = ok && PyList_Append(added, key) == 0;
        ok = ok && (defs->len == 0 || buf_put(defs, ",", 1) == 0) && buf_put(defs, "[", 1) == 0
            && buf_int(defs, tid, ',') == 0 && buf_str(defs, PyTuple_GET_ITEM(kid, 3)) == 0 && buf_put(defs, ",", 1) == 0
            && buf_str(defs, PyTuple_GET_ITEM(kid, 4)) == 0 && buf_str(defs, site_text) == 0 && buf_str(defs, in_text) == 0
            && buf_str(defs, out_text) == 0
            && buf_put(defs, "}]", 2) == 0;
        if (!ok) { Py_DECREF(key); Py_XDECREF(tid); return NULL; }
    }
    Py_DECREF(key);
    Py_XSETREF(slot->kid, Py_NewRef(kid)); Py_XSETREF(slot->site, Py_NewRef(site_text));
    Py_XSETREF(slot->in, Py_NewRef(in_text)); Py_XSETREF(slot->out, Py_NewRef(out_text));
    Py_XSETREF(slot->templates, Py_NewRef(templates)); Py_XSETREF(slot->tid, Py_NewRef(tid));
    return tid;
}

static int referent_is(PyObject *ref, PyObject *o) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *alive = NULL;
    if (PyWeakref_GetRef(ref, &alive) < 0) return 0;
    int same = alive == o;
    Py_XDECREF(alive);
    return same;
#else
    return PyWeakref_GetObject(ref) == o;  /* borrowed; Py_None once dead */
#endif
}

/* The weak reference of kid (a cache entry: path, facts, …): its facts' `ref`, or NULL (no
 * error) where it has none. New reference. */
static PyObject *kid_ref(PyObject *kid) {
    if (!PyTuple_Check(kid) || PyTuple_GET_SIZE(kid) < 5) return NULL;
    PyObject *ref = PyObject_GetAttr(PyTuple_GET_ITEM(kid, 1), s_ref);
    if (ref && !PyWeakref_CheckRef(ref)) Py_CLEAR(ref);
    PyErr_Clear();
    return ref;
}

/* 1 where kid is the entry of this live module: its facts' weak reference still points to it
 * (a dead module's address can be reused). */
static int kid_is_of(PyObject *kid, PyObject *module) {
    PyObject *ref = kid_ref(kid);
    int same = ref && referent_is(ref, module);
    Py_XDECREF(ref);
    return same;
}

/* The entries placed() found last, direct-mapped by (parent's entry, module): what facts.kids
 * would give, without building and hashing its (path, id) key. A slot holds both entries, so
 * an address it compares cannot be reused meanwhile; the module is compared by address and
 * checked by kid_is_of like any entry found. clear_caches() empties it when a session stops. */
#define PLACE_SLOTS 1024
typedef struct {
    PyObject *parent_kid, *kid, *ref;  /* ref: kid's weak reference (its facts' `ref`, set once) */
    void *module;
} PlaceSlot;
static PlaceSlot place_slots[PLACE_SLOTS];

static PlaceSlot *place_slot(PyObject *parent_kid, PyObject *module) {
    uintptr_t h = ((uintptr_t)parent_kid >> 4) * 31 + ((uintptr_t)module >> 4);
    return &place_slots[(h ^ (h >> 10)) % PLACE_SLOTS];
}

/* The child entry of `module` under parent_kid, from the slot or facts.kids; NULL (no error)
 * where neither has a live one. New reference. */
static PyObject *cached_kid(PyObject *parent_kid, PyObject *module) {
    PlaceSlot *slot = place_slot(parent_kid, module);
    if (slot->kid && slot->parent_kid == parent_kid && slot->module == (void *)module && referent_is(slot->ref, module))
        return Py_NewRef(slot->kid);
    PyObject *kids = PyObject_GetAttr(PyTuple_GET_ITEM(parent_kid, 1), s_kids);
    PyObject *key = NULL, *module_id = kids ? PyLong_FromVoidPtr(module) : NULL;
    if (module_id) key = PyTuple_Pack(2, PyTuple_GET_ITEM(parent_kid, 0), module_id);
    PyObject *hit = key && PyDict_Check(kids) ? PyDict_GetItemWithError(kids, key) : NULL;
    Py_XINCREF(hit);
    PyObject *found = hit && kid_is_of(hit, module) ? Py_NewRef(hit) : NULL;
    Py_XDECREF(hit);
    Py_XDECREF(kids); Py_XDECREF(module_id); Py_XDECREF(key);
    PyErr_Clear();  /* whatever failed here, place() does it again and says why */
    PyObject *ref = found ? kid_ref(found) : NULL;
    if (ref) {
        Py_XSETREF(slot->parent_kid, Py_NewRef(parent_kid));
        Py_XSETREF(slot->kid, Py_NewRef(found));
        Py_XSETREF(slot->ref, ref);
        slot->module = module;
    }
    return found;
}

/* A frame's cache entry (KID), as place(frame) gives it, without a call into Python where the
 * entry is already cached: the parent's entry (placed first, the same way) holds its children's
 * in facts.kids under (parent path, id(module)) (cached_kid). Sets KID and ROOT as
 * place() does. Anything else (no entry yet, a stale one, a frame of another shape) goes to
 * place(), which fills the cache. New reference, or NULL with an error. */
static PyObject *placed(PyObject *frame, PyObject *place, int depth) {
    PyObject *kid = frame_object(frame, F_KID);
    if (kid != Py_None) return Py_NewRef(kid);
    PyObject *parent = frame_object(frame, F_PARENT);
    if (depth > 64 || !is_frame(parent)) return PyObject_CallOneArg(place, frame);
    PyObject *parent_kid = placed(parent, place, depth + 1);
    if (!parent_kid) return NULL;
    PyObject *found = NULL;
    if (PyTuple_Check(parent_kid) && PyTuple_GET_SIZE(parent_kid) >= 2) found = cached_kid(parent_kid, frame_object(frame, F_MODULE));
    if (!found) { Py_DECREF(parent_kid); return PyObject_CallOneArg(place, frame); }
    PyObject *root = frame_object(parent, F_PARENT) == Py_None ? parent : frame_object(parent, F_ROOT);
    frame_put(frame, F_ROOT, Py_NewRef(root));
    frame_put(frame, F_KID, Py_NewRef(found));
    Py_DECREF(parent_kid);
    return found;
}

static PyObject *clear_caches(PyObject *mod, PyObject *unused) {
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < TEXT_SLOTS; i++) {
            Py_CLEAR(shape_texts[k][i].text);
            Py_CLEAR(shape_texts[k][i].dtype);
        }
    for (int i = 0; i < PLACE_SLOTS; i++) {
        Py_CLEAR(place_slots[i].parent_kid);
        Py_CLEAR(place_slots[i].kid);
        Py_CLEAR(place_slots[i].ref);
        place_slots[i].module = NULL;
    }
    for (int i = 0; i < SITE_SLOTS; i++) {
        Py_CLEAR(site_slots[i].code);
        Py_CLEAR(site_slots[i].text);
    }
    for (int i = 0; i < CODE_SLOTS; i++) Py_CLEAR(code_slots[i].code);
    clear_template_slots();
    Py_RETURN_NONE;
}

static PyObject *encode_rows(PyObject *mod, PyObject *args) {
    PyObject *frames, *place, *shapes_json, *in_cache, *out_cache, *templates, *next_template, *site_json; int level;
    if (!PyArg_ParseTuple(args, "O!OOO!O!O!OiO", &PyList_Type, &frames, &place, &shapes_json, &PyDict_Type, &in_cache,
                          &PyDict_Type, &out_cache, &PyDict_Type, &templates, &next_template, &level, &site_json))
        return NULL;
    PyObject *added = PyList_New(0);
    if (!added) return NULL;
    Buf b = {NULL, 0, 0, 1}, defs = {NULL, 0, 0, 0};
    char head[32];
    int head_n = snprintf(head, sizeof head, "%d,null,", level);
    /* Each row's numbers, formatted after the loop with the GIL given up: formatting is about
     * 40 % of a frame's encoding, and the program's thread runs meanwhile. */
    Py_ssize_t n_frames = PyList_GET_SIZE(frames);
    RowNums *nums = PyMem_RawMalloc(sizeof(RowNums) * (size_t)(n_frames ? n_frames : 1));
    if (!nums) { Py_DECREF(added); return PyErr_NoMemory(); }
    PyObject *last_root = NULL, *last_track = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(frames); i++) {
        PyObject *f = PyList_GET_ITEM(frames, i);
        if (!is_frame(f)) { PyErr_SetString(PyExc_TypeError, "not a layer frame"); goto fail; }
        PyObject *kid = placed(f, place, 0);
        if (!kid) goto fail;
        PyObject *in_text = NULL, *out_text = NULL, *site_text = NULL, *track = NULL, *tid = NULL;
        PyObject *parent = frame_object(f, F_PARENT), *root = frame_object(f, F_ROOT);
        long long id, parent_id, start, end;
        int ok = PyTuple_Check(kid) && PyTuple_GET_SIZE(kid) >= 5 && is_frame(parent) && PyList_Check(root)
            && PyList_GET_SIZE(root) > 9;
        if (!ok) PyErr_SetString(PyExc_TypeError, "not a placed layer frame");
        ok = ok && frame_int(f, F_ID, &id) == 0 && frame_int(parent, F_ID, &parent_id) == 0
            && frame_int(f, F_START, &start) == 0 && frame_int(f, F_END, &end) == 0;
        if (ok && root == last_root) {
            track = Py_NewRef(last_track);
        } else if (ok && (track = PyObject_GetAttr(PyList_GET_ITEM(root, 9), s_track_id)) != NULL) {
            last_root = root;  /* frames of one model call come together; `frames` keeps root alive */
            Py_XSETREF(last_track, Py_NewRef(track));
        }
        ok = ok && track != NULL;
        ok = ok && (in_text = frame_shapes_text(f, F_IN, in_cache, shapes_json)) != NULL;
        ok = ok && (out_text = frame_shapes_text(f, F_OUT, out_cache, shapes_json)) != NULL;
        ok = ok && (site_text = frame_site_text(f, site_json)) != NULL;
        ok = ok && (tid = template_of(kid, site_text, in_text, out_text, templates, next_template, added, &defs)) != NULL;
        RowNums *row = &nums[i];
        if (ok) { row->id = id; row->parent_id = parent_id; row->start = start; row->end = end; }
        ok = ok && as_ll(track, &row->track) == 0 && as_ll(tid, &row->tid) == 0;
        Py_DECREF(kid); Py_XDECREF(track); Py_XDECREF(in_text); Py_XDECREF(out_text); Py_XDECREF(site_text); Py_XDECREF(tid);
        if (!ok) goto fail;
    }
    Py_XDECREF(last_track);
    last_track = NULL;
    int formatted = 1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; formatted && i < n_frames; i++) {
        const RowNums *r = &nums[i];
        formatted = (b.len == 0 || buf_put(&b, ",", 1) == 0) && buf_put(&b, "[", 1) == 0
            && buf_ll(&b, r->id, ',') == 0 && buf_ll(&b, r->parent_id, ',') == 0
            && buf_put(&b, head, head_n) == 0 && buf_ll(&b, r->start, ',') == 0
            && buf_ll(&b, r->end, ',') == 0 && buf_ll(&b, r->track, ',') == 0
            && buf_put(&b, "{},", 3) == 0 && buf_ll(&b, r->tid, ']') == 0;
    }
    Py_END_ALLOW_THREADS
    if (!formatted) { PyErr_NoMemory(); goto fail; }
    PyObject *out = Py_BuildValue("(y#y#)", defs.data ? defs.data : "", defs.len, b.data ? b.data : "", b.len);
    if (!out) goto fail;
    PyMem_RawFree(b.data); PyMem_RawFree(defs.data); PyMem_RawFree(nums);
    Py_DECREF(added);
    return out;
fail:
    Py_XDECREF(last_track);
    PyMem_RawFree(b.data); PyMem_RawFree(defs.data); PyMem_RawFree(nums);
    {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(added); i++)
            if (PyDict_DelItem(templates, PyList_GET_ITEM(added, i)) < 0) PyErr_Clear();
        if (PyList_GET_SIZE(added)) clear_template_slots();  /* they may hold ids that were never written */
        PyErr_Restore(et, ev, tb);
    }
    Py_DECREF(added);
    return NULL;
}

static PyObject *s_clear;

/* Every item of `queue` (a collections.deque the hot paths append to), removed and returned as a
 * list, in one step: no other thread runs between the copy and the clear, since neither runs
 * Python code (the items stay referenced by the list, so clearing frees nothing). */
static PyObject *take_frames(PyObject *mod, PyObject *queue) {
    PyObject *items = PySequence_List(queue);
    if (!items) return NULL;
    PyObject *r = PyObject_CallMethodNoArgs(queue, s_clear);
    if (!r) { Py_DECREF(items); return NULL; }
    Py_DECREF(r);
    return items;
}

static PyObject *forget_templates(PyObject *mod, PyObject *unused) {
    clear_template_slots();
    Py_RETURN_NONE;
}

#define TRACING_STATE_SYMBOL "_ZN5torch3jit6tracer15getTracingStateEv"

/* bind_tracing_state(path): finds getTracingState in the library at `path` if the process has
 * loaded it already (never loads it); True where found (jit_tracing then reads it). None
 * unbinds it (the pybind11 check again). */
static PyObject *bind_tracing_state(PyObject *mod, PyObject *path) {
    (void)mod;
    if (path == Py_None) { tracing_state_fn = NULL; Py_RETURN_FALSE; }
    if (!PyUnicode_Check(path)) { PyErr_SetString(PyExc_TypeError, "bind_tracing_state(path: str | None)"); return NULL; }
#ifdef HAVE_DLFCN
    const char *c_path = PyUnicode_AsUTF8(path);
    if (!c_path) return NULL;
    void *lib = dlopen(c_path, RTLD_LAZY | RTLD_NOLOAD);
    if (lib) {
        void *sym = dlsym(lib, TRACING_STATE_SYMBOL);
        dlclose(lib);  /* the process keeps it loaded: RTLD_NOLOAD only took a reference */
        if (sym) {
            tracing_state_fn = (TracingStateFn)sym;
            Py_RETURN_TRUE;
        }
    }
#endif
    Py_RETURN_FALSE;
}

/* tracing_now(): whether a JIT trace is being recorded on this thread as the bound state says;
 * None where none is bound. */
static PyObject *tracing_now(PyObject *mod, PyObject *unused) {
    (void)mod; (void)unused;
    if (tracing_state_fn == NULL) Py_RETURN_NONE;
    return PyBool_FromLong(*tracing_state_fn() != NULL);
}

static PyMethodDef module_methods[] = {
    {"bind_tracing_state", bind_tracing_state, METH_O,
     "bind_tracing_state(path) -> bool: reads libtorch's JIT tracing state directly from the loaded library at path (None: no more)."},
    {"tracing_now", tracing_now, METH_NOARGS,
     "tracing_now() -> bool | None: whether this thread records a JIT trace, by the bound state (None: not bound)."},
    {"forget_templates", forget_templates, METH_NOARGS,
     "forget_templates() -> None: empties the template ids cached by address (when the templates dict starts over)."},
    {"take_frames", take_frames, METH_O,
     "take_frames(queue) -> list: every item of the deque, removed at once (no append from another thread falls between)."},
    {"encode_rows", encode_rows, METH_VARARGS,
     "encode_rows(frames, place, shapes_json, in_cache, out_cache, templates, next_template, level, site_json) -> (bytes, bytes): "
     "completed layer frames as events.jsonl template and span rows (see TorchModuleSource._encode_frames); "
     "the span rows' numbers are formatted with the GIL given up."},
    {"clear_caches", clear_caches, METH_NOARGS,
     "clear_caches() -> None: empties the process-wide caches of shape encodings, placed entries, call sites and code owners (at a session's stop)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_layercall", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__layercall(void) {
    if (PyType_Ready(&LayerCallType) < 0 || PyType_Ready(&LayerFrameType) < 0) return NULL;
    s_stack = PyUnicode_InternFromString("stack");
    s_shape = PyUnicode_InternFromString("shape");
    s_dtype = PyUnicode_InternFromString("dtype");
    s_call_impl = PyUnicode_InternFromString("_call_impl");
    s_compiled = PyUnicode_InternFromString("_compiled_call_impl");
    s_forward = PyUnicode_InternFromString("forward");
    s_getattribute = PyUnicode_InternFromString("__getattribute__");
    if (!s_getattribute) return NULL;
    object_getattribute = _PyType_Lookup(&PyBaseObject_Type, s_getattribute);
    if (!object_getattribute) { PyErr_SetString(PyExc_RuntimeError, "object.__getattribute__ not found"); return NULL; }
    for (int i = 0; i < 4; i++) {
        s_hook_attrs[i] = PyUnicode_InternFromString(HOOK_ATTRS[i]);
        s_hook_globals[i] = PyUnicode_InternFromString(HOOK_GLOBALS[i]);
        if (!s_hook_attrs[i] || !s_hook_globals[i]) return NULL;
    }
    s_track_id = PyUnicode_InternFromString("track_id");
    s_input = PyUnicode_InternFromString("input");
    s_output = PyUnicode_InternFromString("output");
    s_empty = PyUnicode_InternFromString("");
    s_kids = PyUnicode_InternFromString("kids");
    s_ref = PyUnicode_InternFromString("ref");
    s_clear = PyUnicode_InternFromString("clear");
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "LayerCall", (PyObject *)&LayerCallType) < 0
        || PyModule_AddObjectRef(m, "LayerFrame", (PyObject *)&LayerFrameType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

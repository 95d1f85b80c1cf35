/* Reads oneMKL's verbose lines for the library level's flusher (tracer/sources/cpu_library.py).
 *
 * scan(lines) -> (what, durations), two lists with one item per line; a line is a str, or a
 * tuple whose second item is the line's text (a TappedLine). what[i] is
 *   key      (a str) an MKL call: verbose_logs.mkl_call_key of its parts (the function, "\n",
 *            the arguments with each pointer field as "*", "\n", the text after the duration),
 *            and durations[i] its duration (ns) as split_mkl_line reads it;
 *   0        no call, and the library level counts it unparsed;
 *   1        no call, not counted (MKL's version header, an info line);
 *   2        undecided: Python reads the line (a oneDNN line, a character that is not
 *            printable ASCII, a duration in exponent form or past 63 bits).
 * durations[i] is 0 where what[i] is no key. Neither list holds an object the cyclic garbage
 * collector tracks (a tuple a line would set off a young collection every 700 lines).
 *
 * It reads a line as verbose_logs._MKL_LINE matches it: on printable ASCII that regular
 * expression has a single reading, which this follows (the arguments end at the last ')'
 * after which the rest matches). Lines outside printable ASCII are left to Python, so every
 * answer but 2 is the one the Python code gives (the tests compare them).
 *
 * The lines are read with the GIL released (the texts are held, and str objects do not
 * change); only the building of the answer holds it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { UNPARSED = 0, QUIET = 1, UNDECIDED = 2, CALL = 3 };

/* Fewer lines than this are read with the GIL held: taking it back can wait for a program
 * thread up to the switch interval (5 ms), longer than a few lines take. */
#define RELEASE_FROM 16
/* Keys kept per scan to share one str object between lines of the same call. */
#define SHARED_KEYS 256

static const char MKL[] = "MKL_VERBOSE ";
#define MKL_LEN (sizeof(MKL) - 1)

typedef struct {
    const char *text;  /* NULL: undecided at collection */
    Py_ssize_t len;
    int code;
    int64_t duration;
    size_t key_off, key_len;
    uint32_t hash;
} Line;

/* Character classes of ASCII (a table: the branches of comparisons cost more). */
enum { DIGIT = 1, ALPHA = 2, HEX = 4, PLAIN = 8 };  /* ALPHA: letters and '_'; PLAIN: printable or tab */
static unsigned char classes[256];

static void fill_classes(void) {
    for (int c = 0; c < 256; c++) {
        unsigned char k = 0;
        if (c >= '0' && c <= '9') k |= DIGIT | HEX;
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_') k |= ALPHA;
        if ((c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')) k |= HEX;
        if ((c >= 0x20 && c <= 0x7e) || c == '\t') k |= PLAIN;
        classes[c] = k;
    }
}

static int is_digit(char c) { return classes[(unsigned char)c] & DIGIT; }
static int is_alpha(char c) { return classes[(unsigned char)c] & ALPHA; }
static int is_word(char c) { return classes[(unsigned char)c] & (ALPHA | DIGIT); }

static int starts(const char *s, Py_ssize_t n, const char *prefix) {
    size_t k = strlen(prefix);
    return (size_t)n >= k && memcmp(s, prefix, k) == 0;
}

static int contains(const char *s, Py_ssize_t n, const char *part) {
    size_t k = strlen(part);
    for (Py_ssize_t i = 0; i + (Py_ssize_t)k <= n; i++)
        if (s[i] == part[0] && memcmp(s + i, part, k) == 0) return 1;
    return 0;
}

/* The parts of a match: [fn, fn_end) function, [args, args_end) arguments, [num, num_end)
 * number, its unit's digits after the point (0, 3, 6, 9), [rest, n) the rest. */
typedef struct {
    Py_ssize_t fn, fn_end, args, args_end, num, num_end, rest;
    int scale, exponent;
} Parts;

/* Whether ``\s+ number unit \b`` matches at s[p:] (to end n); fills the number, unit, rest. */
static int tail(const char *s, Py_ssize_t n, Py_ssize_t p, Parts *m) {
    Py_ssize_t q = p;
    while (q < n && (s[q] == ' ' || s[q] == '\t')) q++;
    if (q == p || q >= n || !is_digit(s[q])) return 0;
    m->num = q;
    while (q < n && is_digit(s[q])) q++;
    if (q < n && s[q] == '.') {
        q++;
        while (q < n && is_digit(s[q])) q++;
    }
    m->exponent = 0;
    if (q < n && s[q] == 'e') {
        Py_ssize_t r = q + 1;
        if (r < n && (s[r] == '+' || s[r] == '-')) r++;
        if (r < n && is_digit(s[r])) {
            while (r < n && is_digit(s[r])) r++;
            q = r;
            m->exponent = 1;
        }
    }
    m->num_end = q;
    Py_ssize_t unit;
    if (q + 1 < n && s[q + 1] == 's' && (s[q] == 'n' || s[q] == 'u' || s[q] == 'm')) {
        unit = 2;
        m->scale = s[q] == 'n' ? 0 : s[q] == 'u' ? 3 : 6;
    } else if (q < n && s[q] == 's') {
        unit = 1;
        m->scale = 9;
    } else {
        return 0;
    }
    q += unit;
    if (q < n && is_word(s[q])) return 0;
    m->rest = q;
    return 1;
}

/* Whether s[:n] is an MKL call line as _MKL_LINE reads it (printable ASCII only). */
static int match(const char *s, Py_ssize_t n, Parts *m) {
    if (!starts(s, n, MKL)) return 0;
    Py_ssize_t p = MKL_LEN;
    if (p >= n || !is_alpha(s[p])) return 0;
    m->fn = p;
    while (p < n && is_word(s[p])) p++;
    if (p >= n || s[p] != '(') return 0;
    m->fn_end = p;
    m->args = p + 1;
    for (Py_ssize_t j = n - 1; j >= m->args; j--) {
        if (s[j] == ')' && tail(s, n, j + 1, m)) {
            m->args_end = j;
            return 1;
        }
    }
    return 0;
}

/* The number's ns (its digits after the point at ``scale``, rounded half even, as
 * _plain_decimal_ns); 0 where it does not fit in 63 bits. */
static int duration_ns(const char *s, const Parts *m, int64_t *out) {
    uint64_t ns = 0;
    Py_ssize_t q = m->num;
    for (; q < m->num_end && s[q] != '.'; q++)
        if (__builtin_mul_overflow(ns, 10, &ns) || __builtin_add_overflow(ns, (uint64_t)(s[q] - '0'), &ns)) return 0;
    Py_ssize_t frac = q < m->num_end ? q + 1 : m->num_end;
    for (int i = 0; i < m->scale; i++) {
        uint64_t digit = frac + i < m->num_end ? (uint64_t)(s[frac + i] - '0') : 0;
        if (__builtin_mul_overflow(ns, 10, &ns) || __builtin_add_overflow(ns, digit, &ns)) return 0;
    }
    Py_ssize_t r = frac + m->scale;
    if (r < m->num_end) {
        int up = s[r] > '5';
        if (s[r] == '5') {
            up = ns % 2;
            for (Py_ssize_t k = r + 1; k < m->num_end; k++)
                if (s[k] != '0') up = 1;
        }
        if (up && __builtin_add_overflow(ns, 1, &ns)) return 0;
    }
    if (ns > (uint64_t)INT64_MAX) return 0;
    *out = (int64_t)ns;
    return 1;
}

/* Writes the call's key into ``key``; returns its length. */
static size_t write_key(const char *s, Py_ssize_t n, const Parts *m, char *key) {
    size_t k = 0;
    memcpy(key, s + m->fn, (size_t)(m->fn_end - m->fn));
    k += (size_t)(m->fn_end - m->fn);
    key[k++] = '\n';
    Py_ssize_t field = m->args;
    for (;;) {
        Py_ssize_t end = field;
        while (end < m->args_end && s[end] != ',') end++;
        unsigned char pointer = end - field >= 3 && s[field] == '0' && s[field + 1] == 'x' ? HEX : 0;
        for (Py_ssize_t i = field + 2; pointer && i < end; i++) pointer &= classes[(unsigned char)s[i]];
        if (pointer) {
            key[k++] = '*';
        } else {
            memcpy(key + k, s + field, (size_t)(end - field));
            k += (size_t)(end - field);
        }
        if (end >= m->args_end) break;
        key[k++] = ',';
        field = end + 1;
    }
    key[k++] = '\n';
    memcpy(key + k, s + m->rest, (size_t)(n - m->rest));
    return k + (size_t)(n - m->rest);
}

/* A hash of a key, eight bytes a step (only for sharing key objects: a collision costs a str). */
static uint32_t key_hash(const char *s, size_t n) {
    uint64_t h = n;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, s + i, 8);
        h = (h ^ w) * 0x9E3779B97F4A7C15ull;
    }
    uint64_t w = 0;
    memcpy(&w, s + i, n - i);
    h = (h ^ w) * 0x9E3779B97F4A7C15ull;
    return (uint32_t)(h >> 32);
}

/* Reads one line (no GIL): its code, and for a call its duration and key (into ``key``). */
static void read_line(Line *line, char *key) {
    const char *s = line->text;
    Py_ssize_t full = line->len, n = line->len;
    while (n > 0 && (s[n - 1] == '\r' || s[n - 1] == '\n')) n--;
    unsigned char plain = PLAIN;
    for (Py_ssize_t i = 0; i < n; i++) plain &= classes[(unsigned char)s[i]];
    if (!plain) {
        line->code = UNDECIDED;
        return;
    }
    if (starts(s, n, "onednn_verbose,") || starts(s, n, "dnnl_verbose,")) {
        line->code = UNDECIDED;
        return;
    }
    Parts m;
    if (!match(s, n, &m)) {
        line->code = starts(s, full, "MKL_VERBOSE oneMKL") || contains(s, full, ",info,") ? QUIET : UNPARSED;
        return;
    }
    if (m.exponent || !duration_ns(s, &m, &line->duration)) {
        line->code = UNDECIDED;  /* Decimal's reading, or a number Python keeps whole */
        return;
    }
    line->key_len = write_key(s, n, &m, key);
    line->hash = key_hash(key, line->key_len);
    line->code = CALL;
}

/* The text of one item, or NULL (undecided): a str, or a tuple's second item. */
static PyObject *text_of(PyObject *item) {
    if (PyTuple_Check(item) && PyTuple_GET_SIZE(item) >= 2) item = PyTuple_GET_ITEM(item, 1);
    if (!PyUnicode_Check(item)) return NULL;
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(item) < 0) {
        PyErr_Clear();
        return NULL;
    }
#endif
    return PyUnicode_IS_ASCII(item) ? item : NULL;
}

/* The key str of ``line``, the object of an earlier line of this scan with the same key where
 * one is kept (a dict hashes a str once). */
static PyObject *key_object(const Line *line, const char *keys, PyObject **shared, const Line **shared_by) {
    size_t slot = line->hash % SHARED_KEYS;
    const Line *other = shared_by[slot];
    if (other && other->key_len == line->key_len && memcmp(keys + other->key_off, keys + line->key_off, line->key_len) == 0) {
        Py_INCREF(shared[slot]);
        return shared[slot];
    }
    PyObject *key = PyUnicode_New((Py_ssize_t)line->key_len, 127);
    if (!key) return NULL;
    memcpy(PyUnicode_1BYTE_DATA(key), keys + line->key_off, line->key_len);
    Py_XDECREF(shared[slot]);
    Py_INCREF(key);
    shared[slot] = key;
    shared_by[slot] = line;
    return key;
}

/* The answer (what, durations) with the GIL held. */
static PyObject *answer(Line *lines, Py_ssize_t n, const char *keys) {
    PyObject *what = PyList_New(n), *durations = PyList_New(n), *out = NULL;
    PyObject *shared[SHARED_KEYS] = {NULL};
    const Line *shared_by[SHARED_KEYS] = {NULL};
    Py_ssize_t i = 0;
    for (; what && durations && i < n; i++) {
        int call = lines[i].code == CALL;
        PyObject *item = call ? key_object(&lines[i], keys, shared, shared_by) : PyLong_FromLong(lines[i].code);
        if (!item) break;
        PyList_SET_ITEM(what, i, item);
        PyObject *duration = PyLong_FromLongLong(call ? lines[i].duration : 0);
        if (!duration) break;
        PyList_SET_ITEM(durations, i, duration);
    }
    if (what && durations && i == n) out = PyTuple_Pack(2, what, durations);
    Py_XDECREF(what);
    Py_XDECREF(durations);
    for (int k = 0; k < SHARED_KEYS; k++) Py_XDECREF(shared[k]);
    return out;
}

static PyObject *scan(PyObject *mod, PyObject *arg) {
    (void)mod;
    PyObject *seq = PySequence_Fast(arg, "scan() takes a sequence of lines");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Line *lines = PyMem_Calloc((size_t)n + 1, sizeof(Line));
    PyObject **held = PyMem_Calloc((size_t)n + 1, sizeof(PyObject *));
    char *keys = NULL;
    PyObject *out = NULL;
    if (!lines || !held) {
        PyErr_NoMemory();
        goto done;
    }
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *text = text_of(items[i]);
        if (!text) {
            lines[i].code = UNDECIDED;
            continue;
        }
        Py_INCREF(text);
        held[i] = text;
        lines[i].text = (const char *)PyUnicode_1BYTE_DATA(text);
        lines[i].len = PyUnicode_GET_LENGTH(text);
        lines[i].key_off = total;
        total += (size_t)lines[i].len + 2;  /* a key is no longer than its line */
    }
    keys = PyMem_RawMalloc(total + 1);
    if (!keys) {
        PyErr_NoMemory();
        goto done;
    }
    PyThreadState *saved = n >= RELEASE_FROM ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (lines[i].text) read_line(&lines[i], keys + lines[i].key_off);
    if (saved) PyEval_RestoreThread(saved);
    out = answer(lines, n, keys);
done:
    if (held)
        for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(held[i]);
    PyMem_Free(held);
    PyMem_Free(lines);
    PyMem_RawFree(keys);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_O,
     "scan(lines) -> (what, durations): per line (a str or a (receive_ns, text) tuple), the call's key and duration (ns) "
     "for an MKL call; else 0 for no call (unparsed), 1 for no call (a header or info line), 2 where Python is to read "
     "it, and duration 0."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_mklscan", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__mklscan(void) {
    fill_classes();
    return PyModule_Create(&moddef);
}

/* FdTap's reader loop in C, without the GIL (tracer/fdtap.py).
 *
 * The Python reader thread needs the GIL for every batch it reads: it takes the GIL from the
 * traced program and, on a machine whose cores the program's threads fill, runs in the place
 * of one of them. This one does the same work, FdTap._run and FdTap._split, in plain C: the
 * GIL is released for the whole loop, and taken only by take(), stats and restore(), which
 * Python calls. A mutex keeps a read and the handling of its bytes (forwarding, capture, the
 * held-back tail) in one piece, so restore() sees either all of a read or none of it.
 *
 * Reader(read_fd, saved_fd, prefixes, urgent, hold_s, batch_s, max_line)
 *   run()          reads the pipe to its end (every writer closed it), forwarding every byte
 *                  that is not part of a captured line to saved_fd; closes neither fd.
 *   take()         [(receive ns, block of captured lines, each ended by a newline), ...]
 *                  captured since the last take (and while collecting is true).
 *   restore(fd[, merged_fd, merged_saved])
 *                  with the GIL held (so no other Python thread writes meanwhile): points fd
 *                  at saved_fd again (and merged_fd, tapped through the same pipe, at
 *                  merged_saved), then reads what is left in the pipe and handles it as
 *                  run() would, the held-back tail included. False where dup2 failed.
 *   draining       when true, run() does not sleep between reads; setting it ends a sleep.
 *   collecting     when false, captured lines are dropped (a detached reader).
 *   forwarded_bytes, forward_errors, captured_lines   as FdTap's.
 *
 * After a read that emptied the pipe, run() sleeps batch_s (less where a quarter of the pipe
 * would fill sooner at the rate just read: batch_sleep_s); after a read that filled its
 * buffer it reads again at once.
 *
 * Times are CLOCK_MONOTONIC ns (time.monotonic_ns()).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#define READ_SIZE (1 << 16)
#define MAX_PREFIXES 8

typedef struct { char *data; size_t len, cap; } Bytes;

typedef struct { int64_t ns; size_t offset, len; } Block;

typedef struct {
    PyObject_HEAD
    int read_fd, saved_fd;
    char *prefix[MAX_PREFIXES], *urgent[MAX_PREFIXES];
    size_t prefix_len[MAX_PREFIXES], urgent_len[MAX_PREFIXES];
    int n_prefix, n_urgent;
    size_t longest_prefix, max_line;
    double hold_s, batch_s;
    pthread_mutex_t mu;
    pthread_cond_t wake;    /* signalled when draining is set: cuts a batching sleep short */
    size_t pipe_cap;        /* the pipe's capacity (bytes), for how long a sleep may be */
    int64_t emptied_ns;     /* when a read last emptied the pipe */
    size_t since_emptied;   /* bytes read since then */
    Bytes pending;          /* the held-back tail: a started captured line, or a prefix's start */
    int64_t held_since;
    Bytes captured;         /* captured lines since the last take(), each ended by '\n' */
    Block *blocks;          /* one per read that captured lines */
    size_t n_blocks, cap_blocks;
    volatile int draining, collecting, running;
    volatile int idle;      /* waiting for the pipe with nothing held back: all it read is out */
    long long forwarded_bytes, forward_errors;
    long long captured_lines;  /* lines captured while collecting, since the start */
    char *chunk;            /* run()'s read buffer */
} Reader;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int bytes_put(Bytes *b, const char *s, size_t n) {
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n) cap *= 2;
        char *d = realloc(b->data, cap);
        if (!d) return -1;
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, s, n);
    b->len += n;
    return 0;
}

/* Writes every byte to saved_fd (waiting where it is non-blocking and full); a write that
 * fails otherwise drops the rest and counts an error: the reader of the original fd is gone. */
static void forward(Reader *r, const char *s, size_t n) {
    while (n > 0) {
        ssize_t w = write(r->saved_fd, s, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                struct pollfd p = {r->saved_fd, POLLOUT, 0};
                poll(&p, 1, 100);
                continue;
            }
            r->forward_errors++;
            return;
        }
        r->forwarded_bytes += w;
        s += w;
        n -= (size_t)w;
    }
}

static int starts_with_prefix(Reader *r, const char *s, size_t n) {
    for (int i = 0; i < r->n_prefix; i++)
        if (n >= r->prefix_len[i] && memcmp(s, r->prefix[i], r->prefix_len[i]) == 0) return 1;
    return 0;
}

static int contains(const char *s, size_t n, const char *needle, size_t k) {
    return memmem(s, n, needle, k) != NULL;
}

/* A captured line (without its newline) into the current read's block. */
static void capture(Reader *r, const char *s, size_t n, int64_t ns, int *opened) {
    if (!r->collecting) return;
    if (!*opened) {
        if (r->n_blocks == r->cap_blocks) {
            size_t cap = r->cap_blocks ? 2 * r->cap_blocks : 256;
            Block *b = realloc(r->blocks, cap * sizeof(Block));
            if (!b) return;
            r->blocks = b;
            r->cap_blocks = cap;
        }
        r->blocks[r->n_blocks++] = (Block){ns, r->captured.len, 0};
        *opened = 1;
    }
    size_t before = r->captured.len;
    if (bytes_put(&r->captured, s, n) < 0 || bytes_put(&r->captured, "\n", 1) < 0) {
        r->captured.len = before;
        return;
    }
    r->blocks[r->n_blocks - 1].len += r->captured.len - before;
    r->captured_lines++;
}

/* Length of the longest tail of data[pos:len] that is a proper start of a prefix. */
static size_t prefix_tail(Reader *r, const char *data, size_t pos, size_t len) {
    size_t most = r->longest_prefix - 1;
    if (most > len - pos) most = len - pos;
    for (size_t k = most; k > 0; k--) {
        const char *tail = data + len - k;
        for (int i = 0; i < r->n_prefix; i++)
            if (r->prefix_len[i] > k && memcmp(r->prefix[i], tail, k) == 0) return k;
    }
    return 0;
}

/* FdTap._split on data (the held-back tail and a new read, one after the other): captures
 * every prefixed line, forwards the rest in order, and keeps the new held-back tail in
 * r->pending. Runs under the mutex. */
static void split(Reader *r, const char *data, size_t len, int64_t ns) {
    size_t pos = 0;
    int opened = 0;
    const char *next[MAX_PREFIXES];
    for (int i = 0; i < r->n_prefix; i++) next[i] = memmem(data, len, r->prefix[i], r->prefix_len[i]);
    Bytes keep = {NULL, 0, 0};
    for (;;) {
        const char *begin = NULL;
        for (int i = 0; i < r->n_prefix; i++) {
            if (next[i] && next[i] < data + pos)
                next[i] = memmem(data + pos, len - pos, r->prefix[i], r->prefix_len[i]);
            if (next[i] && (!begin || next[i] < begin)) begin = next[i];
        }
        if (!begin) break;
        size_t b = (size_t)(begin - data);
        if (b > pos) forward(r, data + pos, b - pos);
        const char *nl = memchr(begin, '\n', len - b);
        if (!nl) {
            if (len - b <= r->max_line) bytes_put(&keep, begin, len - b);
            else forward(r, begin, len - b);  /* no library prints such a line: the program's data */
            pos = len;
            goto done;
        }
        capture(r, begin, (size_t)(nl - begin), ns, &opened);
        pos = (size_t)(nl - data) + 1;
    }
    {
        size_t k = prefix_tail(r, data, pos, len);
        forward(r, data + pos, len - k - pos);
        bytes_put(&keep, data + len - k, k);
    }
done:
    free(r->pending.data);
    r->pending = keep;
}

/* One read's worth handled (under the mutex): pending + chunk split. */
static void handle(Reader *r, const char *chunk, size_t n, int64_t ns) {
    if (r->pending.len) {
        Bytes all = {NULL, 0, 0};
        if (bytes_put(&all, r->pending.data, r->pending.len) < 0 || bytes_put(&all, chunk, n) < 0) {
            free(all.data);
            forward(r, r->pending.data, r->pending.len);  /* out of memory: at least nothing is lost */
            r->pending.len = 0;
            split(r, chunk, n, ns);
            return;
        }
        split(r, all.data, all.len, ns);
        free(all.data);
    } else {
        split(r, chunk, n, ns);
    }
    if (r->pending.len) r->held_since = now_ns();
}

/* The held-back tail at the pipe's end or at restore: a started captured line is captured,
 * anything else forwarded. */
static void finish_pending(Reader *r) {
    if (!r->pending.len) return;
    int opened = 0;
    if (starts_with_prefix(r, r->pending.data, r->pending.len)) capture(r, r->pending.data, r->pending.len, now_ns(), &opened);
    else forward(r, r->pending.data, r->pending.len);
    r->pending.len = 0;
}

/* Takes the mutex from a thread that holds the GIL, letting go of the GIL while it waits. So
 * nobody waits for the mutex while holding the GIL, and a holder of the mutex that wants the
 * GIL back (restore()) always gets it: the reader thread never needs the GIL. */
static void lock_without_gil(Reader *r) {
    if (pthread_mutex_trylock(&r->mu) == 0) return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&r->mu);
    Py_END_ALLOW_THREADS
}

/* How long to sleep after a read that emptied the pipe: batch_s, or less where the bytes read
 * since the pipe was last emptied (over elapsed_s) say that at this rate a quarter of the pipe
 * fills sooner; never under 1 ms. The same rule as fdtap.batch_sleep_s. */
static double batch_sleep_s(double batch_s, size_t bytes, double elapsed_s, size_t pipe_cap) {
    double s = batch_s;
    if (bytes > 0 && elapsed_s > 0) {
        double quarter_s = elapsed_s * ((double)pipe_cap / 4.0) / (double)bytes;
        if (quarter_s < s) s = quarter_s;
    }
    return s < 0.001 ? 0.001 : s;
}

static PyObject *reader_run(Reader *r, PyObject *unused) {
    (void)unused;
    if (r->running) { PyErr_SetString(PyExc_RuntimeError, "the reader is running already"); return NULL; }
    r->running = 1;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        struct pollfd p = {r->read_fd, POLLIN, 0};
        pthread_mutex_lock(&r->mu);
        size_t held = r->pending.len;
        int64_t since = r->held_since;
        pthread_mutex_unlock(&r->mu);
        if (held) {
            double wait = r->hold_s - (double)(now_ns() - since) * 1e-9;
            int ready = wait > 0 && poll(&p, 1, (int)(wait * 1000) + 1) > 0;
            if (!ready) {
                pthread_mutex_lock(&r->mu);
                if (r->pending.len && !starts_with_prefix(r, r->pending.data, r->pending.len)) {
                    forward(r, r->pending.data, r->pending.len);  /* only a prefix's start: the program's output */
                    r->pending.len = 0;
                } else {
                    r->held_since = now_ns();  /* a started captured line: wait for its end */
                }
                pthread_mutex_unlock(&r->mu);
                continue;
            }
        } else {
            r->idle = 1;
            int got = poll(&p, 1, -1);
            r->idle = 0;
            if (got < 0 && errno != EINTR) {
                err = errno;
                break;
            }
        }
        pthread_mutex_lock(&r->mu);
        ssize_t n = read(r->read_fd, r->chunk, READ_SIZE);
        if (n < 0) {
            int e = errno;
            pthread_mutex_unlock(&r->mu);
            if (e == EAGAIN || e == EWOULDBLOCK || e == EINTR) continue;  /* emptied by restore() */
            err = e;
            break;
        }
        if (n == 0) {
            finish_pending(r);
            pthread_mutex_unlock(&r->mu);
            break;
        }
        int64_t ns = now_ns();
        handle(r, r->chunk, (size_t)n, ns);
        int urgent = 0;
        for (int i = 0; i < r->n_urgent && !urgent; i++) urgent = contains(r->chunk, (size_t)n, r->urgent[i], r->urgent_len[i]);
        r->since_emptied += (size_t)n;
        if (n == READ_SIZE || r->batch_s <= 0 || urgent) {  /* more may be waiting, or no batching */
            pthread_mutex_unlock(&r->mu);
            continue;
        }
        double sleep_s = batch_sleep_s(r->batch_s, r->since_emptied, (double)(ns - r->emptied_ns) * 1e-9, r->pipe_cap);
        r->emptied_ns = ns;
        r->since_emptied = 0;
        if (!r->draining) {  /* sleeps with the mutex released; restore() wakes it through draining */
            struct timespec until;
            clock_gettime(CLOCK_MONOTONIC, &until);
            int64_t end = (int64_t)until.tv_sec * 1000000000LL + until.tv_nsec + (int64_t)(sleep_s * 1e9);
            until.tv_sec = (time_t)(end / 1000000000LL);
            until.tv_nsec = (long)(end % 1000000000LL);
            while (!r->draining && pthread_cond_timedwait(&r->wake, &r->mu, &until) == 0) {
            }
        }
        pthread_mutex_unlock(&r->mu);
    }
    Py_END_ALLOW_THREADS
    r->running = 0;
    if (err) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    Py_RETURN_NONE;
}

static PyObject *reader_restore(Reader *r, PyObject *args) {
    long fd, merged_fd = -1, merged_saved = -1;
    if (!PyArg_ParseTuple(args, "l|ll", &fd, &merged_fd, &merged_saved)) return NULL;
    if (fd < 0 || fd > INT32_MAX || merged_fd > INT32_MAX || merged_saved > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "not a file descriptor");
        return NULL;
    }
    /* First, without the GIL, wait until the reader waits on an empty pipe (at most a second):
     * forwarding a pipe's worth here, with the GIL, could block on a full stdout pipe that a
     * Python thread of this process drains. Then the mutex, also waited for without the GIL.
     * From the dup2 to the last forward the GIL is held, so no other Python thread writes in
     * between: what is left is only what other threads wrote meanwhile. */
    Py_BEGIN_ALLOW_THREADS
    int64_t deadline = now_ns() + 1000000000LL;
    int unread = 1;
    while (r->running && !(r->idle && ioctl(r->read_fd, FIONREAD, &unread) == 0 && unread == 0) && now_ns() < deadline) {
        struct timespec pause = {0, 200000};
        nanosleep(&pause, NULL);
    }
    Py_END_ALLOW_THREADS
    lock_without_gil(r);
    int ok = dup2(r->saved_fd, (int)fd) >= 0;
    if (ok && merged_fd >= 0 && merged_saved >= 0) (void)dup2((int)merged_saved, (int)merged_fd);  /* fd 2, tapped with fd */
    if (ok) {
        /* At most 256 reads (16 MiB): a child that goes on writing to the pipe must not keep
         * the GIL here; what it writes later, run() forwards. */
        char *buf = malloc(READ_SIZE);
        ssize_t n;
        for (int reads = 0; buf && reads < 256 && (n = read(r->read_fd, buf, READ_SIZE)) != 0; reads++) {
            if (n < 0) {
                if (errno == EINTR) continue;
                break;  /* EAGAIN: the pipe is empty */
            }
            handle(r, buf, (size_t)n, now_ns());
        }
        free(buf);
        finish_pending(r);
    }
    pthread_mutex_unlock(&r->mu);
    return PyBool_FromLong(ok);
}

static PyObject *reader_take(Reader *r, PyObject *unused) {
    (void)unused;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    lock_without_gil(r);
    for (size_t i = 0; i < r->n_blocks; i++) {
        PyObject *row = Py_BuildValue("(Ly#)", (long long)r->blocks[i].ns, r->captured.data + r->blocks[i].offset,
                                      (Py_ssize_t)r->blocks[i].len);
        if (!row || PyList_Append(out, row) < 0) {
            Py_XDECREF(row);
            Py_CLEAR(out);
            break;
        }
        Py_DECREF(row);
    }
    if (out) { r->n_blocks = 0; r->captured.len = 0; }
    pthread_mutex_unlock(&r->mu);
    return out;
}

static int copy_prefixes(PyObject *seq, char **out, size_t *lens, int *count, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > MAX_PREFIXES) { Py_DECREF(fast); PyErr_Format(PyExc_ValueError, "at most %d %s", MAX_PREFIXES, what); return -1; }
    for (Py_ssize_t i = 0; i < n; i++) {
        char *s; Py_ssize_t k;
        if (PyBytes_AsStringAndSize(PySequence_Fast_GET_ITEM(fast, i), &s, &k) < 0 || k == 0) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "empty %s", what);
            Py_DECREF(fast);
            return -1;
        }
        out[i] = malloc((size_t)k);
        if (!out[i]) { Py_DECREF(fast); PyErr_NoMemory(); return -1; }
        memcpy(out[i], s, (size_t)k);
        lens[i] = (size_t)k;
        *count = (int)i + 1;
    }
    Py_DECREF(fast);
    return 0;
}

static void reader_dealloc(Reader *r) {
    for (int i = 0; i < r->n_prefix; i++) free(r->prefix[i]);
    for (int i = 0; i < r->n_urgent; i++) free(r->urgent[i]);
    free(r->pending.data); free(r->captured.data); free(r->blocks); free(r->chunk);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->wake);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *reader_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"read_fd", "saved_fd", "prefixes", "urgent", "hold_s", "batch_s", "max_line", NULL};
    int read_fd, saved_fd; PyObject *prefixes, *urgent; double hold_s, batch_s; Py_ssize_t max_line;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iiOOddn", kw, &read_fd, &saved_fd, &prefixes, &urgent, &hold_s, &batch_s, &max_line))
        return NULL;
    Reader *r = (Reader *)type->tp_alloc(type, 0);
    if (!r) return NULL;
    pthread_mutex_init(&r->mu, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&r->wake, &attr);
    pthread_condattr_destroy(&attr);
    r->pipe_cap = 65536;
#ifdef F_GETPIPE_SZ
    int cap = fcntl(read_fd, F_GETPIPE_SZ);
    if (cap > 0) r->pipe_cap = (size_t)cap;
#endif
    r->emptied_ns = now_ns();
    r->read_fd = read_fd; r->saved_fd = saved_fd; r->hold_s = hold_s; r->batch_s = batch_s < 0 ? 0 : batch_s;
    r->max_line = max_line < 0 ? 0 : (size_t)max_line;
    r->collecting = 1;
    r->chunk = malloc(READ_SIZE);
    if (!r->chunk) { Py_DECREF(r); return PyErr_NoMemory(); }
    if (copy_prefixes(prefixes, r->prefix, r->prefix_len, &r->n_prefix, "prefixes") < 0
        || copy_prefixes(urgent, r->urgent, r->urgent_len, &r->n_urgent, "urgent prefixes") < 0) {
        Py_DECREF(r);
        return NULL;
    }
    if (r->n_prefix == 0) { Py_DECREF(r); PyErr_SetString(PyExc_ValueError, "no prefixes"); return NULL; }
    for (int i = 0; i < r->n_prefix; i++) if (r->prefix_len[i] > r->longest_prefix) r->longest_prefix = r->prefix_len[i];
    return (PyObject *)r;
}

static PyObject *get_flag(Reader *r, void *which) {
    return PyBool_FromLong(which == (void *)0 ? r->draining : r->collecting);
}

static int set_flag(Reader *r, PyObject *value, void *which) {
    int v = value ? PyObject_IsTrue(value) : 0;
    if (v < 0) return -1;
    if (which == (void *)0) {
        lock_without_gil(r);
        r->draining = v;
        pthread_cond_signal(&r->wake);  /* a batching sleep ends now */
        pthread_mutex_unlock(&r->mu);
    } else {
        r->collecting = v;
    }
    return 0;
}

static PyObject *get_count(Reader *r, void *which) {
    lock_without_gil(r);
    long long v = which == (void *)0 ? r->forwarded_bytes : which == (void *)1 ? r->forward_errors : r->captured_lines;
    pthread_mutex_unlock(&r->mu);
    return PyLong_FromLongLong(v);
}

static PyGetSetDef reader_getset[] = {
    {"draining", (getter)get_flag, (setter)set_flag, "No sleeps between reads (setting it ends one).", (void *)0},
    {"collecting", (getter)get_flag, (setter)set_flag, "Captured lines are kept.", (void *)1},
    {"forwarded_bytes", (getter)get_count, NULL, "Bytes written to the saved descriptor.", (void *)0},
    {"forward_errors", (getter)get_count, NULL, "Writes to the saved descriptor that failed.", (void *)1},
    {"captured_lines", (getter)get_count, NULL, "Lines captured so far (while collecting).", (void *)2},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef reader_methods[] = {
    {"run", (PyCFunction)reader_run, METH_NOARGS, "Reads the pipe to its end without the GIL."},
    {"take", (PyCFunction)reader_take, METH_NOARGS, "The captured blocks since the last take: [(ns, bytes)]."},
    {"restore", (PyCFunction)reader_restore, METH_VARARGS,
     "restore(fd[, merged_fd, merged_saved]): restores fd (and merged_fd from merged_saved), then handles what is left in the pipe (GIL held)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mltrace._tapread.Reader",
    .tp_basicsize = sizeof(Reader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = reader_new,
    .tp_dealloc = (destructor)reader_dealloc,
    .tp_methods = reader_methods,
    .tp_getset = reader_getset,
    .tp_doc = "FdTap's reader loop without the GIL (see _tapread.c).",
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_tapread", NULL, -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__tapread(void) {
    if (PyType_Ready(&ReaderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Reader", (PyObject *)&ReaderType) < 0) { Py_DECREF(m); return NULL; }
    return m;
}

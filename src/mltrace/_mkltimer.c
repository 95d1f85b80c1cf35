/* oneMKL's verbose timer, redirected to the vDSO clock while the library level records.
 *
 * In verbose mode every oneMKL call reads its clock before and after the work through
 * mkl_serv_iface_dsecnd(). That routine executes CPUID before RDTSC to serialize the read.
 * On a virtual machine CPUID is not run by the CPU but trapped by the hypervisor: about
 * 6 µs each on the development VM, where MKL verbose mode cost ≈ 65 µs a call
 * (docs/PERFORMANCE.md). The caller reaches the routine through its PLT, so the
 * dynamic linker's slot (the GOT entry) decides which code runs. install() points every
 * loaded object's slot for it at a function that reads clock_gettime(CLOCK_MONOTONIC), a
 * vDSO call of ≈ 20 ns, and returns seconds as the routine does; remove() puts the saved
 * addresses back. A slot on a read-only
 * page (RELRO under BIND_NOW) is written with the page made writable for the moment, then
 * given back exactly its protection. Nothing else in the
 * program changes: MKL still measures each call around the same work and prints the same
 * line.
 *
 * Finding the slots walks every loaded object's relocation tables (torch's are large: a few
 * milliseconds, more in a forked child, which faults those file pages in again). install()
 * remembers the slots it found with glibc's count of objects loaded and unloaded
 * (dlpi_adds, dlpi_subs); where neither changed since, the next install() points the same
 * slots again without the walk: a later session in the process, and a forked child, whose
 * address space is its parent's copy (the parent's walk is in it).
 *
 * install() -> int    slots redirected now (0: no loaded object imports the timer, or some are
 *                     redirected already)
 * remove() -> int     slots restored
 * slots() -> list     (slot address, saved address, address in the slot now) per redirected slot
 * walks() -> int      relocation-table walks made in this address space (a forked child counts
 *                     its parent's)
 *
 * Linux with glibc only (dl_iterate_phdr and ELF); elsewhere both return 0.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(__linux__) && defined(__x86_64__)
#include <elf.h> /* Python.h has defined _GNU_SOURCE, which link.h needs */
#include <link.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define MAX_SLOTS 64

static const char *const TIMERS[] = {"mkl_serv_iface_dsecnd", "mkl_serv_dsecnd"};

typedef struct {
    void **slot;
    void *original;
    int prot; /* the page's protection as found (PROT_*), -1 where already writable */
} Saved;

static Saved saved[MAX_SLOTS];
static int n_saved = 0;

/* The slots the last walk found, and glibc's load and unload counts then (found_valid: a walk
 * was made and the counts could be read). */
static void **found[MAX_SLOTS];
static int n_found = 0, found_valid = 0;
static unsigned long long found_adds = 0, found_subs = 0;
static long walks_made = 0;

static double monotonic_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int is_timer(const char *name) {
    for (size_t i = 0; i < sizeof(TIMERS) / sizeof(TIMERS[0]); i++)
        if (strcmp(name, TIMERS[i]) == 0) return 1;
    return 0;
}

/* The protection of the mapping that holds addr, from /proc/self/maps: -1 where it is writable
 * already, its PROT_* bits where not, -2 where it cannot be told (then nothing is written). A
 * slot the dynamic linker made read-only (RELRO, with BIND_NOW) gets its page made writable for
 * the write and then exactly what it was; a writable page is never touched. */
static int page_protection(uintptr_t addr) {
    FILE *maps = fopen("/proc/self/maps", "r");
    if (!maps) return -2;
    char line[512], perms[5];
    unsigned long lo, hi;
    int prot = -2;
    while (fgets(line, sizeof line, maps)) {
        if (sscanf(line, "%lx-%lx %4s", &lo, &hi, perms) != 3 || addr < lo || addr >= hi) continue;
        if (perms[1] == 'w') prot = -1;
        else prot = (perms[0] == 'r' ? PROT_READ : 0) | (perms[2] == 'x' ? PROT_EXEC : 0);
        break;
    }
    fclose(maps);
    return prot;
}

/* Writes one pointer-sized slot; prot as page_protection() found it. */
static int write_slot(void **slot, void *value, int prot) {
    long page = sysconf(_SC_PAGESIZE);
    void *start = (void *)((uintptr_t)slot & ~((uintptr_t)page - 1));
    size_t len = (uintptr_t)slot + sizeof(void *) - (uintptr_t)start;
    if (prot == -2) return -1;
    if (prot >= 0 && mprotect(start, len, prot | PROT_WRITE) != 0) return -1;
    __atomic_store_n(slot, value, __ATOMIC_SEQ_CST);
    if (prot >= 0) mprotect(start, len, prot);
    return 0;
}

typedef struct {
    ElfW(Addr) base;
    const ElfW(Sym) *symtab;
    const char *strtab;
    int redirected;
} Object;

static ElfW(Addr) absolute(ElfW(Addr) base, ElfW(Addr) ptr) {
    /* glibc relocates these dynamic entries in place; other loaders may leave them relative */
    return ptr < base ? ptr + base : ptr;
}

static void redirect_table(Object *obj, const ElfW(Rela) *rela, size_t count) {
    for (size_t i = 0; i < count && n_saved < MAX_SLOTS; i++) {
        unsigned long type = ELF64_R_TYPE(rela[i].r_info);
        if (type != R_X86_64_JUMP_SLOT && type != R_X86_64_GLOB_DAT) continue;
        size_t sym = ELF64_R_SYM(rela[i].r_info);
        if (sym == 0 || !is_timer(obj->strtab + obj->symtab[sym].st_name)) continue;
        void **slot = (void **)(obj->base + rela[i].r_offset);
        int prot = page_protection((uintptr_t)slot);
        void *original = *slot;
        if (write_slot(slot, (void *)monotonic_seconds, prot) != 0) continue;
        saved[n_saved++] = (Saved){slot, original, prot};
        obj->redirected++;
    }
}

static int visit(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    int *total = data;
    Object obj = {info->dlpi_addr, NULL, NULL, 0};
    const ElfW(Dyn) *dyn = NULL;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type == PT_DYNAMIC) dyn = (const ElfW(Dyn) *)(obj.base + ph->p_vaddr);
    }
    if (dyn == NULL) return 0;
    const ElfW(Rela) *jmprel = NULL, *rela = NULL;
    size_t jmprel_size = 0, rela_size = 0;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        switch (dyn->d_tag) {
        case DT_SYMTAB: obj.symtab = (const ElfW(Sym) *)absolute(obj.base, dyn->d_un.d_ptr); break;
        case DT_STRTAB: obj.strtab = (const char *)absolute(obj.base, dyn->d_un.d_ptr); break;
        case DT_JMPREL: jmprel = (const ElfW(Rela) *)absolute(obj.base, dyn->d_un.d_ptr); break;
        case DT_PLTRELSZ: jmprel_size = dyn->d_un.d_val; break;
        case DT_RELA: rela = (const ElfW(Rela) *)absolute(obj.base, dyn->d_un.d_ptr); break;
        case DT_RELASZ: rela_size = dyn->d_un.d_val; break;
        default: break;
        }
    }
    if (obj.symtab == NULL || obj.strtab == NULL) return 0;
    if (jmprel) redirect_table(&obj, jmprel, jmprel_size / sizeof(ElfW(Rela)));
    if (rela) redirect_table(&obj, rela, rela_size / sizeof(ElfW(Rela)));
    *total += obj.redirected;
    return 0;
}

typedef struct {
    unsigned long long adds, subs;
    int known;
} LoadCounts;

static int read_counts(struct dl_phdr_info *info, size_t size, void *data) {
    LoadCounts *counts = data;
    if (size >= offsetof(struct dl_phdr_info, dlpi_subs) + sizeof(info->dlpi_subs)) {
        counts->adds = info->dlpi_adds;
        counts->subs = info->dlpi_subs;
        counts->known = 1;
    }
    return 1; /* the counts are the same in every entry: the first is enough */
}

/* Points the slots the last walk found again (their values now are what remove() restores). */
static int redirect_found(void) {
    int total = 0;
    for (int i = 0; i < n_found && n_saved < MAX_SLOTS; i++) {
        void **slot = found[i];
        int prot = page_protection((uintptr_t)slot);
        void *original = *slot;
        if (write_slot(slot, (void *)monotonic_seconds, prot) != 0) continue;
        saved[n_saved++] = (Saved){slot, original, prot};
        total++;
    }
    return total;
}

static PyObject *install(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    int total = 0;
    if (n_saved != 0) return PyLong_FromLong(0);
    LoadCounts counts = {0, 0, 0};
    dl_iterate_phdr(read_counts, &counts);
    if (found_valid && counts.known && counts.adds == found_adds && counts.subs == found_subs)
        return PyLong_FromLong(redirect_found());
    dl_iterate_phdr(visit, &total);
    walks_made++;
    n_found = 0;
    for (int i = 0; i < n_saved; i++) found[n_found++] = saved[i].slot;
    found_valid = counts.known;
    found_adds = counts.adds;
    found_subs = counts.subs;
    return PyLong_FromLong(total);
}

static PyObject *remove_(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    int restored = 0;
    for (int i = n_saved - 1; i >= 0; i--)
        if (write_slot(saved[i].slot, saved[i].original, saved[i].prot) == 0) restored++;
    n_saved = 0;
    return PyLong_FromLong(restored);
}

static PyObject *slots(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    PyObject *out = PyList_New(0);
    for (int i = 0; out != NULL && i < n_saved; i++) {
        PyObject *row = Py_BuildValue("(KKK)", (unsigned long long)(uintptr_t)saved[i].slot,
                                      (unsigned long long)(uintptr_t)saved[i].original,
                                      (unsigned long long)(uintptr_t)__atomic_load_n(saved[i].slot, __ATOMIC_SEQ_CST));
        if (row == NULL || PyList_Append(out, row) < 0) Py_CLEAR(out);
        Py_XDECREF(row);
    }
    return out;
}

static PyObject *walks(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    return PyLong_FromLong(walks_made);
}

#else /* not Linux on x86-64: no CPUID to avoid, or no ELF to walk */

static PyObject *install(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    return PyLong_FromLong(0);
}

static PyObject *remove_(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    return PyLong_FromLong(0);
}

static PyObject *slots(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    return PyList_New(0);
}

static PyObject *walks(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    return PyLong_FromLong(0);
}

#endif

static PyMethodDef methods[] = {
    {"install", install, METH_NOARGS, "Redirects oneMKL's verbose timer to the vDSO clock; returns the slots redirected."},
    {"remove", remove_, METH_NOARGS, "Restores oneMKL's timer; returns the slots restored."},
    {"slots", slots, METH_NOARGS, "(slot, saved, current) addresses of each redirected slot."},
    {"walks", walks, METH_NOARGS, "Relocation-table walks made in this address space (a forked child counts its parent's)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_mkltimer", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__mkltimer(void) { return PyModule_Create(&moddef); }

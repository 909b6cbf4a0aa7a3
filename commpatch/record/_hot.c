/* The fast path in C: the call of a synchronous host-timed op and its row.
 *
 * A ``Recorder`` is made per wrapped op (record/rows.py: hot_call) and holds the log's row buffer
 * (a bytearray), the ``record.state.STATE`` instance dict, the process's sequence counter (an
 * itertools.count), the dtype registry (its Python fallback for a new dtype, element sizes), the
 * group registry, torch's coalescing state, the chunk mask, the op's code and flags byte, the
 * function it wraps, the log's maintenance and commpatch's failure counter.
 *
 * ``recorder.call(group, t, numel_or_None, peer, async_op, *args)`` returns the module's ``SLOW``
 * sentinel, without calling anything, unless the call is the common case (synchronous, no
 * coalescing manager open, a plain torch.Tensor on the CPU or no tensor, a registered group this
 * rank is in); then it reads the clock, calls ``orig(*args)``, reads the clock, takes the next
 * sequence number, finds the dtype code and element count (given, or the tensor's nbytes over its
 * element size) and appends one packed row with the current step, tag and module/phase: the same
 * 59 bytes as ``data.schema.ROW.pack`` (little-endian, no padding). When orig raises, the row is
 * an error row and the exception propagates unchanged; commpatch's own errors go to ``fail`` and
 * never reach the caller.
 *
 * Why: the same work in Python (the checks, a dict lookup, two clock reads, next(), three
 * attribute reads, t.numel(), struct.pack of 12 values, bytearray.extend) costs ~0.3 us more per
 * call (docs/design-notes.md). record/wrapper.py keeps the Python path for every other case and
 * when this module is not built (the extension is optional) or perf_counter is not
 * CLOCK_MONOTONIC (record/rows.py checks). Everything runs under the GIL and the row is written
 * in one piece, as bytearray.extend did.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#define ROW_SIZE 59
#define F_ERROR 4             /* data.schema.F_ERROR */

typedef struct {
    PyObject_HEAD
    PyObject *buf;        /* bytearray */
    PyObject *state;      /* record.state.STATE (its slots read directly: bind_state) */
    PyObject *seq;        /* itertools.count */
    PyObject *dtype_ids;  /* dict: dtype -> code */
    PyObject *dtype_id;   /* callable: registers a new dtype, returns its code */
    PyObject *dtype_sizes;/* list: code -> bytes per element */
    PyObject *orig;       /* the function wrapped */
    PyObject *maintain;   /* called with the seq when a chunk starts */
    PyObject *fail;       /* record.state.fail(kind, exc) */
    PyObject *group_ids;  /* dict: group object -> gid (Log.group_ids) */
    PyObject *coalescing; /* dict: torch's groups inside a _coalescing_manager */
    PyObject *tensor;     /* torch.Tensor: other classes go the Python way */
    PyGetSetDef *get_dtype, *get_nbytes;   /* torch.Tensor's C getters, NULL: use getattr */
    PyObject *last_dtype; /* the dtype of the last row (a strong reference) and its code: most calls */
    long last_dc;         /* of an op have one dtype (dtype_ids only grows: a code never changes) */
    long dc_const;        /* the dtype code of an op without a tensor, -1 for a tensor op */
    int check_devices;    /* STATE.devices set (an accelerator has a process group): Python way */
    long long mask;       /* CHUNK_MASK */
    long code;            /* the op's code (one recorder per wrapper) */
    unsigned char flags;  /* the flags byte of a synchronous host-timed row */
} Recorder;

static PyObject *s_dtype, *s_nbytes, *s_numel, *s_record;
static PyObject *SLOW;      /* returned instead of calling: the Python path takes this call */
static PyObject *ZERO;      /* int 0 (CPython's one small-int object: STATE.nesting when none runs) */

/* ``Counter(start=0)``: the process's sequence counter (record.rows.SEQ), itertools.count's
 * interface (``next()``, ``repr`` 'count(N)') plus ``peek()``; the recorders take a number from it
 * without making an int object of it (one per call before, ~15 ns). Atomic under the GIL, as
 * itertools.count's ``next`` is. */
typedef struct {
    PyObject_HEAD
    long long next;
} Counter;

static PyTypeObject CounterType;

static int
Counter_init(Counter *self, PyObject *args, PyObject *kwds)
{
    long long start = 0;
    static char *kwlist[] = {"start", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|L", kwlist, &start))
        return -1;
    self->next = start;
    return 0;
}

static PyObject *
Counter_next(Counter *self)
{
    return PyLong_FromLongLong(self->next++);
}

static PyObject *
Counter_peek(Counter *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLongLong(self->next);
}

static PyObject *
Counter_repr(Counter *self)
{
    return PyUnicode_FromFormat("count(%lld)", self->next);
}

static PyMethodDef Counter_methods[] = {
    {"peek", (PyCFunction)Counter_peek, METH_NOARGS, "peek(): the number next() gives next, not taken"},
    {NULL}
};

static PyTypeObject CounterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "commpatch.record._hot.Counter",
    .tp_basicsize = sizeof(Counter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Counter(start=0): itertools.count's next() and repr, and peek() (see commpatch/record/_hot.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Counter_init,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)Counter_next,
    .tp_repr = (reprfunc)Counter_repr,
    .tp_methods = Counter_methods,
};

/* The next number of ``seq`` (a Counter, else any iterator of ints); -1 with an exception set. */
static int
take_seq(PyObject *seq, long long *out)
{
    if (Py_IS_TYPE(seq, &CounterType)) {
        *out = ((Counter *)seq)->next++;
        return 0;
    }
    PyObject *so = Py_TYPE(seq)->tp_iternext(seq);
    if (so == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "sequence counter exhausted");
        return -1;
    }
    *out = PyLong_AsLongLong(so);
    Py_DECREF(so);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* record.state.STATE's attributes are slots (State.__slots__): read here at their offsets, found
 * once from the class's member descriptors (bind_state), instead of a dict lookup each (5 per call
 * were ~15% of the fast path's time). NULL: the slot is unset (a fresh State sets them all). */
static PyTypeObject *state_type;
static Py_ssize_t off_recording, off_nesting, off_step, off_tag, off_where, off_devices;

static inline PyObject *
state_slot(PyObject *state, Py_ssize_t off)   /* borrowed */
{
    return *(PyObject **)((char *)state + off);
}

/* The truth of a slot of STATE: 1 or 0 (0 when unset), -1 (its error cleared) when it has none. */
static int
state_true(PyObject *state, Py_ssize_t off)
{
    PyObject *v = state_slot(state, off);
    if (v == Py_True)
        return 1;
    if (v == NULL || v == Py_False || v == ZERO)
        return 0;
    int r = PyObject_IsTrue(v);
    if (r < 0)
        PyErr_Clear();
    return r;
}

static int
slot_offset(PyTypeObject *type, const char *name, Py_ssize_t *off)
{
    PyObject *d = PyObject_GetAttrString((PyObject *)type, name);
    if (d == NULL)
        return -1;
    int ok = Py_IS_TYPE(d, &PyMemberDescr_Type) && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX;
    if (ok)
        *off = ((PyMemberDescrObject *)d)->d_member->offset;
    Py_DECREF(d);   /* the type keeps the descriptor alive */
    if (!ok)
        PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", type->tp_name, name);
    return ok ? 0 : -1;
}

/* bind_state(STATE): the class whose slots the recorders read (once, before any is made). */
static PyObject *
bind_state(PyObject *module, PyObject *state)
{
    PyTypeObject *type = Py_TYPE(state);
    if (slot_offset(type, "recording", &off_recording) < 0 || slot_offset(type, "nesting", &off_nesting) < 0
            || slot_offset(type, "step", &off_step) < 0
            || slot_offset(type, "tag", &off_tag) < 0 || slot_offset(type, "where", &off_where) < 0
            || slot_offset(type, "devices", &off_devices) < 0)
        return NULL;
    Py_INCREF(type);
    Py_XSETREF(state_type, type);
    Py_RETURN_NONE;
}

/* take(buf, n): the first n bytes of the bytearray buf as bytes, removed from it (the flusher's,
 * every 0.2 s). bytearray's own `del buf[:n]` then frees its storage down to what is left, and the
 * next rows refill it in fresh pages (page faults on the training thread: ~40 ns a row measured in a
 * tight loop); here the rest moves to the front and the storage stays, up to 8 MiB unused. */
static PyObject *
take(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyByteArray_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "take(bytearray, n)");
        return NULL;
    }
    PyObject *buf = args[0];
    PyByteArrayObject *b = (PyByteArrayObject *)buf;
    Py_ssize_t n = PyLong_AsSsize_t(args[1]), size = Py_SIZE(buf);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0 || n > size) {
        PyErr_SetString(PyExc_ValueError, "take: n out of range");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(PyByteArray_AS_STRING(buf), n);
    if (out == NULL)
        return NULL;
    Py_ssize_t rest = size - n;
    if (n == 0)
        return out;
    if (b->ob_exports > 0 || b->ob_alloc - rest > (8 << 20)) {   /* bytearray's own way (it frees) */
        if (PySequence_DelSlice(buf, 0, n) < 0) {
            Py_DECREF(out);
            return NULL;
        }
        return out;
    }
    memmove(b->ob_bytes, b->ob_start + n, rest);
    b->ob_start = b->ob_bytes;
    Py_SET_SIZE(buf, rest);
    b->ob_bytes[rest] = '\0';
    return out;
}

/* Refuses a state that is not an instance of the bound class (0, or -1 with TypeError). */
static int
check_state(PyObject *state)
{
    if (state_type != NULL && Py_IS_TYPE(state, state_type))
        return 0;
    PyErr_SetString(PyExc_TypeError, "state must be the object bound by bind_state()");
    return -1;
}

/* The C getter behind type.name when it is a plain getset descriptor (torch.Tensor.dtype). */
static PyGetSetDef *
getset_of(PyObject *type, PyObject *name)
{
    PyObject *d = PyObject_GetAttr(type, name);
    if (d == NULL) {
        PyErr_Clear();
        return NULL;
    }
    PyGetSetDef *g = Py_IS_TYPE(d, &PyGetSetDescr_Type) ? ((PyGetSetDescrObject *)d)->d_getset : NULL;
    Py_DECREF(d);   /* the type keeps the descriptor alive */
    return (g != NULL && g->get != NULL) ? g : NULL;
}

/* t.name, through the getter found at init when t is exactly torch.Tensor. */
static inline PyObject *
tensor_get(Recorder *self, PyObject *t, PyGetSetDef *g, PyObject *name)
{
    if (g != NULL && Py_IS_TYPE(t, (PyTypeObject *)self->tensor))
        return g->get(t, g->closure);
    return PyObject_GetAttr(t, name);
}

static int
Recorder_init(Recorder *self, PyObject *args, PyObject *kwds)
{
    PyObject *buf, *state, *seq, *dtype_ids, *dtype_id, *dtype_sizes, *orig, *maintain, *fail;
    PyObject *group_ids, *coalescing, *tensor;
    long long mask;
    long code, dc_const;
    int flags, check_devices;
    if (!PyArg_ParseTuple(args, "O!OOO!OO!LliOOOO!O!O!lp", &PyByteArray_Type, &buf, &state, &seq,
                          &PyDict_Type, &dtype_ids, &dtype_id, &PyList_Type, &dtype_sizes, &mask, &code, &flags,
                          &orig, &maintain, &fail, &PyDict_Type, &group_ids, &PyDict_Type, &coalescing,
                          &PyType_Type, &tensor, &dc_const, &check_devices))
        return -1;
    if (check_state(state) < 0)
        return -1;
    if (Py_TYPE(seq)->tp_iternext == NULL) {
        PyErr_SetString(PyExc_TypeError, "seq must be an iterator");
        return -1;
    }
    Py_INCREF(buf); Py_XSETREF(self->buf, buf);
    Py_INCREF(state); Py_XSETREF(self->state, state);
    Py_INCREF(seq); Py_XSETREF(self->seq, seq);
    Py_INCREF(dtype_ids); Py_XSETREF(self->dtype_ids, dtype_ids);
    Py_INCREF(dtype_id); Py_XSETREF(self->dtype_id, dtype_id);
    Py_INCREF(dtype_sizes); Py_XSETREF(self->dtype_sizes, dtype_sizes);
    Py_INCREF(orig); Py_XSETREF(self->orig, orig);
    Py_INCREF(maintain); Py_XSETREF(self->maintain, maintain);
    Py_INCREF(fail); Py_XSETREF(self->fail, fail);
    Py_INCREF(group_ids); Py_XSETREF(self->group_ids, group_ids);
    Py_INCREF(coalescing); Py_XSETREF(self->coalescing, coalescing);
    Py_INCREF(tensor); Py_XSETREF(self->tensor, tensor);
    self->get_dtype = getset_of(tensor, s_dtype);
    self->get_nbytes = getset_of(tensor, s_nbytes);
    self->dc_const = dc_const;
    self->check_devices = check_devices;
    self->mask = mask;
    self->code = code;
    self->flags = (unsigned char)flags;
    return 0;
}

static int
Recorder_traverse(Recorder *self, visitproc visit, void *arg)
{
    Py_VISIT(self->buf); Py_VISIT(self->state); Py_VISIT(self->seq);
    Py_VISIT(self->dtype_ids); Py_VISIT(self->dtype_id); Py_VISIT(self->dtype_sizes);
    Py_VISIT(self->orig); Py_VISIT(self->maintain); Py_VISIT(self->fail);
    Py_VISIT(self->group_ids); Py_VISIT(self->coalescing); Py_VISIT(self->tensor);
    Py_VISIT(self->last_dtype);
    return 0;
}

static int
Recorder_clear(Recorder *self)
{
    Py_CLEAR(self->buf); Py_CLEAR(self->state); Py_CLEAR(self->seq);
    Py_CLEAR(self->dtype_ids); Py_CLEAR(self->dtype_id); Py_CLEAR(self->dtype_sizes);
    Py_CLEAR(self->orig); Py_CLEAR(self->maintain); Py_CLEAR(self->fail);
    Py_CLEAR(self->group_ids); Py_CLEAR(self->coalescing); Py_CLEAR(self->tensor);
    Py_CLEAR(self->last_dtype);
    return 0;
}

static void
Recorder_dealloc(Recorder *self)
{
    PyObject_GC_UnTrack(self);
    Recorder_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* An int slot of STATE (0 when unset, as a fresh State has them all set). */
static int
state_int(PyObject *state, Py_ssize_t off, long long *out)
{
    PyObject *v = state_slot(state, off);   /* borrowed */
    if (v == NULL) {
        *out = 0;
        return 0;
    }
    *out = PyLong_AsLongLong(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static inline long long
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Elements of tensor t whose dtype code is dc: t.nbytes / itemsize (a C getter, half the cost of
 * the t.numel() method call), else t.numel() (sparse tensors have no nbytes). */
static int
tensor_numel(Recorder *self, PyObject *t, long dc, long long *out)
{
    long long size = 0;
    if (dc >= 0 && dc < PyList_GET_SIZE(self->dtype_sizes)) {
        size = PyLong_AsLongLong(PyList_GET_ITEM(self->dtype_sizes, dc));
        if (size == -1 && PyErr_Occurred())
            return -1;
    }
    if (size > 0) {
        PyObject *nb = tensor_get(self, t, self->get_nbytes, s_nbytes);
        if (nb != NULL) {
            long long v = PyLong_AsLongLong(nb);
            Py_DECREF(nb);
            if (!(v == -1 && PyErr_Occurred())) {
                *out = v / size;
                return 0;
            }
        }
        PyErr_Clear();
    }
    PyObject *n = PyObject_CallMethodNoArgs(t, s_numel);
    if (n == NULL)
        return -1;
    *out = PyLong_AsLongLong(n);
    Py_DECREF(n);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

#define PUT(p, v, T) do { T _v = (T)(v); memcpy((p), &_v, sizeof(T)); (p) += sizeof(T); } while (0)

/* Room for `extra` more bytes at the end of the bytearray buf, which then holds them (their
 * content unset). bytearray grows by an eighth at a time and the flusher empties it every 0.2 s
 * (which frees its storage), so refilling it copied each byte ~8 times over (measured: ~20 ns and
 * ~60 ns of page faults per row in a tight loop of calls). Here it grows to at least 64 KiB and
 * then doubles: each byte is copied about once. Where a buffer export is held, bytearray's own
 * resize (which refuses) decides. */
static int
grow(PyObject *buf, Py_ssize_t extra)
{
    PyByteArrayObject *b = (PyByteArrayObject *)buf;
    Py_ssize_t n = Py_SIZE(buf), want = n + extra;
    if (b->ob_exports > 0)
        return PyByteArray_Resize(buf, want);
    if (want + (b->ob_start - b->ob_bytes) + 1 > b->ob_alloc) {
        Py_ssize_t room = n < PY_SSIZE_T_MAX / 2 ? 2 * n : want;
        if (room < want)
            room = want;
        if (room < (1 << 16))
            room = 1 << 16;
        if (PyByteArray_Resize(buf, room) < 0)      /* compacts a logical offset, too */
            return -1;
    }
    Py_SET_SIZE(buf, want);                         /* within the allocation: bytearray's quick path */
    b->ob_start[want] = '\0';
    return 0;
}

/* Append one packed row (data.schema.ROW) to the bytearray buf, in one piece. */
static int
pack_row(PyObject *buf, long long seq, long code, long gid, long dc, long long numel, unsigned char flags,
         long long start, long long end, long peer, long long step, long long tag, long long where)
{
    Py_ssize_t n = PyByteArray_GET_SIZE(buf);
    if (grow(buf, ROW_SIZE) < 0)
        return -1;
    char *p = PyByteArray_AS_STRING(buf) + n;
    PUT(p, seq, int64_t);
    PUT(p, code, int16_t);
    PUT(p, gid, int16_t);
    PUT(p, dc, int16_t);
    PUT(p, numel, int64_t);
    PUT(p, flags, uint8_t);
    PUT(p, start, int64_t);
    PUT(p, end, int64_t);
    PUT(p, peer, int32_t);
    PUT(p, step, int64_t);
    PUT(p, tag, int32_t);
    PUT(p, where, int32_t);
    return 0;
}

/* The log's code of dtype: the registry's, or registered now by dtype_id(dtype). -1 with an
 * exception set on failure. */
static long
dtype_code(PyObject *dtype_ids, PyObject *dtype_id, PyObject *dtype)
{
    long dc;
    PyObject *c = PyDict_GetItemWithError(dtype_ids, dtype);   /* borrowed */
    if (c != NULL)
        return PyLong_AsLong(c);
    if (PyErr_Occurred())
        return -1;
    c = PyObject_CallOneArg(dtype_id, dtype);                  /* first sight: register */
    if (c == NULL)
        return -1;
    dc = PyLong_AsLong(c);
    Py_DECREF(c);
    return dc;
}

/* Append the row of a call of this recorder's op that ran from start to end; *seq gets its
 * sequence number. -1 with an exception set when it could not. */
static int
append_row(Recorder *self, long gid, PyObject *const *args, long long start, long long end, unsigned char flags,
           long long *seq)
{
    long peer = PyLong_AsLong(args[3]);
    if (peer == -1 && PyErr_Occurred())
        return -1;
    long dc = self->dc_const;
    PyObject *x = args[1];
    if (dc < 0) {
        PyObject *dtype = tensor_get(self, x, self->get_dtype, s_dtype);
        if (dtype == NULL)
            return -1;
        if (dtype == self->last_dtype) {
            dc = self->last_dc;
        }
        else {
            dc = dtype_code(self->dtype_ids, self->dtype_id, dtype);
            if (dc == -1 && PyErr_Occurred()) {
                Py_DECREF(dtype);
                return -1;
            }
            Py_INCREF(dtype);
            Py_XSETREF(self->last_dtype, dtype);
            self->last_dc = dc;
        }
        Py_DECREF(dtype);
    }
    long long numel;
    if (args[2] == Py_None) {
        if (tensor_numel(self, x, dc, &numel) < 0)
            return -1;
    }
    else if ((numel = PyLong_AsLongLong(args[2])) == -1 && PyErr_Occurred()) {
        return -1;
    }
    long long step, tag, where;
    if (state_int(self->state, off_step, &step) < 0 || state_int(self->state, off_tag, &tag) < 0
            || state_int(self->state, off_where, &where) < 0)
        return -1;
    if (take_seq(self->seq, seq) < 0)
        return -1;
    return pack_row(self->buf, *seq, self->code, gid, dc, numel, flags, start, end, peer, step, tag, where);
}

/* The exception now set, handed to fail(what, exc) and cleared (commpatch never raises into the
 * user's code for its own errors). */
static void
report_failure(PyObject *fail, PyObject *what)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *r = PyObject_CallFunctionObjArgs(fail, what, value ? value : Py_None, NULL);
    Py_XDECREF(r);
    Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
    if (r == NULL)
        PyErr_Clear();
}

/* Whether this call can be taken here: synchronous, no coalescing manager open, a plain CPU
 * torch.Tensor (or no tensor), a group already registered and of which this rank is a member.
 * Anything else (first call on a group, async, tensor subclasses, accelerators, errors) is the
 * Python path's: gid -1 then. */
static long
fast_gid(Recorder *self, PyObject *const *args)
{
    PyObject *t = args[1], *async_op = args[4];
    if (async_op != Py_False && async_op != Py_None) {
        int r = PyObject_IsTrue(async_op);
        if (r != 0) {
            PyErr_Clear();
            return -1;
        }
    }
    if (PyDict_GET_SIZE(self->coalescing) > 0)
        return -1;
    if (t != Py_None) {
        if (!Py_IS_TYPE(t, (PyTypeObject *)self->tensor))
            return -1;
        if (self->check_devices) {
            if (state_true(self->state, off_devices) != 0)
                return -1;
        }
    }
    else if (self->dc_const < 0) {
        return -1;                      /* a tensor op without its tensor: torch's error, in Python */
    }
    PyObject *g = PyDict_GetItemWithError(self->group_ids, args[0]);   /* borrowed */
    if (g == NULL) {
        PyErr_Clear();
        return -1;
    }
    long gid = PyLong_AsLong(g);
    if (gid < 0)
        PyErr_Clear();
    return gid;
}

/* call(group, t, numel_or_None, peer, async_op, *args): orig(*args) alone when commpatch does not
 * record; SLOW while a nesting op runs in any thread (STATE.nesting) or unless fast_gid takes the
 * call; else orig(*args) between two clock reads and its row (an error row, with the exception
 * re-raised, when it raised). */
static PyObject *
Recorder_call(Recorder *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 5) {
        PyErr_SetString(PyExc_TypeError, "call() takes at least 5 arguments");
        return NULL;
    }
    if (state_true(self->state, off_recording) != 1)
        return PyObject_Vectorcall(self->orig, args + 5, nargs - 5, NULL);
    if (state_true(self->state, off_nesting) != 0) {
        Py_INCREF(SLOW);
        return SLOW;
    }
    long gid = fast_gid(self, args);
    if (gid < 0) {
        Py_INCREF(SLOW);
        return SLOW;
    }
    long long start = now_ns();
    PyObject *result = PyObject_Vectorcall(self->orig, args + 5, nargs - 5, NULL);
    long long end = now_ns();
    long long seq;
    if (result == NULL) {               /* torch raised: an error row, then its exception unchanged */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (append_row(self, gid, args, start, end, self->flags | F_ERROR, &seq) < 0)
            report_failure(self->fail, s_record);
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    if (append_row(self, gid, args, start, end, self->flags, &seq) < 0) {
        report_failure(self->fail, s_record);
        return result;
    }
    if (!(seq & self->mask)) {          /* a chunk starts: late timings, clock offset, flush */
        PyObject *seqobj = PyLong_FromLongLong(seq);
        PyObject *r = seqobj ? PyObject_CallOneArg(self->maintain, seqobj) : NULL;
        if (r == NULL)
            report_failure(self->fail, s_record);
        Py_XDECREF(r);
        Py_XDECREF(seqobj);
    }
    return result;
}

static PyMethodDef Recorder_methods[] = {
    {"call", (PyCFunction)(void (*)(void))Recorder_call, METH_FASTCALL,
     "call(group, t, numel_or_None, peer, async_op, *args): orig(*args), timed on the host, and its row; SLOW when the Python path must take the call"},
    {NULL}
};

static PyTypeObject RecorderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "commpatch.record._hot.Recorder",
    .tp_basicsize = sizeof(Recorder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One wrapped op's call and row (see commpatch/record/_hot.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Recorder_init,
    .tp_dealloc = (destructor)Recorder_dealloc,
    .tp_traverse = (traverseproc)Recorder_traverse,
    .tp_clear = (inquiry)Recorder_clear,
    .tp_methods = Recorder_methods,
};


/* ---- DDP's gradient buckets ------------------------------------------------------------------
 * ``BucketHook(...)`` is the comm hook commpatch registers on a DDP reducer when this module is
 * built (integrations/ddp.py: measured). Its common case is the reducer's own arithmetic on a
 * dense CPU bucket (nothing registered in the dispatcher's slot, no join divisor, no
 * gradient-alias tracking): scale by 1/size (not when size is 1), the reducer's C++ all-reduce,
 * one completion callback (``Done``: notes the duration, hands the reducer the tensor), the
 * bucket's row and span; ``on_last`` (Python) after the last bucket of a backward. Anything else,
 * and recording off, goes to ``fallback`` (the Python hook) before anything is called.
 * Why: the same work as Python bytecode inside the backward made the synchronized step ~80-120 us
 * slower at 1 rank (3 buckets, 3 ms steps; benchmarks/ddp_hook_cost.py, docs/design-notes.md). */

/* ``Packing(out, state)``: DDP's packing of one model's gradients into its buckets, timed on the
 * training thread; the books of record/rows.py's ``Packing`` (its docstring says what they mean),
 * kept here because its two hooks run once per parameter per backward. */
typedef struct {
    PyObject_HEAD
    PyObject *out;        /* list: Log.packs, (seq, pack_ns, alone_ns) per launch */
    PyObject *state;      /* record.state.STATE (its slots read directly: bind_state) */
    long long pre, pre_busy, inflight, last_done, total, alone;
    int seen;
} Packing;

static PyTypeObject PackingType;

static void
packing_reset(Packing *self)
{
    self->pre = self->pre_busy = self->inflight = self->last_done = self->total = self->alone = 0;
    self->seen = 0;
}

static void
packing_close(Packing *self, long long end)
{
    long long pre = self->pre;
    self->pre = 0;
    self->total += end - pre;
    self->seen = 1;
    if (!self->pre_busy)
        self->alone += end - pre;
    else if (!self->inflight)
        self->alone += end - (pre > self->last_done ? pre : self->last_done);
}

/* A bucket's launch at ``start``: the windows since the previous one noted for row ``seq``. */
static int
packing_launch(Packing *self, long long seq, long long start)
{
    int rc = 0;
    if (self->pre)
        packing_close(self, start);
    if (self->seen) {
        PyObject *note = Py_BuildValue("(LLL)", seq, self->total, self->alone);
        rc = note == NULL ? -1 : PyList_Append(self->out, note);
        Py_XDECREF(note);
        self->total = self->alone = 0;
        self->seen = 0;
    }
    self->inflight++;
    return rc;
}

static void
packing_done(Packing *self)
{
    if (self->inflight > 0)
        self->inflight--;
    self->last_done = now_ns();
}

/* acc(param): the post-accumulate-grad hook */
static PyObject *
Packing_acc(Packing *self, PyObject *param)
{
    if (state_true(self->state, off_recording) == 1) {
        self->pre = now_ns();
        self->pre_busy = self->inflight;
    }
    Py_RETURN_NONE;
}

/* post(grad_inputs, grad_outputs): the gradient accumulator's post hook, after the reducer's */
static PyObject *
Packing_post(Packing *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (self->pre)
        packing_close(self, now_ns());
    Py_RETURN_NONE;
}

static PyObject *
Packing_launch(Packing *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long seq, start;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "launch(seq, start)");
        return NULL;
    }
    seq = PyLong_AsLongLong(args[0]);
    if (seq == -1 && PyErr_Occurred())
        return NULL;
    start = PyLong_AsLongLong(args[1]);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    if (packing_launch(self, seq, start) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Packing_done(Packing *self, PyObject *unused)
{
    packing_done(self);
    Py_RETURN_NONE;
}

static PyObject *
Packing_completed(Packing *self, PyObject *fut)
{
    packing_done(self);
    Py_RETURN_NONE;
}

static PyObject *
Packing_reset(Packing *self, PyObject *unused)
{
    packing_reset(self);
    Py_RETURN_NONE;
}

static int
Packing_init(Packing *self, PyObject *args, PyObject *kwds)
{
    PyObject *out, *state;
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &out, &state) || check_state(state) < 0)
        return -1;
    Py_INCREF(out); Py_XSETREF(self->out, out);
    Py_INCREF(state); Py_XSETREF(self->state, state);
    packing_reset(self);
    return 0;
}

static int
Packing_traverse(Packing *self, visitproc visit, void *arg)
{
    Py_VISIT(self->out); Py_VISIT(self->state);
    return 0;
}

static int
Packing_clear(Packing *self)
{
    Py_CLEAR(self->out); Py_CLEAR(self->state);
    return 0;
}

static void
Packing_dealloc(Packing *self)
{
    PyObject_GC_UnTrack(self);
    Packing_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Packing_methods[] = {
    {"acc", (PyCFunction)Packing_acc, METH_O, "acc(param): a gradient accumulated (post-accumulate-grad hook)"},
    {"post", (PyCFunction)(void (*)(void))Packing_post, METH_FASTCALL,
     "post(grad_inputs, grad_outputs): the reducer's hook on it returned"},
    {"launch", (PyCFunction)(void (*)(void))Packing_launch, METH_FASTCALL, "launch(seq, start): a bucket issued"},
    {"done", (PyCFunction)Packing_done, METH_NOARGS, "done(): a bucket completed"},
    {"completed", (PyCFunction)Packing_completed, METH_O, "completed(future): done() as a future's callback"},
    {"reset", (PyCFunction)Packing_reset, METH_NOARGS, "reset(): a new forward"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Packing_members[] = {
    {"inflight", T_LONGLONG, offsetof(Packing, inflight), READONLY, "buckets launched, not completed"},
    {"total", T_LONGLONG, offsetof(Packing, total), READONLY, "ns of packing since the last launch"},
    {"alone", T_LONGLONG, offsetof(Packing, alone), READONLY, "of which with no bucket in flight"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject PackingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "commpatch.record._hot.Packing",
    .tp_basicsize = sizeof(Packing),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "DDP's gradient packing into buckets, timed (see commpatch/record/rows.py: Packing).",
    .tp_methods = Packing_methods,
    .tp_members = Packing_members,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Packing_init,
    .tp_dealloc = (destructor)Packing_dealloc,
    .tp_traverse = (traverseproc)Packing_traverse,
    .tp_clear = (inquiry)Packing_clear,
};

typedef struct {
    PyObject_HEAD
    PyObject *done;       /* dict: seq -> duration_ns (Log.done) */
    PyObject *pending;    /* dict: Log.pending, the bucket is in it until this runs */
    PyObject *seq;        /* int */
    Packing *pack;        /* the model's packing books, or NULL */
    long long start;
    vectorcallfunc vectorcall;
} Done;

static PyObject *s_value, *s_hook, *s_track, *s_divide, *s_div_, *s_work, *s_static, *s_ddp, *s_size, *s_buffer;
static PyObject *s_is_cpu, *s_is_sparse, *s_mul_, *s_reducer, *s_run, *s_then, *s_pg, *s_index, *s_params;
static PyObject *s_is_last, *s_bucket;
static PyTypeObject DoneType;

static PyObject *
Done_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Done *self = (Done *)callable;
    long long end = now_ns();
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "Done takes the future");
        return NULL;
    }
    PyObject *d = PyLong_FromLongLong(end - self->start);
    if (d == NULL || PyDict_SetItem(self->done, self->seq, d) < 0)
        PyErr_Clear();                  /* the duration is lost, never the reducer's result */
    Py_XDECREF(d);
    if (PyDict_DelItem(self->pending, self->seq) < 0)
        PyErr_Clear();                  /* not there: taken out already */
    if (self->pack != NULL)
        packing_done(self->pack);
    PyObject *value = PyObject_CallMethodNoArgs(args[0], s_value);   /* raises as the all-reduce did */
    if (value == NULL || !PyList_Check(value))
        return value;
    if (PyList_GET_SIZE(value) < 1) {
        Py_DECREF(value);
        PyErr_SetString(PyExc_RuntimeError, "empty bucket result");
        return NULL;
    }
    PyObject *t = PyList_GET_ITEM(value, 0);
    Py_INCREF(t);
    Py_DECREF(value);
    return t;
}

static int
Done_traverse(Done *self, visitproc visit, void *arg)
{
    Py_VISIT(self->done); Py_VISIT(self->pending); Py_VISIT(self->seq); Py_VISIT(self->pack);
    return 0;
}

static int
Done_clear(Done *self)
{
    Py_CLEAR(self->done); Py_CLEAR(self->pending); Py_CLEAR(self->seq); Py_CLEAR(self->pack);
    return 0;
}

static void
Done_dealloc(Done *self)
{
    PyObject_GC_UnTrack(self);
    Done_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject DoneType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "commpatch.record._hot.Done",
    .tp_basicsize = sizeof(Done),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A DDP bucket's completion callback: notes its duration, returns the bucket tensor.",
    .tp_vectorcall_offset = offsetof(Done, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_dealloc = (destructor)Done_dealloc,
    .tp_traverse = (traverseproc)Done_traverse,
    .tp_clear = (inquiry)Done_clear,
};

typedef struct {
    PyObject_HEAD
    PyObject *fallback;   /* the Python hook: every case but the common one */
    PyObject *default_hook; /* integrations.ddp._default_hook: the slot's hook in the common case */
    PyObject *state;      /* record.state.STATE (its slots read directly: bind_state) */
    PyObject *seq;        /* itertools.count */
    PyObject *buf;        /* bytearray: the log's rows */
    PyObject *dtype_ids, *dtype_id;
    PyObject *group_ids;  /* dict: group -> gid */
    PyObject *group_id;   /* Log.group_id: registers a group */
    PyObject *done;       /* dict: Log.done */
    PyObject *pending;    /* dict: Log.pending (seq -> rows.Pending while the bucket is in flight) */
    PyObject *buckets;    /* list: Log.buckets */
    PyObject *where;      /* where(ddp) -> the row's module/phase code */
    PyObject *on_last;    /* on_last(ddp, seq, start) after the last bucket */
    PyObject *fail;       /* record.state.fail */
    PyObject *tensor;     /* torch.Tensor */
    PyObject *pack;       /* Packing, or None */
    PyObject *code_obj;   /* the op code as an int (Pending's first field) */
    long code;            /* op code of ddp_bucket_allreduce */
    unsigned char flags;  /* flags byte: async, future-timed */
    vectorcallfunc vectorcall;
} BucketHook;

/* Whether o.name is what (1 or 0); -1 with an exception set on error. */
static int
attr_is(PyObject *o, PyObject *name, PyObject *what)
{
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL)
        return -1;
    int r = v == what;
    Py_DECREF(v);
    return r;
}

/* The row and span of a launched bucket; errors go to fail(). */
static void
bucket_books(BucketHook *self, PyObject *ddp, PyObject *bucket, PyObject *tensor, PyObject *seqobj, long long seq,
             long long start, long long end, long long where, long gid, long long numel)
{
    PyObject *dtype = NULL, *index = NULL, *params = NULL, *span = NULL;
    PyObject *last = NULL;
    long dc;
    long long step, tag;
    if ((dtype = PyObject_GetAttr(tensor, s_dtype)) == NULL)
        goto fail;
    if ((dc = dtype_code(self->dtype_ids, self->dtype_id, dtype)) == -1 && PyErr_Occurred())
        goto fail;
    if (state_int(self->state, off_step, &step) < 0 || state_int(self->state, off_tag, &tag) < 0)
        goto fail;
    if (pack_row(self->buf, seq, self->code, gid, dc, numel, self->flags, start, end, -1, step, tag, where) < 0)
        goto fail;
    if ((index = PyObject_CallMethodNoArgs(bucket, s_index)) == NULL
            || (params = PyObject_CallMethodNoArgs(bucket, s_params)) == NULL)
        goto fail;
    Py_ssize_t nparams = PyObject_Length(params);
    if (nparams < 0)
        goto fail;
    if ((span = Py_BuildValue("(LLOn)", seq, seq + 1, index, nparams)) == NULL || PyList_Append(self->buckets, span) < 0)
        goto fail;
    if ((last = PyObject_CallMethodNoArgs(bucket, s_is_last)) == NULL)
        goto fail;
    int is_last = PyObject_IsTrue(last);
    if (is_last < 0)
        goto fail;
    if (is_last) {
        PyObject *st = PyLong_FromLongLong(start);
        PyObject *r = st ? PyObject_CallFunctionObjArgs(self->on_last, ddp, seqobj, st, NULL) : NULL;
        Py_XDECREF(st);
        if (r == NULL)
            goto fail;
        Py_DECREF(r);
    }
    goto done;
fail:
    report_failure(self->fail, s_bucket);
done:
    Py_XDECREF(dtype);
    Py_XDECREF(index); Py_XDECREF(params); Py_XDECREF(span); Py_XDECREF(last);
}

/* The bucket's Log.pending entry (op, gid, numel, thread, start, None), in flight until its Done
 * runs; *gid and *numel for its row. 0, or -1 with an exception set (nothing put in pending). */
static int
bucket_pending(BucketHook *self, PyObject *ddp, PyObject *tensor, PyObject *seqobj, long long start, long *gid,
               long long *numel)
{
    PyObject *group = NULL, *g = NULL, *n = NULL, *ident = NULL, *st = NULL, *entry = NULL;
    int rc = -1;
    if ((group = PyObject_GetAttr(ddp, s_pg)) == NULL)
        goto out;
    g = PyDict_GetItemWithError(self->group_ids, group);
    if (g != NULL)
        Py_INCREF(g);
    else if (PyErr_Occurred() || (g = PyObject_CallOneArg(self->group_id, group)) == NULL)
        goto out;
    if ((*gid = PyLong_AsLong(g)) == -1 && PyErr_Occurred())
        goto out;
    if ((n = PyObject_CallMethodNoArgs(tensor, s_numel)) == NULL)
        goto out;
    if ((*numel = PyLong_AsLongLong(n)) == -1 && PyErr_Occurred())
        goto out;
    if ((ident = PyLong_FromUnsignedLong(PyThread_get_thread_ident())) == NULL
            || (st = PyLong_FromLongLong(start)) == NULL
            || (entry = PyTuple_Pack(6, self->code_obj, g, n, ident, st, Py_None)) == NULL)
        goto out;
    rc = PyDict_SetItem(self->pending, seqobj, entry);
out:
    Py_XDECREF(group); Py_XDECREF(g); Py_XDECREF(n); Py_XDECREF(ident); Py_XDECREF(st); Py_XDECREF(entry);
    return rc;
}

/* hook(slot, bucket) */
static PyObject *
BucketHook_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    BucketHook *self = (BucketHook *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 2 || kwnames != NULL)
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    PyObject *slot = args[0], *bucket = args[1];
    PyObject *tensor = NULL, *ddp = NULL, *wr = NULL, *w = NULL, *size = NULL, *reducer = NULL, *fut = NULL;
    PyObject *out = NULL, *seqobj = NULL, *scaled = NULL;
    Done *cb = NULL;

    /* the common case? decided before anything is called */
    if (state_true(self->state, off_recording) != 1)
        goto slow;
    if (attr_is(slot, s_hook, self->default_hook) != 1 || attr_is(slot, s_track, Py_None) != 1)
        goto slow;
    int no_work = attr_is(slot, s_work, Py_None);
    if (no_work < 0)
        goto slow;
    int divide = attr_is(slot, s_divide, Py_True);   /* batched_grad_copy: x / d, else x * (1/d) */
    if (divide < 0)
        goto slow;
    if (!no_work && attr_is(slot, s_static, Py_True) != 1)
        goto slow;                      /* a join divisor: the Python hook waits for it */
    if ((tensor = PyObject_CallMethodNoArgs(bucket, s_buffer)) == NULL || !Py_IS_TYPE(tensor, (PyTypeObject *)self->tensor))
        goto slow;
    if (attr_is(tensor, s_is_cpu, Py_True) != 1 || attr_is(tensor, s_is_sparse, Py_False) != 1)
        goto slow;
    if ((wr = PyObject_GetAttr(slot, s_ddp)) == NULL || (ddp = PyObject_CallNoArgs(wr)) == NULL || ddp == Py_None)
        goto slow;
    if ((size = PyObject_GetAttr(slot, s_size)) == NULL || (reducer = PyObject_GetAttr(ddp, s_reducer)) == NULL)
        goto slow;
    long d = PyLong_AsLong(size);
    if (d <= 0)
        goto slow;
    if ((w = PyObject_CallOneArg(self->where, ddp)) == NULL)
        goto slow;
    long long where = PyLong_AsLongLong(w);
    if (where == -1 && PyErr_Occurred())
        goto slow;
    if ((seqobj = Py_TYPE(self->seq)->tp_iternext(self->seq)) == NULL)
        goto slow;
    long long seq = PyLong_AsLongLong(seqobj);
    if ((seq == -1 && PyErr_Occurred()) || (cb = PyObject_GC_New(Done, &DoneType)) == NULL)
        goto slow;
    Py_INCREF(self->done); cb->done = self->done;
    Py_INCREF(self->pending); cb->pending = self->pending;
    Py_INCREF(seqobj); cb->seq = seqobj;
    cb->pack = NULL;
    if (self->pack != Py_None) {
        Py_INCREF(self->pack); cb->pack = (Packing *)self->pack;
    }
    cb->vectorcall = Done_vectorcall;
    PyObject_GC_Track(cb);

    /* the reducer's arithmetic and its all-reduce: torch's errors propagate, as from the Python hook */
    long long start = now_ns();
    cb->start = start;
    long gid = -1;
    long long numel = 0;
    if (bucket_pending(self, ddp, tensor, seqobj, start, &gid, &numel) < 0)
        goto slow;                      /* nothing called yet (a number of the sequence is skipped) */
    if (cb->pack != NULL && packing_launch(cb->pack, seq, start) < 0)
        report_failure(self->fail, s_bucket);
    if (d != 1) {                       /* x * (1/d), as the reducer's copy into the bucket; x / d batched */
        PyObject *f = divide ? PyLong_FromLong(d) : PyFloat_FromDouble(1.0 / (double)d);
        scaled = f ? PyObject_CallMethodOneArg(tensor, divide ? s_div_ : s_mul_, f) : NULL;
        Py_XDECREF(f);
        if (scaled == NULL)
            goto error;
    }
    if ((fut = PyObject_CallMethodOneArg(reducer, s_run, bucket)) == NULL)
        goto error;
    long long end = now_ns();
    if ((out = PyObject_CallMethodOneArg(fut, s_then, (PyObject *)cb)) == NULL)
        goto error;
    bucket_books(self, ddp, bucket, tensor, seqobj, seq, start, end, where, gid, numel);
    goto cleanup;

slow:                                   /* nothing called yet: the Python hook takes the bucket */
    PyErr_Clear();
    out = PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    goto cleanup;
error:                                  /* torch raised after the launch began: out is NULL, its error set */
    {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (PyDict_DelItem(self->pending, seqobj) < 0)
            PyErr_Clear();
        PyErr_Restore(type, value, tb);
    }
cleanup:
    Py_XDECREF(tensor); Py_XDECREF(wr); Py_XDECREF(ddp); Py_XDECREF(w); Py_XDECREF(size);
    Py_XDECREF(reducer); Py_XDECREF(fut); Py_XDECREF(seqobj); Py_XDECREF(scaled); Py_XDECREF(cb);
    return out;
}

static int
BucketHook_init(BucketHook *self, PyObject *args, PyObject *kwds)
{
    PyObject *fallback, *default_hook, *state, *seq, *buf, *dtype_ids, *dtype_id, *group_ids, *group_id, *done;
    PyObject *pending, *buckets, *where, *on_last, *fail, *tensor, *pack, *code_obj;
    long code;
    int flags;
    if (!PyArg_ParseTuple(args, "OOOOO!O!OO!OO!O!O!OOOO!liO", &fallback, &default_hook, &state, &seq,
                          &PyByteArray_Type, &buf, &PyDict_Type, &dtype_ids, &dtype_id, &PyDict_Type, &group_ids,
                          &group_id, &PyDict_Type, &done, &PyDict_Type, &pending, &PyList_Type, &buckets, &where,
                          &on_last, &fail, &PyType_Type, &tensor, &code, &flags, &pack)
            || check_state(state) < 0)
        return -1;
    if (pack != Py_None && !Py_IS_TYPE(pack, &PackingType)) {
        PyErr_SetString(PyExc_TypeError, "pack must be a Packing or None");
        return -1;
    }
    if (Py_TYPE(seq)->tp_iternext == NULL) {
        PyErr_SetString(PyExc_TypeError, "seq must be an iterator");
        return -1;
    }
#define KEEP(f) do { Py_INCREF(f); Py_XSETREF(self->f, f); } while (0)
    KEEP(fallback); KEEP(default_hook); KEEP(state); KEEP(seq); KEEP(buf); KEEP(dtype_ids); KEEP(dtype_id);
    KEEP(group_ids); KEEP(group_id); KEEP(done); KEEP(pending); KEEP(buckets); KEEP(where); KEEP(on_last); KEEP(fail);
    KEEP(tensor); KEEP(pack);
#undef KEEP
    if ((code_obj = PyLong_FromLong(code)) == NULL)
        return -1;
    Py_XSETREF(self->code_obj, code_obj);
    self->code = code;
    self->flags = (unsigned char)flags;
    self->vectorcall = BucketHook_vectorcall;
    return 0;
}

#define BUCKET_FIELDS(F) F(fallback); F(default_hook); F(state); F(seq); F(buf); F(dtype_ids); F(dtype_id); \
    F(group_ids); F(group_id); F(done); F(pending); F(buckets); F(where); F(on_last); F(fail); F(tensor); F(pack); \
    F(code_obj)

static int
BucketHook_traverse(BucketHook *self, visitproc visit, void *arg)
{
#define V(f) Py_VISIT(self->f)
    BUCKET_FIELDS(V);
#undef V
    return 0;
}

static int
BucketHook_clear(BucketHook *self)
{
#define C(f) Py_CLEAR(self->f)
    BUCKET_FIELDS(C);
#undef C
    return 0;
}

static void
BucketHook_dealloc(BucketHook *self)
{
    PyObject_GC_UnTrack(self);
    BucketHook_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject BucketHookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "commpatch.record._hot.BucketHook",
    .tp_basicsize = sizeof(BucketHook),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "commpatch's DDP comm hook: the reducer's own arithmetic on a CPU bucket, its row (see commpatch/record/_hot.c).",
    .tp_vectorcall_offset = offsetof(BucketHook, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)BucketHook_init,
    .tp_dealloc = (destructor)BucketHook_dealloc,
    .tp_traverse = (traverseproc)BucketHook_traverse,
    .tp_clear = (inquiry)BucketHook_clear,
};

static PyMethodDef hot_functions[] = {
    {"bind_state", (PyCFunction)bind_state, METH_O,
     "bind_state(STATE): the object of record.state whose slots the recorders read (its class's member offsets)"},
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL,
     "take(buf, n): the first n bytes of a bytearray as bytes, removed from it, its storage kept (up to 8 MiB unused)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef hot_module = {
    PyModuleDef_HEAD_INIT, "_hot", "The fast path's tail in C (see commpatch/record/_hot.c).", -1, hot_functions,
};

PyMODINIT_FUNC
PyInit__hot(void)
{
#if !PY_LITTLE_ENDIAN
    PyErr_SetString(PyExc_ImportError, "commpatch's packed rows are little-endian");
    return NULL;
#endif
    if (PyType_Ready(&RecorderType) < 0 || PyType_Ready(&DoneType) < 0 || PyType_Ready(&BucketHookType) < 0
            || PyType_Ready(&PackingType) < 0 || PyType_Ready(&CounterType) < 0)
        return NULL;
#define INTERN(v, text) if ((v = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(s_dtype, "dtype"); INTERN(s_nbytes, "nbytes"); INTERN(s_numel, "numel"); INTERN(s_record, "record");
    INTERN(s_value, "value"); INTERN(s_hook, "hook"); INTERN(s_track, "track");
    INTERN(s_divide, "divide"); INTERN(s_div_, "div_");
    INTERN(s_work, "work"); INTERN(s_static, "static"); INTERN(s_ddp, "ddp"); INTERN(s_size, "size");
    INTERN(s_buffer, "buffer"); INTERN(s_is_cpu, "is_cpu"); INTERN(s_is_sparse, "is_sparse"); INTERN(s_mul_, "mul_");
    INTERN(s_reducer, "reducer"); INTERN(s_run, "_run_allreduce_hook"); INTERN(s_then, "then");
    INTERN(s_pg, "process_group"); INTERN(s_index, "index"); INTERN(s_params, "parameters");
    INTERN(s_is_last, "is_last"); INTERN(s_bucket, "ddp.hook");
#undef INTERN
    SLOW = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type);
    ZERO = PyLong_FromLong(0);
    if (SLOW == NULL || ZERO == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&hot_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RecorderType);
    Py_INCREF(SLOW);
    Py_INCREF(&BucketHookType);
    Py_INCREF(&PackingType);
    Py_INCREF(&CounterType);
    if (PyModule_AddObject(m, "Counter", (PyObject *)&CounterType) < 0 || PyModule_AddObject(m, "SLOW", SLOW) < 0 || PyModule_AddObject(m, "Recorder", (PyObject *)&RecorderType) < 0
            || PyModule_AddObject(m, "BucketHook", (PyObject *)&BucketHookType) < 0
            || PyModule_AddObject(m, "Packing", (PyObject *)&PackingType) < 0) {
        Py_DECREF(&RecorderType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/* lifeguard._ears: hear a signal at the instant it comes, and do nothing else.

   For each signal registered, a C handler stands in front of the one in place (CPython's): at
   delivery it writes one record, the signal's number and the time it came, to the listener's
   pipe, then calls the
   handler it found, which trips the Python-level handler and writes the program's wakeup fd
   exactly as without lifeguard. write(2) and clock_gettime(2) are async-signal-safe; nothing
   else is touched.

   Why not faulthandler.register(chain=True), which does much the same from the standard
   library: its handler first writes the Python tracebacks of the interrupted thread (or of
   every thread), walking frames that the interrupted code may be halfway through changing. A
   SIGTERM then becomes a SIGSEGV now and then (3.10 and 3.13 with one thread, any version with
   threads starting and ending): the process no longer dies as it would have without lifeguard.

   Registration and removal come from one thread at a time (lifeguard.sentry holds a lock); a
   delivery may run in any thread meanwhile. The handler reads only the signal's fd (an atomic)
   and the action it found, which is written before the handler is installed and not changed
   while it is.

   The listener that reads the pipe is a thread of this module's (listen()): it waits in read(2)
   holding nothing, and takes the GIL only to hand over what it read. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifndef NSIG
#define NSIG 65
#endif

typedef struct {
    volatile sig_atomic_t fd; /* the pipe's write end; -1 when not registered */
    struct sigaction previous; /* what was in place when it was registered */
} ear_t;

static ear_t ears[NSIG];

/* What one delivery writes, in one write(2) (atomic: far below PIPE_BUF): the signal's number,
   and the CLOCK_MONOTONIC time it came (Python's time.monotonic()) in nanoseconds. The listener
   may read it late (it needs the GIL, which a C call may hold for seconds); the time says
   whether two deliveries were one stop or two, whenever they are read. */
typedef struct {
    unsigned char signum;
    unsigned char padding[7];
    int64_t came_ns;
} record_t;

static void
call_previous(int signum, siginfo_t *info, void *context, const struct sigaction *previous)
{
    if (previous->sa_flags & SA_SIGINFO) {
        if (previous->sa_sigaction != NULL) {
            previous->sa_sigaction(signum, info, context);
        }
        return;
    }
    if (previous->sa_handler == SIG_IGN) {
        return;
    }
    if (previous->sa_handler == SIG_DFL) {
        /* The default action, as if we had never stood in front: put it back and send the
           signal again. It is blocked while this handler runs, so it is acted on once the
           handler returns. */
        (void)sigaction(signum, previous, NULL);
        ears[signum].fd = -1;
        (void)raise(signum);
        return;
    }
    previous->sa_handler(signum);
}

static void
ear_handler(int signum, siginfo_t *info, void *context)
{
    int saved_errno = errno;
    if (signum > 0 && signum < NSIG) {
        ear_t *ear = &ears[signum];
        int fd = ear->fd;
        if (fd >= 0) {
            record_t record = {0};
            struct timespec now;
            record.signum = (unsigned char)signum;
            if (clock_gettime(CLOCK_MONOTONIC, &now) == 0) {
                record.came_ns = (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
            }
            ssize_t written;
            do {
                /* non-blocking pipe: a full one drops it */
                written = write(fd, &record, sizeof record);
            } while (written < 0 && errno == EINTR);
        }
        call_previous(signum, info, context, &ear->previous);
    }
    errno = saved_errno;
}

static int
is_ours(const struct sigaction *action)
{
    return (action->sa_flags & SA_SIGINFO) && action->sa_sigaction == ear_handler;
}

static int
check_signum(int signum)
{
    if (signum < 1 || signum >= NSIG || signum == SIGKILL || signum == SIGSTOP) {
        PyErr_Format(PyExc_ValueError, "signal number %d cannot be heard", signum);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(register_doc,
"register(signum, fd)\n--\n\n"
"Stand in front of the handler now in place for signum: each delivery writes one record to fd\n"
"(RECORD bytes: the signal's number, 7 bytes of padding, the CLOCK_MONOTONIC time it came in\n"
"nanoseconds, a native int64), then calls that handler. With the same flags and mask, so that\n"
"system calls are interrupted or restarted as before. Registered already: only the fd changes.");

static PyObject *
ears_register(PyObject *module, PyObject *args)
{
    int signum, fd;
    struct sigaction current, ours;
    if (!PyArg_ParseTuple(args, "ii:register", &signum, &fd)) {
        return NULL;
    }
    if (check_signum(signum) < 0) {
        return NULL;
    }
    if (fd < 0) {
        PyErr_Format(PyExc_ValueError, "fd must be >= 0, not %d", fd);
        return NULL;
    }
    if (sigaction(signum, NULL, &current) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (is_ours(&current)) {
        ears[signum].fd = fd;
        Py_RETURN_NONE;
    }
    ears[signum].previous = current;
    ears[signum].fd = fd;
    memset(&ours, 0, sizeof(ours));
    ours.sa_sigaction = ear_handler;
    ours.sa_mask = current.sa_mask;
    ours.sa_flags = (current.sa_flags | SA_SIGINFO) & ~SA_RESETHAND;
    if (sigaction(signum, &ours, NULL) != 0) {
        ears[signum].fd = -1;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(unregister_doc,
"unregister(signum) -> bool\n--\n\n"
"Stop hearing signum. If our handler is still the one in place, put back the one found at\n"
"registration and return True; if another has replaced it since, leave that one: False.");

static PyObject *
ears_unregister(PyObject *module, PyObject *args)
{
    int signum;
    struct sigaction current;
    if (!PyArg_ParseTuple(args, "i:unregister", &signum)) {
        return NULL;
    }
    if (check_signum(signum) < 0) {
        return NULL;
    }
    if (sigaction(signum, NULL, &current) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (!is_ours(&current)) {
        ears[signum].fd = -1;
        Py_RETURN_FALSE;
    }
    if (sigaction(signum, &ears[signum].previous, NULL) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    ears[signum].fd = -1;
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(is_registered_doc,
"is_registered(signum) -> bool\n--\n\n"
"Whether our handler is the one in place for signum.");

static PyObject *
ears_is_registered(PyObject *module, PyObject *args)
{
    int signum;
    struct sigaction current;
    if (!PyArg_ParseTuple(args, "i:is_registered", &signum)) {
        return NULL;
    }
    if (check_signum(signum) < 0) {
        return NULL;
    }
    if (sigaction(signum, NULL, &current) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(is_ours(&current));
}

/* Where lifeguard's fds go (lifeguard._fds): near the top of the soft RLIMIT_NOFILE, below the
   usual 1024 select() limit, so that the program finds fds 3, 4, ... where they would be. */
static int
default_floor(void)
{
    long soft = sysconf(_SC_OPEN_MAX);
    long limit = soft < 0 ? 1024 : (soft < 1024 ? soft : 1024);
    return limit - 24 > 3 ? (int)(limit - 24) : 3;
}

PyDoc_STRVAR(floor_doc,
"floor() -> int\n--\n\n"
"Where lifeguard's fds go: 24 below the soft RLIMIT_NOFILE or 1024, whichever is lower, and at\n"
"least 3.");

static PyObject *
ears_floor(PyObject *module, PyObject *unused)
{
    return PyLong_FromLong(default_floor());
}

PyDoc_STRVAR(pipe_doc,
"pipe(floor=floor()) -> (read_fd, write_fd)\n--\n\n"
"os.pipe(), each end moved to the lowest free number at or above floor (close-on-exec), or left\n"
"where it was if none is free up there. For the pipe this module's handler writes, and\n"
"lifeguard._fds.pipe: without the fcntl module, a shared library that install() would load only\n"
"for this.");

/* The F_DUPFD_CLOEXEC of lifeguard._fds.out_of_the_way: the low end is closed once moved. */
static int
move_up(int fd, int floor)
{
    int high = fcntl(fd, F_DUPFD_CLOEXEC, floor);
    if (high < 0) {
        return fd;
    }
    (void)close(fd);
    return high;
}

static PyObject *
ears_pipe(PyObject *module, PyObject *args)
{
    int floor = -1, fds[2];
    if (!PyArg_ParseTuple(args, "|i:pipe", &floor)) {
        return NULL;
    }
    if (floor < 0) {
        floor = default_floor();
    }
    if (pipe2(fds, O_CLOEXEC) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    int read_fd = move_up(fds[0], floor);
    int write_fd = move_up(fds[1], floor);
    return Py_BuildValue("(ii)", read_fd, write_fd);
}

/* The listener: a thread started from C, not Python's. A Python thread, started at install(),
   needs the GIL once to start, from a main thread busy importing the program, and the exit waits
   for it to have run (until then, CPython 3.10 to 3.12 has not set up its state, and an
   interpreter finalized meanwhile would free memory the thread then writes): the handover cost
   every program a fifth of a millisecond. This one has no Python state until a signal comes,
   is born with every signal blocked (a process-directed signal goes to another thread: the
   program's, whose blocking call it interrupts), and stops calling into Python once the
   interpreter is finalizing (a delivery then is too late for lifeguard anyway). */

typedef struct {
    int fd;
    PyObject *callback;
} listener_t;

static int
is_finalizing(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

/* callback(data) with the GIL; the next wait in milliseconds from what it returns (-1: none). */
static int
hand_over(PyObject *callback, const char *data, Py_ssize_t size)
{
    int timeout = -1;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *result = PyObject_CallFunction(callback, "y#", data, size);
    if (result == NULL) {
        PyErr_WriteUnraisable(callback);
    }
    else {
        if (result != Py_None) {
            double seconds = PyFloat_AsDouble(result);
            if (seconds == -1.0 && PyErr_Occurred()) {
                PyErr_WriteUnraisable(callback);
            }
            else if (seconds <= 0) {
                timeout = 0;
            }
            else {
                timeout = seconds >= INT_MAX / 1000 ? INT_MAX : (int)(seconds * 1000) + 1;
            }
        }
        Py_DECREF(result);
    }
    PyGILState_Release(gil);
    return timeout;
}

static void *
listen_thread(void *arg)
{
    listener_t *listener = (listener_t *)arg;
    int fd = listener->fd;
    PyObject *callback = listener->callback;
    char data[sizeof(record_t) * 256];
    int timeout = -1;
    free(listener);
    for (;;) {
        ssize_t size = 0;
        if (timeout >= 0) {
            struct pollfd ready = {fd, POLLIN, 0};
            int count = poll(&ready, 1, timeout);
            if (count < 0 && errno == EINTR) {
                continue;
            }
            if (count == 0) {
                if (is_finalizing()) {
                    break;
                }
                timeout = hand_over(callback, data, 0); /* b"": the wait timed out */
                continue;
            }
        }
        size = read(fd, data, sizeof data);
        if (size < 0 && errno == EINTR) {
            continue;
        }
        if (size <= 0 || is_finalizing()) {
            break; /* end of file: the write end was closed (lifeguard.sentry.Ears.close) */
        }
        timeout = hand_over(callback, data, size);
    }
    (void)close(fd);
    if (!is_finalizing()) {
        PyGILState_STATE gil = PyGILState_Ensure();
        Py_DECREF(callback);
        PyGILState_Release(gil);
    }
    return NULL;
}

PyDoc_STRVAR(listen_doc,
"listen(read_fd, callback, /)\n--\n\n"
"Start the listener thread: it reads read_fd (whole writes of RECORD bytes) and calls\n"
"callback(data) with the GIL for each read, data being the bytes read, or b\"\" when the wait\n"
"callback asked for ran out. callback returns how long the next wait may last, in seconds\n"
"(None: for ever). At end of file the thread closes read_fd and ends.");

static PyObject *
ears_listen(PyObject *module, PyObject *args)
{
    int fd, error;
    PyObject *callback;
    pthread_t thread;
    pthread_attr_t attributes;
    sigset_t every, before;
    if (!PyArg_ParseTuple(args, "iO:listen", &fd, &callback)) {
        return NULL;
    }
    if (!PyCallable_Check(callback)) {
        PyErr_SetString(PyExc_TypeError, "listen: callback must be callable");
        return NULL;
    }
    listener_t *listener = (listener_t *)malloc(sizeof(listener_t));
    if (listener == NULL) {
        return PyErr_NoMemory();
    }
    Py_INCREF(callback);
    listener->fd = fd;
    listener->callback = callback;
    (void)sigfillset(&every);
    (void)pthread_attr_init(&attributes);
    (void)pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
    /* The new thread inherits the mask of this one, blocked for that moment only. */
    (void)pthread_sigmask(SIG_BLOCK, &every, &before);
    error = pthread_create(&thread, &attributes, listen_thread, listener);
    (void)pthread_sigmask(SIG_SETMASK, &before, NULL);
    (void)pthread_attr_destroy(&attributes);
    if (error != 0) {
        Py_DECREF(callback);
        free(listener);
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/* Hearing the program end by a SystemExit (3.12+, lifeguard.toplevel): sys.monitoring's
   PY_UNWIND has no per-code form, so its callback is called for every frame an exception
   leaves, anywhere in the program. This filter is that callback: in C, it pushes no Python
   frame (a Python callback at the recursion limit turned the exception being unwound into a
   RecursionError) and costs a pointer comparison, and it calls the Python callback only for
   the one code object watched (the program's top level), at the bottom of the stack. */

typedef struct {
    PyObject_HEAD
    PyObject *code;
    PyObject *callback;
    vectorcallfunc vectorcall;
} Filter;

static PyObject *
filter_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Filter *filter = (Filter *)self;
    if (PyVectorcall_NARGS(nargsf) >= 1 && args[0] == filter->code) {
        return PyObject_Vectorcall(filter->callback, args, nargsf, kwnames);
    }
    Py_RETURN_NONE;
}

static int
filter_traverse(Filter *self, visitproc visit, void *arg)
{
    Py_VISIT(self->code);
    Py_VISIT(self->callback);
    return 0;
}

static int
filter_clear(Filter *self)
{
    Py_CLEAR(self->code);
    Py_CLEAR(self->callback);
    return 0;
}

static void
filter_dealloc(Filter *self)
{
    PyObject_GC_UnTrack(self);
    filter_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject FilterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "lifeguard._ears.Filter",
    .tp_basicsize = sizeof(Filter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Filter, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_traverse = (traverseproc)filter_traverse,
    .tp_clear = (inquiry)filter_clear,
    .tp_dealloc = (destructor)filter_dealloc,
};

PyDoc_STRVAR(only_for_doc,
"only_for(code, callback, /)\n--\n\n"
"A callable that calls callback(*args) when its first argument is code, and returns None\n"
"otherwise, without a Python frame of its own.");

static PyObject *
ears_only_for(PyObject *module, PyObject *args)
{
    PyObject *code, *callback;
    if (!PyArg_ParseTuple(args, "OO:only_for", &code, &callback)) {
        return NULL;
    }
    if (!PyCallable_Check(callback)) {
        PyErr_SetString(PyExc_TypeError, "only_for: callback must be callable");
        return NULL;
    }
    Filter *filter = PyObject_GC_New(Filter, &FilterType);
    if (filter == NULL) {
        return NULL;
    }
    Py_INCREF(code);
    Py_INCREF(callback);
    filter->code = code;
    filter->callback = callback;
    filter->vectorcall = filter_vectorcall;
    PyObject_GC_Track(filter);
    return (PyObject *)filter;
}

static PyMethodDef ears_methods[] = {
    {"only_for", ears_only_for, METH_VARARGS, only_for_doc},
    {"register", ears_register, METH_VARARGS, register_doc},
    {"unregister", ears_unregister, METH_VARARGS, unregister_doc},
    {"is_registered", ears_is_registered, METH_VARARGS, is_registered_doc},
    {"pipe", ears_pipe, METH_VARARGS, pipe_doc},
    {"floor", ears_floor, METH_NOARGS, floor_doc},
    {"listen", ears_listen, METH_VARARGS, listen_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ears_module = {
    PyModuleDef_HEAD_INIT,
    "lifeguard._ears",
    "A C signal handler that writes each delivery's number and time to a pipe, then chains.",
    -1,
    ears_methods,
};

PyMODINIT_FUNC
PyInit__ears(void)
{
    static int initialized = 0;
    if (!initialized) {
        for (int i = 0; i < NSIG; i++) {
            ears[i].fd = -1;
        }
        initialized = 1;
    }
    if (PyType_Ready(&FilterType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&ears_module);
    if (module != NULL && PyModule_AddIntConstant(module, "RECORD", sizeof(record_t)) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}

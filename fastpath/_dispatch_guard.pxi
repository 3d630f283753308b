# The autograd guard of a Tensor method or operator, as a C type: until autograd is active
# (the flag it points to) a call goes straight on to the method itself by vectorcall (no
# argument tuple is built, so a guarded method costs about what the bare one does); after,
# to the guard's Python-level part (make_recording's variant), which may record. It binds
# like a function (a method descriptor), and it reports the method's name, doc and
# signature (``__wrapped__``).

cdef extern from *:
    """
    #include <stddef.h>

    typedef struct {
        PyObject_HEAD
        vectorcallfunc vectorcall;
        PyObject *plain;   /* the method itself */
        PyObject *slow;    /* what runs once the flag is set */
        int *flag;
    } DtGuard;

    static PyObject *dtguard_call(PyObject *self, PyObject *const *args, size_t nargsf,
                                  PyObject *kwnames) {
        DtGuard *g = (DtGuard *)self;
        return PyObject_Vectorcall(*g->flag ? g->slow : g->plain, args, nargsf, kwnames);
    }

    static void dtguard_dealloc(PyObject *self) {
        DtGuard *g = (DtGuard *)self;
        Py_XDECREF(g->plain);
        Py_XDECREF(g->slow);
        Py_TYPE(self)->tp_free(self);
    }

    static PyObject *dtguard_get(PyObject *self, PyObject *obj, PyObject *type) {
        if (obj == NULL || obj == Py_None) {
            Py_INCREF(self);
            return self;
        }
        return PyMethod_New(self, obj);
    }

    static PyObject *dtguard_attr(PyObject *self, void *name) {
        return PyObject_GetAttrString(((DtGuard *)self)->plain, (const char *)name);
    }

    static PyObject *dtguard_wrapped(PyObject *self, void *unused) {
        PyObject *plain = ((DtGuard *)self)->plain;
        Py_INCREF(plain);
        return plain;
    }

    static PyGetSetDef dtguard_getset[] = {
        {"__wrapped__", dtguard_wrapped, NULL, NULL, NULL},
        {"__name__", dtguard_attr, NULL, NULL, "__name__"},
        {"__qualname__", dtguard_attr, NULL, NULL, "__qualname__"},
        {"__doc__", dtguard_attr, NULL, NULL, "__doc__"},
        {"__module__", dtguard_attr, NULL, NULL, "__module__"},
        {NULL}
    };

    static PyTypeObject DtGuard_Type = {
        PyVarObject_HEAD_INIT(NULL, 0)
        .tp_name = "fastpath._dispatch.Guard",
        .tp_basicsize = sizeof(DtGuard),
        .tp_dealloc = dtguard_dealloc,
        .tp_vectorcall_offset = offsetof(DtGuard, vectorcall),
        .tp_call = PyVectorcall_Call,
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL
                    | Py_TPFLAGS_METHOD_DESCRIPTOR,
        .tp_descr_get = dtguard_get,
        .tp_getset = dtguard_getset,
    };

    static int dtguard_ready(void) {
        return PyType_Ready(&DtGuard_Type);
    }

    static PyObject *dtguard_new(PyObject *plain, PyObject *slow, int *flag) {
        DtGuard *g = PyObject_New(DtGuard, &DtGuard_Type);
        if (g == NULL)
            return NULL;
        g->vectorcall = dtguard_call;
        Py_INCREF(plain);
        g->plain = plain;
        Py_INCREF(slow);
        g->slow = slow;
        g->flag = flag;
        return (PyObject *)g;
    }
    """
    int dtguard_ready() except -1
    object dtguard_new(object plain, object slow, int* flag)


dtguard_ready()


cdef object _guard(object plain, object slow):
    """``plain`` until autograd is active (:func:`set_flags`), then ``slow``."""
    return dtguard_new(plain, slow, <int*>&_autograd_on)

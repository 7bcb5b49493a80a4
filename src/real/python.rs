//! The Python interpreter hosting this process, when there is one: asking its PyTorch caching
//! allocator how far the live blocks around an address reach. The driver cannot say where a
//! tensor ends inside PyTorch's expandable segments (its range queries answer one 20 MiB page);
//! the allocator's snapshot can. Only the CPython C API's stable functions are used, found with
//! the real `dlsym` in the process's global scope; a process without Python, or whose Python
//! has not loaded `torch`, gets `None`.
//!
//! The caller must hold none of expseg's locks. A thread that holds the GIL asks at once; any
//! other asks through a helper thread and waits at most [`WAIT`]: the thread holding the GIL
//! may be waiting for the caller (a C++ extension that keeps the GIL while another thread
//! works), and the caller must not wait for it in turn. A question not answered in time is
//! answered `None` (its answer, when it comes, is dropped).

use super::lookup;
use crossbeam::channel::{bounded, unbounded, Sender};
use libc::{c_char, c_int, c_void};
use once_cell::sync::OnceCell;
use std::ffi::CStr;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Mutex;
use std::time::Duration;

type Obj = *mut c_void;

type IntFn = unsafe extern "C" fn() -> c_int;
type ObjFn = unsafe extern "C" fn() -> Obj;

/// The CPython functions used, all in the stable ABI of every Python 3.
struct Api {
    is_initialized: IntFn,
    is_finalizing: Option<IntFn>,
    gil_ensure: IntFn,
    gil_check: IntFn,
    gil_release: unsafe extern "C" fn(c_int),
    dict_new: ObjFn,
    dict_set: unsafe extern "C" fn(Obj, *const c_char, Obj) -> c_int,
    dict_get: unsafe extern "C" fn(Obj, *const c_char) -> Obj,
    builtins: ObjFn,
    run: unsafe extern "C" fn(*const c_char, c_int, Obj, Obj, *mut c_void) -> Obj,
    tuple_new: unsafe extern "C" fn(isize) -> Obj,
    tuple_set: unsafe extern "C" fn(Obj, isize, Obj) -> c_int,
    long_from: unsafe extern "C" fn(u64) -> Obj,
    long_as: unsafe extern "C" fn(Obj) -> u64,
    call: unsafe extern "C" fn(Obj, Obj) -> Obj,
    err_occurred: ObjFn,
    err_clear: unsafe extern "C" fn(),
    dec_ref: unsafe extern "C" fn(Obj),
}

/// `Py_file_input`.
const FILE_INPUT: c_int = 257;

/// The function the interpreter runs: the furthest end of PyTorch's live blocks that overlap
/// `[start, end)`, 0 when there is none or PyTorch is not in use. The snapshot is reused
/// while PyTorch's counts of allocations and frees stand still (weight sync asks for many
/// handles in a row); a live block's extent changes only with one of those.
const EXTENT_PY: &CStr = c"
def expseg_extent(start, end):
    import sys
    torch = sys.modules.get('torch')
    if torch is None or not torch.cuda.is_initialized():
        return 0
    try:
        key = tuple((s.get('allocation.all.allocated', 0), s.get('allocation.all.freed', 0))
                    for s in (torch.cuda.memory_stats(d) for d in range(torch.cuda.device_count())))
        if _cache.get('key') != key:
            _cache['segments'] = torch.cuda.memory_snapshot()
            _cache['key'] = key
        far = 0
        for seg in _cache['segments']:
            a = seg['address']
            if a >= end or a + seg['total_size'] <= start:
                continue
            for blk in seg['blocks']:
                b = a + blk['size']
                if blk['state'] != 'inactive' and a < end and b > start and b > far:
                    far = b
                a = b
        return far
    except Exception:
        return 0
_cache = {}
";

fn sym(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: RTLD_DEFAULT and a NUL-terminated name.
    let p = unsafe { lookup::real(libc::RTLD_DEFAULT, name) };
    (!p.is_null()).then_some(p)
}

fn api() -> Option<&'static Api> {
    static API: OnceCell<Option<Api>> = OnceCell::new();
    API.get_or_init(|| {
        macro_rules! f {
            ($name:literal, $t:ty) => {
                // SAFETY: the CPython function of that name has this signature in every
                // Python 3 (stable ABI).
                unsafe { std::mem::transmute::<*mut c_void, $t>(sym($name)?) }
            };
        }
        type Set = unsafe extern "C" fn(Obj, *const c_char, Obj) -> c_int;
        type Get = unsafe extern "C" fn(Obj, *const c_char) -> Obj;
        type Run = unsafe extern "C" fn(*const c_char, c_int, Obj, Obj, *mut c_void) -> Obj;
        Some(Api {
            is_initialized: f!(c"Py_IsInitialized", IntFn),
            is_finalizing: sym(c"Py_IsFinalizing")
                .or_else(|| sym(c"_Py_IsFinalizing"))
                // SAFETY: as above (`int (void)`).
                .map(|p| unsafe { std::mem::transmute::<*mut c_void, IntFn>(p) }),
            gil_ensure: f!(c"PyGILState_Ensure", IntFn),
            gil_check: f!(c"PyGILState_Check", IntFn),
            gil_release: f!(c"PyGILState_Release", unsafe extern "C" fn(c_int)),
            dict_new: f!(c"PyDict_New", ObjFn),
            dict_set: f!(c"PyDict_SetItemString", Set),
            dict_get: f!(c"PyDict_GetItemString", Get),
            builtins: f!(c"PyEval_GetBuiltins", ObjFn),
            run: f!(c"PyRun_StringFlags", Run),
            tuple_new: f!(c"PyTuple_New", unsafe extern "C" fn(isize) -> Obj),
            tuple_set: f!(
                c"PyTuple_SetItem",
                unsafe extern "C" fn(Obj, isize, Obj) -> c_int
            ),
            long_from: f!(
                c"PyLong_FromUnsignedLongLong",
                unsafe extern "C" fn(u64) -> Obj
            ),
            long_as: f!(
                c"PyLong_AsUnsignedLongLong",
                unsafe extern "C" fn(Obj) -> u64
            ),
            call: f!(
                c"PyObject_CallObject",
                unsafe extern "C" fn(Obj, Obj) -> Obj
            ),
            err_occurred: f!(c"PyErr_Occurred", ObjFn),
            err_clear: f!(c"PyErr_Clear", unsafe extern "C" fn()),
            dec_ref: f!(c"Py_DecRef", unsafe extern "C" fn(Obj)),
        })
    })
    .as_ref()
}

/// How long a thread without the GIL waits for the helper's answer.
const WAIT: Duration = Duration::from_secs(1);

/// A question for the helper thread: the range, and where the answer goes.
type Ask = (u64, u64, Sender<Option<u64>>);

/// How far PyTorch's live blocks overlapping `[start, end)` reach: `Some(end of the furthest)`,
/// `None` when there is no Python, no PyTorch in use, no live block there, or no answer in
/// time.
pub fn torch_block_extent(start: u64, end: u64) -> Option<u64> {
    let a = api()?;
    // SAFETY: `int (void)` functions of CPython, callable without the GIL.
    unsafe {
        if (a.is_initialized)() == 0 || a.is_finalizing.is_some_and(|f| f() != 0) {
            return None;
        }
        if (a.gil_check)() != 0 {
            return ask(a, start, end);
        }
    }
    let (tx, rx) = bounded(1);
    helper()?.send((start, end, tx)).ok()?;
    rx.recv_timeout(WAIT).ok().flatten()
}

/// The helper thread's queue, started on first use in this process (a forked child starts its
/// own: the parent's thread is not in it).
fn helper() -> Option<Sender<Ask>> {
    static HELPER: Mutex<Option<(u32, Sender<Ask>)>> = Mutex::new(None);
    let mut h = HELPER.lock().unwrap_or_else(|e| e.into_inner());
    let pid = std::process::id();
    if let Some((p, tx)) = h.as_ref() {
        if *p == pid {
            return Some(tx.clone());
        }
    }
    let (tx, rx) = unbounded::<Ask>();
    std::thread::Builder::new()
        .name("expseg-py".into())
        .spawn(move || {
            let Some(a) = api() else { return };
            for (start, end, back) in rx {
                // SAFETY: `ask` takes the GIL itself.
                let _ = back.send(unsafe { ask(a, start, end) });
            }
        })
        .ok()?;
    *h = Some((pid, tx.clone()));
    Some(tx)
}

/// The question itself, on a thread that may or may not hold the GIL (it is taken and given
/// back with `PyGILState_Ensure`/`Release`, which nest).
///
/// # Safety
/// The interpreter is initialized and not finalizing; `a` is its API.
unsafe fn ask(a: &Api, start: u64, end: u64) -> Option<u64> {
    // The compiled `expseg_extent`, made on first use and kept for the process's life (with
    // its globals). No lock of expseg's is held while Python runs: the interpreter may hand
    // the GIL to another thread that then comes here; two first uses both compile, one wins.
    static FUNC: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
    // SAFETY: CPython calls made as its C API documents: the GIL taken with PyGILState_Ensure
    // (any thread, held already or not) and released with what it returned; every new
    // reference released once (but the kept function's globals); borrowed ones not; errors
    // cleared before the GIL goes.
    unsafe {
        let gil = (a.gil_ensure)();
        let far = (|| {
            let mut f = FUNC.load(Ordering::Acquire);
            if f.is_null() {
                let globals = (a.dict_new)();
                if globals.is_null() {
                    return None;
                }
                (a.dict_set)(globals, c"__builtins__".as_ptr(), (a.builtins)());
                let r = (a.run)(
                    EXTENT_PY.as_ptr(),
                    FILE_INPUT,
                    globals,
                    globals,
                    std::ptr::null_mut(),
                );
                if r.is_null() {
                    (a.dec_ref)(globals);
                    return None;
                }
                (a.dec_ref)(r);
                // Borrowed from `globals`, whose one reference is kept: the function lives
                // as long as the process.
                let made = (a.dict_get)(globals, c"expseg_extent".as_ptr());
                if made.is_null() {
                    (a.dec_ref)(globals);
                    return None;
                }
                f = match FUNC.compare_exchange(
                    std::ptr::null_mut(),
                    made,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => made,
                    Err(won) => {
                        (a.dec_ref)(globals);
                        won
                    }
                };
            }
            let args = (a.tuple_new)(2);
            if args.is_null() {
                return None;
            }
            // PyTuple_SetItem steals each item (and releases it when it fails).
            for (i, v) in [start, end].into_iter().enumerate() {
                let item = (a.long_from)(v);
                if item.is_null() || (a.tuple_set)(args, i as isize, item) != 0 {
                    (a.dec_ref)(args);
                    return None;
                }
            }
            let r = (a.call)(f, args);
            (a.dec_ref)(args);
            if r.is_null() {
                return None;
            }
            let v = (a.long_as)(r);
            (a.dec_ref)(r);
            (v != u64::MAX && v > start).then_some(v)
        })();
        if !(a.err_occurred)().is_null() {
            (a.err_clear)();
        }
        (a.gil_release)(gil);
        far
    }
}

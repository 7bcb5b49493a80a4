//! The driver's function table: the `libcuda.so.1` functions the pool and the driver-side
//! calls use, resolved once with the real lookup; without the required ones there is none.

use super::lookup;
use libc::{c_char, c_int, c_uint, c_void, size_t};
use once_cell::sync::OnceCell;
use std::ffi::CStr;

/// Declares the driver table: a struct of function pointers and its loader.
macro_rules! driver_table {
    (
        required { $( $r:ident ( $($rt:ty),* ); )* }
        optional { $( $o:ident ( $($ot:ty),* ); )* }
    ) => {
        /// The driver functions expseg uses, found once in `libcuda.so.1`.
        #[allow(non_snake_case)]
        pub struct DriverTable {
            $( pub $r: unsafe extern "C" fn($($rt),*) -> u32, )*
            $( pub $o: Option<unsafe extern "C" fn($($ot),*) -> u32>, )*
        }

        impl DriverTable {
            /// Resolve every symbol in `lib`; names the first required one that is missing.
            unsafe fn resolve(lib: *mut c_void) -> Result<DriverTable, &'static str> {
                Ok(DriverTable {
                    // SAFETY (each entry): the name is a constant with one NUL, at its end; `lib`
                    // is the caller's handle; a symbol found is the driver's function of the
                    // signature its table entry declares (CUDA's header).
                    $( $r: unsafe {
                        let p = lookup::real(lib, CStr::from_bytes_with_nul_unchecked(concat!(stringify!($r), "\0").as_bytes()));
                        if p.is_null() {
                            return Err(stringify!($r));
                        }
                        std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($rt),*) -> u32>(p)
                    }, )*
                    $( $o: unsafe {
                        let p = lookup::real(lib, CStr::from_bytes_with_nul_unchecked(concat!(stringify!($o), "\0").as_bytes()));
                        (!p.is_null()).then(|| std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ot),*) -> u32>(p))
                    }, )*
                })
            }
        }
    };
}

use cudarc::driver::sys::{
    CUcontext, CUdevice, CUdevice_attribute, CUdeviceptr, CUmemAccessDesc,
    CUmemAllocationGranularity_flags, CUmemAllocationProp, CUmemGenericAllocationHandle, CUstream,
};

driver_table! {
    required {
        cuInit(c_uint);
        cuCtxGetCurrent(*mut CUcontext);
        cuDeviceGet(*mut CUdevice, c_int);
        cuDeviceGetCount(*mut c_int);
        cuDeviceGetAttribute(*mut c_int, CUdevice_attribute, CUdevice);
        cuMemGetAllocationGranularity(*mut size_t, *const CUmemAllocationProp, CUmemAllocationGranularity_flags);
        cuMemCreate(*mut CUmemGenericAllocationHandle, size_t, *const CUmemAllocationProp, u64);
        cuMemRelease(CUmemGenericAllocationHandle);
        cuMemAddressReserve(*mut CUdeviceptr, size_t, size_t, CUdeviceptr, u64);
        cuMemAddressFree(CUdeviceptr, size_t);
        cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, u64);
        cuMemUnmap(CUdeviceptr, size_t);
        cuMemSetAccess(CUdeviceptr, size_t, *const CUmemAccessDesc, size_t);
    }
    optional {
        cuMemGetAddressRange_v2(*mut CUdeviceptr, *mut size_t, CUdeviceptr);
        cuDriverGetVersion(*mut c_int);
        cuGetErrorName(u32, *mut *const c_char);
        cuCheckpointProcessGetState(c_int, *mut c_int);
        cuCheckpointProcessLock(c_int, *mut c_void);
        cuCheckpointProcessCheckpoint(c_int, *mut c_void);
        cuCheckpointProcessRestore(c_int, *mut c_void);
        cuCheckpointProcessUnlock(c_int, *mut c_void);
        cuDeviceGetName(*mut c_char, c_int, CUdevice);
        cuDeviceGetUuid_v2(*mut c_void, CUdevice);
        cuGetProcAddress_v2(*const c_char, *mut *mut c_void, c_int, u64, *mut c_void);
        cuPointerGetAttribute(*mut c_void, c_int, CUdeviceptr);
        cuMemExportToShareableHandle(*mut c_void, CUmemGenericAllocationHandle, u32, u64);
        cuMemImportFromShareableHandle(*mut CUmemGenericAllocationHandle, *mut c_void, u32);
        cuMemRetainAllocationHandle(*mut CUmemGenericAllocationHandle, *mut c_void);
        cuMemGetAllocationPropertiesFromHandle(*mut c_void, CUmemGenericAllocationHandle);
        cuMemGetAccess(*mut u64, *const c_void, CUdeviceptr);
        cuMulticastBindMem(CUmemGenericAllocationHandle, size_t, CUmemGenericAllocationHandle, size_t, size_t, u64);
        cuMulticastBindAddr(CUmemGenericAllocationHandle, size_t, CUdeviceptr, size_t, u64);
        cuDevicePrimaryCtxRetain(*mut CUcontext, CUdevice);
        cuCtxSetCurrent(CUcontext);
        cuCtxGetDevice(*mut CUdevice);
        cuCtxGetId(CUcontext, *mut u64);
        cuCtxSynchronize();
        cuDevicePrimaryCtxGetState(CUdevice, *mut c_uint, *mut c_int);
        cuDevicePrimaryCtxRelease_v2(CUdevice);
        cuCtxPushCurrent_v2(CUcontext);
        cuCtxPopCurrent_v2(*mut CUcontext);
        cuMemHostRegister_v2(*mut c_void, size_t, c_uint);
        cuMemHostUnregister(*mut c_void);
        cuMemHostGetDevicePointer_v2(*mut CUdeviceptr, *mut c_void, c_uint);
        cuStreamBatchMemOp_v2(CUstream, c_uint, *mut c_void, c_uint);
        cuStreamCreate(*mut CUstream, c_uint);
        cuStreamSynchronize(CUstream);
        cuMemcpyDtoHAsync_v2(*mut c_void, CUdeviceptr, size_t, CUstream);
        cuMemcpyHtoDAsync_v2(CUdeviceptr, *const c_void, size_t, CUstream);
        cuMemcpyDtoDAsync_v2(CUdeviceptr, CUdeviceptr, size_t, CUstream);
        cuLaunchHostFunc(CUstream, unsafe extern "C" fn(*mut c_void), *mut c_void);
        cuStreamBeginCapture_v2(CUstream, c_uint);
        cuStreamEndCapture(CUstream, *mut *mut c_void);
        cuThreadExchangeStreamCaptureMode(*mut c_uint);
        cuStreamIsCapturing(CUstream, *mut c_uint);
        cuGraphInstantiateWithFlags(*mut *mut c_void, *mut c_void, u64);
        cuGraphLaunch(*mut c_void, CUstream);
        cuGraphExecDestroy(*mut c_void);
        cuGraphDestroy(*mut c_void);
    }
}

// SAFETY: the table holds plain function pointers into libcuda, valid for the process.
unsafe impl Sync for DriverTable {}
unsafe impl Send for DriverTable {}

/// The driver table, or why there is none. Loaded at most once.
pub fn driver() -> Result<&'static DriverTable, &'static str> {
    static TABLE: OnceCell<Result<DriverTable, String>> = OnceCell::new();
    let t = TABLE.get_or_init(|| {
        // SAFETY: dlopen/dlsym with constant NUL-terminated names. The handle is kept open
        // for the life of the process: the table points into it.
        unsafe {
            let mut lib =
                libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
            if lib.is_null() {
                lib = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            }
            if lib.is_null() {
                return Err("libcuda.so.1 cannot be loaded".to_string());
            }
            DriverTable::resolve(lib).map_err(|missing| format!("libcuda.so.1 lacks {missing}"))
        }
    });
    match t {
        Ok(t) => Ok(t),
        Err(e) => Err(e.as_str()),
    }
}

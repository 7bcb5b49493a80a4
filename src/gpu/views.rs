//! Another process's memory mapped here: what a ticket's grant imports and maps (`Imported`),
//! and the driver calls of mappings expseg keeps (`api::imports`): a descriptor imported when
//! a call needs the driver's handle, that handle released, kept mappings unmapped and their
//! reservation freed.
#![allow(unsafe_code)]

use super::check;
use super::cuda::{access, NOT_FOUND, POSIX_FD};
use super::{DrvError, DrvResult};
use crate::real::DriverTable;
use cudarc::driver::sys::CUmemAccess_flags;
use libc::c_void;
use std::os::fd::{AsRawFd, OwnedFd};

/// Unmap each of `mappings` (start, length), then free the reservation `[va, va+size)` if
/// `size` is not 0: memory of another process's that expseg kept mapped for the program.
pub fn unmap_and_free(t: &DriverTable, mappings: &[(u64, u64)], va: u64, size: u64) {
    // SAFETY: ranges expseg's books hold as mapped by the program's own calls; unmapping an
    // unmapped one fails harmlessly.
    unsafe {
        for (at, len) in mappings {
            (t.cuMemUnmap)(*at, *len as usize);
        }
        if size != 0 {
            (t.cuMemAddressFree)(va, size as usize);
        }
    }
}

/// Import the POSIX descriptor `fd` (not closed here): the driver's handle, or its error.
pub fn import_fd(t: &DriverTable, fd: i32) -> Result<u64, u32> {
    let f = t.cuMemImportFromShareableHandle.ok_or(NOT_FOUND)?;
    let mut h = 0u64;
    // SAFETY: a valid out-pointer; the POSIX type passes the descriptor's number as the handle.
    let r = unsafe { f(&mut h, fd as isize as *mut c_void, 1) };
    if r == 0 {
        Ok(h)
    } else {
        Err(r)
    }
}

/// Release the driver's handle `h`: the driver's answer.
pub fn release_handle(t: &DriverTable, h: u64) -> u32 {
    // SAFETY: a handle the driver gave expseg (`import_fd`).
    unsafe { (t.cuMemRelease)(h) }
}

/// Memory another process shared with us through an IPC ticket, mapped here.
#[derive(Debug)]
pub struct Imported {
    pub va: u64,
    /// Mapped bytes (whole chunks).
    pub size: u64,
    /// The allocation's size as the producer's program asked for it.
    pub user: u64,
    /// The device it is mapped for (the one current when it was opened).
    pub dev: i32,
    /// Where the allocation starts inside the mapped chunks (a grant's lead).
    pub lead: u64,
    handles: Vec<(u64, u64)>,
    /// How many of `handles` are mapped (a failed import may stop between import and map).
    mapped: usize,
}

impl Imported {
    /// The allocation's address here: `lead` bytes into the mapped chunks.
    pub fn addr(&self) -> u64 {
        self.va + self.lead
    }

    /// A mapping of `size` bytes at `va` with no handles, for the books' tests.
    #[cfg(test)]
    pub fn for_test(va: u64, size: u64, dev: i32) -> Imported {
        Imported {
            va,
            size,
            user: size,
            dev,
            lead: 0,
            handles: Vec::new(),
            mapped: 0,
        }
    }
}

/// Import chunks of the given `sizes`, whose descriptors `next_fds` hands over in order a
/// batch at a time, map them back to back at a new range and give `dev` access (devices with
/// peer access to `dev` get theirs from the caller: `set_import_access`). The allocation starts
/// `lead` bytes into them. Each descriptor is closed as soon as its chunk is imported. All or
/// nothing.
pub fn import(
    t: &DriverTable,
    sizes: &[u64],
    user: u64,
    lead: u64,
    dev: i32,
    mut next_fds: impl FnMut() -> Result<Vec<OwnedFd>, String>,
) -> Result<Imported, String> {
    let imp = t
        .cuMemImportFromShareableHandle
        .ok_or_else(|| DrvError(NOT_FOUND).to_string())?;
    let total: u64 = sizes.iter().sum();
    let mut out = Imported {
        va: 0,
        size: total,
        user,
        dev,
        lead,
        handles: Vec::new(),
        mapped: 0,
    };
    let drv = |r| check(r).map_err(|e| e.to_string());
    let r = (|| {
        // SAFETY: valid out-pointer.
        drv(unsafe { (t.cuMemAddressReserve)(&mut out.va, total as usize, 0, 0, 0) })?;
        let mut off = 0;
        while out.handles.len() < sizes.len() {
            let batch = next_fds()?;
            if batch.is_empty() || out.handles.len() + batch.len() > sizes.len() {
                return Err("descriptors do not match the chunks".to_string());
            }
            for fd in batch {
                let size = sizes[out.handles.len()];
                let mut h = 0;
                let os = fd.as_raw_fd() as usize as *mut libc::c_void;
                // SAFETY: for POSIX-fd handles the "OS handle" is the descriptor number itself.
                drv(unsafe { imp(&mut h, os, POSIX_FD) })?;
                out.handles.push((h, size));
                // SAFETY: inside our fresh reservation.
                drv(unsafe { (t.cuMemMap)(out.va + off, size as usize, 0, h, 0) })?;
                out.mapped += 1;
                off += size;
            }
        }
        let a = access(dev, CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
        // SAFETY: the whole range is mapped.
        drv(unsafe { (t.cuMemSetAccess)(out.va, total as usize, &a, 1) })
    })();
    match r {
        Ok(()) => Ok(out),
        Err(e) => {
            unmap_imported(t, out);
            Err(e)
        }
    }
}

/// Give device `peer` access to imported memory (`on`), or take it away: peer access to
/// the device it was opened on was enabled or disabled after the open.
pub fn set_import_access(t: &DriverTable, imp: &Imported, peer: i32, on: bool) -> DrvResult<()> {
    let flags = match on {
        true => CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        false => CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE,
    };
    let a = access(peer, flags);
    // SAFETY: the range is `import`'s, mapped whole.
    check(unsafe { (t.cuMemSetAccess)(imp.va, imp.size as usize, &a, 1) })
}

/// Undo `import` (also of a partial one): unmap, release the handles, free the range.
pub fn unmap_imported(t: &DriverTable, imp: Imported) {
    // SAFETY: only ranges and handles `import` created; unmapping unmapped parts fails harmlessly.
    unsafe {
        if imp.va != 0 {
            let mut off = 0;
            for (_, size) in imp.handles.iter().take(imp.mapped) {
                (t.cuMemUnmap)(imp.va + off, *size as usize);
                off += size;
            }
            (t.cuMemAddressFree)(imp.va, imp.size as usize);
        }
        for (h, _) in &imp.handles {
            (t.cuMemRelease)(*h);
        }
    }
}

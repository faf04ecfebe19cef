//! A VFS over SQLite's default one that writes each frame of the write-ahead log in one call.
//!
//! SQLite appends a page to the log as a frame, in two writes: the frame's 24-byte header, then
//! the page (`walWriteOneFrame` in sqlite3.c), each one `pwrite` call. Most of what the kernel
//! spends on a write into the page cache is the same whatever its length (the call, the file
//! system's bookkeeping for the pages it touches), so a header costs nearly what a page does:
//! a durable tool-loop run appends 22 frames in 46 calls, and those calls were a third of its
//! time one at a time (`perf record` on the store bench).
//!
//! This VFS holds a log file's 24-byte write back and passes it on together with the write that
//! follows, when that one starts where the header ends: one call per frame, with the same bytes
//! at the same offsets. Any other call on the file first passes a held header on, so whatever
//! SQLite then reads, syncs, locks, maps or truncates is what it wrote.
//!
//! A header may be held only where the page's write is sure to follow at once: otherwise it
//! would still be held when the commit is published in the log's shared index, and missing
//! from the file if the process died then, which makes the next recovery drop the commit. In
//! SQLite (3.54) a header is written alone in two places: `walWriteOneFrame`, which writes the
//! page right after it, and `walRewriteChecksums`, which, when a commit changed again pages it
//! had already written to the log (a transaction larger than the page cache), writes their
//! frames' headers anew, each right after reading that frame, and nothing after the last. So a
//! header written right after a read at its own offset is passed on at once. The tests below
//! check both paths by recovering a copy of the log, as a crash leaves it, with the default VFS.
//!
//! Every other file, and every other call, goes to the default VFS as is; a process without this
//! VFS shares the files as before (the format and the locks are the default VFS's).

#![allow(
    unsafe_code,
    reason = "a SQLite VFS is a table of C callbacks over memory that SQLite allocates and owns"
)]

use std::ffi::{CStr, c_int, c_void};
use std::ptr;
use std::sync::OnceLock;

use rusqlite::ffi;

/// The VFS's name, for `sqlite3_open_v2`.
const NAME: &CStr = c"keel-wal-frames";

/// The length of a frame's header (`WAL_FRAME_HDRSIZE` in sqlite3.c).
const FRAME_HEADER: usize = 24;

/// The largest page SQLite writes (`SQLITE_MAX_PAGE_SIZE`): a longer write is no page, and is
/// passed on alone.
const MAX_PAGE: usize = 65_536;

/// The VFS to open keel's connections with: this one, registered at the first call; `None`
/// (SQLite's default) if SQLite has no default VFS to build on or refused to register it.
pub(crate) fn vfs() -> Option<&'static CStr> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    REGISTERED.get_or_init(register).then_some(NAME)
}

/// The default VFS this one forwards to, kept for [`open`].
struct DefaultVfs(*mut ffi::sqlite3_vfs);

// SAFETY: a registered VFS is immutable and lives as long as the process; SQLite calls it from
// any thread.
unsafe impl Send for DefaultVfs {}
unsafe impl Sync for DefaultVfs {}

static DEFAULT: OnceLock<DefaultVfs> = OnceLock::new();

fn register() -> bool {
    // SAFETY: `sqlite3_vfs_find` initializes SQLite and returns a registered VFS or null;
    // registered VFSes are never freed.
    let default = unsafe { ffi::sqlite3_vfs_find(ptr::null()) };
    if default.is_null() {
        return false;
    }
    // SAFETY: as above, `default` points to a live VFS.
    let base = unsafe { &*default };
    let Ok(own) = c_int::try_from(size_of::<File>()) else { return false };
    if DEFAULT.set(DefaultVfs(default)).is_err() {
        return false;
    }
    // The default VFS's own methods (called with this VFS's pointer: they read from it only the
    // fields kept the same here), but for opening files, which wraps the default's files.
    let vfs = Box::new(ffi::sqlite3_vfs {
        szOsFile: own + base.szOsFile,
        pNext: ptr::null_mut(),
        zName: NAME.as_ptr(),
        xOpen: Some(open),
        ..*base
    });
    // SAFETY: the VFS is leaked, so it outlives every connection; its name is static.
    unsafe { ffi::sqlite3_vfs_register(Box::into_raw(vfs), 0) == ffi::SQLITE_OK }
}

/// A file as SQLite holds it: SQLite's part (the methods) first, then what this VFS keeps, then
/// the default VFS's file, in the `szOsFile` bytes SQLite allocates for it.
#[repr(C)]
struct File {
    base: ffi::sqlite3_file,
    /// The default VFS's file, right after this struct.
    inner: *mut ffi::sqlite3_file,
    /// A write-ahead log, whose frame headers are held back.
    log: bool,
    /// The offset of a header written and not yet passed on.
    held: Option<i64>,
    /// Where the last call read, when it was a read: a header written there is a checksum
    /// rewritten, and is passed on at once.
    read_at: Option<i64>,
    header: [u8; FRAME_HEADER],
    /// A header and the page after it, joined: allocated at the first frame, then reused.
    joined: Vec<u8>,
}

unsafe extern "C" fn open(
    _vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    let Some(DefaultVfs(default)) = DEFAULT.get() else { return ffi::SQLITE_ERROR };
    let own = file.cast::<File>();
    // SAFETY: SQLite gives `szOsFile` bytes, aligned for any C type; `File` is a multiple of
    // its (pointer) alignment long, so the default's file after it is aligned as well.
    unsafe {
        let inner = file.cast::<u8>().add(size_of::<File>()).cast::<ffi::sqlite3_file>();
        ptr::write(
            own,
            File {
                base: ffi::sqlite3_file { pMethods: ptr::null() },
                inner,
                log: flags & ffi::SQLITE_OPEN_WAL != 0,
                held: None,
                read_at: None,
                header: [0; FRAME_HEADER],
                joined: Vec::new(),
            },
        );
        let Some(open_inner) = (**default).xOpen else { return ffi::SQLITE_ERROR };
        let rc = open_inner(*default, name, inner, flags, out_flags);
        // SQLite closes a file whose methods are set, even when its opening failed; with none
        // set it calls nothing more, and nothing here needs freeing (the buffer is empty).
        let methods = (*inner).pMethods;
        if !methods.is_null() {
            (*own).base.pMethods = &METHODS[(*methods).iVersion.clamp(1, 3) as usize - 1];
        }
        rc
    }
}

/// This file's parts: what this VFS keeps, and the default VFS's file with its methods.
///
/// # Safety
/// `file` is a file this VFS opened and SQLite has not closed.
unsafe fn parts<'a>(
    file: *mut ffi::sqlite3_file,
) -> (&'a mut File, *mut ffi::sqlite3_file, &'a ffi::sqlite3_io_methods) {
    // SAFETY: per the contract, `file` is a live `File` whose inner file is open.
    unsafe {
        let own = &mut *file.cast::<File>();
        let inner = own.inner;
        (own, inner, &*(*inner).pMethods)
    }
}

/// Passes a held header on.
///
/// # Safety
/// As [`parts`], with `inner` and `methods` the file's own.
unsafe fn flush(own: &mut File, inner: *mut ffi::sqlite3_file, methods: &ffi::sqlite3_io_methods) -> c_int {
    let Some(offset) = own.held.take() else { return ffi::SQLITE_OK };
    let Some(write) = methods.xWrite else { return ffi::SQLITE_IOERR_WRITE };
    // SAFETY: the header is this file's own buffer, valid for its length.
    unsafe { write(inner, own.header.as_ptr().cast(), FRAME_HEADER as c_int, offset) }
}

unsafe extern "C" fn write(
    file: *mut ffi::sqlite3_file,
    data: *const c_void,
    amount: c_int,
    offset: i64,
) -> c_int {
    // SAFETY: SQLite calls a file's methods only while it is open, with `amount` bytes at `data`.
    unsafe {
        let (own, inner, methods) = parts(file);
        let Some(write) = methods.xWrite else { return ffi::SQLITE_IOERR_WRITE };
        let length = usize::try_from(amount).unwrap_or(0);
        let after_read_here = own.read_at.take() == Some(offset);
        if let Some(at) = own.held {
            if offset == at + FRAME_HEADER as i64 && (1..=MAX_PAGE).contains(&length) {
                // The frame's page, right after its header: both in one write.
                own.held = None;
                own.joined.clear();
                own.joined.extend_from_slice(&own.header);
                own.joined.extend_from_slice(std::slice::from_raw_parts(data.cast::<u8>(), length));
                return write(inner, own.joined.as_ptr().cast(), own.joined.len() as c_int, at);
            }
            let rc = flush(own, inner, methods);
            if rc != ffi::SQLITE_OK {
                return rc;
            }
        }
        if own.log && length == FRAME_HEADER && !after_read_here {
            own.header.copy_from_slice(std::slice::from_raw_parts(data.cast::<u8>(), length));
            own.held = Some(offset);
            return ffi::SQLITE_OK;
        }
        write(inner, data, amount, offset)
    }
}

unsafe extern "C" fn read(
    file: *mut ffi::sqlite3_file,
    data: *mut c_void,
    amount: c_int,
    offset: i64,
) -> c_int {
    // SAFETY: as `write`; `amount` bytes at `data` are SQLite's to fill.
    unsafe {
        let (own, inner, methods) = parts(file);
        let rc = flush(own, inner, methods);
        if rc != ffi::SQLITE_OK {
            return rc;
        }
        own.read_at = Some(offset);
        match methods.xRead {
            Some(read) => read(inner, data, amount, offset),
            None => ffi::SQLITE_IOERR_READ,
        }
    }
}

unsafe extern "C" fn close(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: SQLite closes a file once, after its last other call; the buffer is dropped here
    // and the struct never used again.
    unsafe {
        let (own, inner, methods) = parts(file);
        let flushed = flush(own, inner, methods);
        let closed = methods.xClose.map_or(ffi::SQLITE_OK, |close| close(inner));
        drop(std::mem::take(&mut own.joined));
        if flushed != ffi::SQLITE_OK { flushed } else { closed }
    }
}

/// A method that passes a held header on, then calls the default VFS's.
macro_rules! forward {
    ($name:ident, $method:ident, $missing:expr, ($($arg:ident: $type:ty),*)) => {
        unsafe extern "C" fn $name(file: *mut ffi::sqlite3_file, $($arg: $type),*) -> c_int {
            // SAFETY: SQLite calls a file's methods only while it is open; the arguments are
            // passed on as SQLite gave them.
            unsafe {
                let (own, inner, methods) = parts(file);
                let rc = flush(own, inner, methods);
                if rc != ffi::SQLITE_OK {
                    return rc;
                }
                match methods.$method {
                    Some(call) => call(inner, $($arg),*),
                    None => $missing,
                }
            }
        }
    };
}

forward!(truncate, xTruncate, ffi::SQLITE_IOERR_TRUNCATE, (size: i64));
forward!(sync, xSync, ffi::SQLITE_IOERR_FSYNC, (flags: c_int));
forward!(file_size, xFileSize, ffi::SQLITE_IOERR_FSTAT, (size: *mut i64));
forward!(lock, xLock, ffi::SQLITE_IOERR_LOCK, (level: c_int));
forward!(unlock, xUnlock, ffi::SQLITE_IOERR_UNLOCK, (level: c_int));
forward!(check_reserved_lock, xCheckReservedLock, ffi::SQLITE_IOERR_CHECKRESERVEDLOCK, (reserved: *mut c_int));
forward!(file_control, xFileControl, ffi::SQLITE_NOTFOUND, (op: c_int, argument: *mut c_void));
forward!(sector_size, xSectorSize, 4096, ());
forward!(device_characteristics, xDeviceCharacteristics, 0, ());
forward!(shm_map, xShmMap, ffi::SQLITE_IOERR_SHMMAP, (region: c_int, size: c_int, extend: c_int, at: *mut *mut c_void));
forward!(shm_lock, xShmLock, ffi::SQLITE_IOERR_SHMLOCK, (offset: c_int, n: c_int, flags: c_int));
forward!(shm_unmap, xShmUnmap, ffi::SQLITE_OK, (delete: c_int));
forward!(fetch, xFetch, ffi::SQLITE_OK, (offset: i64, amount: c_int, at: *mut *mut c_void));
forward!(unfetch, xUnfetch, ffi::SQLITE_OK, (offset: i64, at: *mut c_void));

unsafe extern "C" fn shm_barrier(file: *mut ffi::sqlite3_file) {
    // SAFETY: as the other methods.
    unsafe {
        let (_, inner, methods) = parts(file);
        if let Some(barrier) = methods.xShmBarrier {
            barrier(inner);
        }
    }
}

/// The methods of a file whose default VFS's file has methods of version 1, 2 or 3: SQLite
/// reads no method beyond a table's version.
static METHODS: [ffi::sqlite3_io_methods; 3] = [methods(1), methods(2), methods(3)];

const fn methods(version: c_int) -> ffi::sqlite3_io_methods {
    ffi::sqlite3_io_methods {
        iVersion: version,
        xClose: Some(close),
        xRead: Some(read),
        xWrite: Some(write),
        xTruncate: Some(truncate),
        xSync: Some(sync),
        xFileSize: Some(file_size),
        xLock: Some(lock),
        xUnlock: Some(unlock),
        xCheckReservedLock: Some(check_reserved_lock),
        xFileControl: Some(file_control),
        xSectorSize: Some(sector_size),
        xDeviceCharacteristics: Some(device_characteristics),
        xShmMap: Some(shm_map),
        xShmLock: Some(shm_lock),
        xShmBarrier: Some(shm_barrier),
        xShmUnmap: Some(shm_unmap),
        xFetch: Some(fetch),
        xUnfetch: Some(unfetch),
    }
}

#[cfg(test)]
mod tests {
    use rusqlite::{Connection, OpenFlags};

    /// Opens `path` in WAL mode through `vfs` (SQLite's default when `None`), with no automatic
    /// checkpoint: every commit stays in the log.
    fn open(path: &std::path::Path, vfs: Option<&std::ffi::CStr>) -> Connection {
        let connection = match vfs {
            Some(vfs) => Connection::open_with_flags_and_vfs(path, OpenFlags::default(), vfs),
            None => Connection::open(path),
        }
        .unwrap();
        connection
            .execute_batch(
                "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA wal_autocheckpoint = 0;
                 CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, body TEXT NOT NULL);",
            )
            .unwrap();
        connection
    }

    /// Commits `count` rows one transaction each, bodies long enough to spill onto new pages.
    fn commit_rows(connection: &Connection, first: i64, count: i64) {
        for id in first..first + count {
            connection
                .execute("INSERT INTO notes (id, body) VALUES (?1, ?2)", (id, "n".repeat(900)))
                .unwrap();
        }
    }

    /// This thread's write calls so far (`/proc/thread-self/io`): the tests beside this one
    /// write from other threads.
    #[cfg(target_os = "linux")]
    fn write_calls() -> u64 {
        let io = std::fs::read_to_string("/proc/thread-self/io")
            .expect("/proc/thread-self/io, the kernel's I/O accounting per thread");
        io.lines().find_map(|line| line.strip_prefix("syscw: ")).unwrap().trim().parse().unwrap()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_frame_of_the_log_is_written_in_one_call_instead_of_two() {
        let dir = tempfile::tempdir().unwrap();
        let calls = |vfs: Option<&std::ffi::CStr>, name: &str| {
            let connection = open(&dir.path().join(name), vfs);
            commit_rows(&connection, 0, 10);
            let before = write_calls();
            commit_rows(&connection, 10, 200);
            write_calls() - before
        };
        let default = calls(None, "default.db");
        let joined = calls(super::vfs(), "joined.db");
        // Each commit appends one frame or two (a new page, and the page above it): two calls
        // each through the default VFS, one through this one.
        assert!(default >= 400, "{default} write calls for 200 commits through the default VFS");
        assert!(
            joined * 10 <= default * 6,
            "{joined} write calls through the VFS against {default} without it"
        );
    }

    /// A copy of the database and its log as they are now, as a crash would leave them, opened
    /// through the default VFS: it recovers the log, checking every frame's checksum, and keeps
    /// the frames up to the last commit whose checksums hold.
    fn recovered_copy(dir: &std::path::Path) -> Connection {
        let copy = dir.join("copy.db");
        std::fs::copy(dir.join("notes.db"), &copy).unwrap();
        std::fs::copy(dir.join("notes.db-wal"), dir.join("copy.db-wal")).unwrap();
        let reader = Connection::open(&copy).unwrap();
        assert_eq!(reader.query_row("PRAGMA integrity_check", [], |r| r.get::<_, String>(0)).unwrap(), "ok");
        reader
    }

    #[test]
    fn a_commit_whose_pages_spilled_to_the_log_and_were_written_again_is_whole_in_the_log() {
        // A transaction larger than the page cache writes pages to the log before it commits;
        // those it changes again are written again in place, and the commit then writes their
        // frames' headers anew (their checksums chain through the page's new content).
        let dir = tempfile::tempdir().unwrap();
        let writer = open(&dir.path().join("notes.db"), super::vfs());
        commit_rows(&writer, 0, 1);
        writer.execute_batch("PRAGMA cache_size = 10;").unwrap();
        let body = "m".repeat(900);
        writer
            .execute_batch(&format!(
                "BEGIN;
                 WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 300)
                   INSERT INTO notes (id, body) SELECT i, '{body}' FROM n;
                 UPDATE notes SET body = upper(body) WHERE id % 2 = 0;
                 COMMIT;"
            ))
            .unwrap();
        let reader = recovered_copy(dir.path());
        let (rows, changed): (i64, i64) = reader
            .query_row("SELECT count(*), count(*) FILTER (WHERE body GLOB 'M*') FROM notes", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .unwrap();
        assert_eq!((rows, changed), (301, 150));
    }

    #[test]
    fn what_it_writes_reads_back_through_the_default_vfs_from_the_log_alone() {
        let dir = tempfile::tempdir().unwrap();
        let writer = open(&dir.path().join("notes.db"), super::vfs());
        commit_rows(&writer, 0, 300);
        let log = std::fs::metadata(dir.path().join("notes.db-wal")).unwrap().len();
        assert!(log > 300 * 1024, "the commits are in the log, not yet in the database: {log} bytes");
        let reader = recovered_copy(dir.path());
        let (rows, bodies): (i64, i64) = reader
            .query_row("SELECT count(*), sum(length(body)) FROM notes", [], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap();
        assert_eq!((rows, bodies), (300, 300 * 900));
        // And the writer goes on with what it wrote.
        commit_rows(&writer, 300, 1);
        assert_eq!(writer.query_row("SELECT count(*) FROM notes", [], |r| r.get::<_, i64>(0)).unwrap(), 301);
    }
}

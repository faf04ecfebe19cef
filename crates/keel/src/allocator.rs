//! The allocator the `keel` binary runs on: mimalloc, asked the cheap way.
//!
//! The `mimalloc` crate's `GlobalAlloc` passes every request to `mi_malloc_aligned`, whatever
//! its alignment. mimalloc (v3) serves that call fast only for blocks of at most 1 KiB; a larger
//! one takes its generic aligned path, which sizes the block up by the alignment and looks it up
//! again (about 200 instructions instead of 60). A run's futures, task cells and transcripts are
//! larger than 1 KiB, so the tool-loop bench paid that path about 18 times a run.
//!
//! mimalloc's size classes are whole machine words, and every page starts its first block on a
//! 16-byte boundary, so any block `mi_malloc` returns is aligned to a word. [`Mimalloc`] therefore
//! calls the plain functions when the layout asks for a word's alignment or less (nearly every
//! Rust allocation) and the aligned ones only for the rest.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as ffi;

/// The alignment every mimalloc block has: its size classes are whole words.
const WORD: usize = std::mem::size_of::<usize>();

/// mimalloc as a [`GlobalAlloc`], using its unaligned entry points when the layout allows.
///
/// ```ignore
/// #[global_allocator]
/// static ALLOCATOR: keel::allocator::Mimalloc = keel::allocator::Mimalloc;
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct Mimalloc;

#[allow(unsafe_code, reason = "a global allocator is unsafe by definition; each call forwards to mimalloc")]
// SAFETY: every pointer handed out comes from mimalloc with at least the layout's alignment
// (see the module docs for the word-alignment guarantee), and is only ever given back to
// mimalloc's `mi_free`/`mi_realloc*`, which accept blocks from any of its allocation functions.
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: plain FFI calls; mimalloc returns null when it is out of memory.
        unsafe {
            if layout.align() <= WORD {
                ffi::mi_malloc(layout.size()).cast()
            } else {
                ffi::mi_malloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        unsafe {
            if layout.align() <= WORD {
                ffi::mi_zalloc(layout.size()).cast()
            } else {
                ffi::mi_zalloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: the caller gives back a block this allocator handed out.
        unsafe { ffi::mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller gives back a block this allocator handed out with `layout`; the
        // new block keeps its alignment.
        unsafe {
            if layout.align() <= WORD {
                ffi::mi_realloc(ptr.cast::<c_void>(), new_size).cast()
            } else {
                ffi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, layout.align()).cast()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every size a program asks for, small and past mimalloc's small-block limit, at every
    /// alignment from 1 to 4 KiB: the block is aligned, usable for its whole length, and keeps
    /// its bytes through a `realloc` that grows it and one that shrinks it.
    #[test]
    #[allow(unsafe_code, reason = "drives the allocator directly, as the global allocator would be")]
    fn blocks_are_aligned_writable_and_keep_their_bytes_through_realloc() {
        let sizes = (1..=1100).chain([1500, 2048, 4000, 4096, 9000, 65_536, 200_000, 5 << 20]);
        let mut live = Vec::new();
        for size in sizes {
            for align in [1, 2, 4, 8, 16, 32, 64, 128, 4096] {
                let layout = Layout::from_size_align(size, align).expect("a valid layout");
                // SAFETY: a non-zero size; every block is freed below with its layout.
                unsafe {
                    let block = Mimalloc.alloc(layout);
                    assert!(!block.is_null(), "{size} bytes at alignment {align}: out of memory");
                    assert_eq!(block as usize % align, 0, "{size} bytes at alignment {align}: misaligned");
                    let fill = (size % 251) as u8;
                    block.write_bytes(fill, size);
                    let zeroed = Mimalloc.alloc_zeroed(layout);
                    assert_eq!(zeroed as usize % align, 0, "zeroed {size} bytes at {align}: misaligned");
                    assert!((0..size).all(|i| *zeroed.add(i) == 0), "zeroed {size} bytes: not zero");
                    Mimalloc.dealloc(zeroed, layout);
                    let grown = Mimalloc.realloc(block, layout, size * 2 + 100);
                    assert_eq!(grown as usize % align, 0, "{size} bytes grown at {align}: misaligned");
                    assert!((0..size).all(|i| *grown.add(i) == fill), "{size} bytes grown: lost bytes");
                    let grown_layout = Layout::from_size_align(size * 2 + 100, align).expect("valid");
                    let shrunk = Mimalloc.realloc(grown, grown_layout, size.div_ceil(2));
                    assert_eq!(shrunk as usize % align, 0, "{size} bytes shrunk at {align}: misaligned");
                    assert!((0..size.div_ceil(2)).all(|i| *shrunk.add(i) == fill), "shrunk: lost bytes");
                    // Kept for a while, so that later blocks come from partly used pages too.
                    live.push((shrunk, Layout::from_size_align(size.div_ceil(2), align).expect("valid")));
                    if live.len() > 64 {
                        let (old, old_layout) = live.swap_remove(size % 64);
                        Mimalloc.dealloc(old, old_layout);
                    }
                }
            }
        }
        for (block, layout) in live {
            // SAFETY: each block was allocated above with this layout and not freed yet.
            unsafe { Mimalloc.dealloc(block, layout) };
        }
    }
}

//! A global allocator that counts heap allocations, for tests that assert a code path makes
//! none (or few): a test binary installs it with
//! `#[global_allocator] static GLOBAL: CountingAllocator = CountingAllocator;` and measures
//! with [`allocations_in`]. Every thread's `alloc`, `alloc_zeroed` and `realloc` count (the
//! kernels run on a thread pool), so such a binary should hold one test.
//! `MOESERVE_ALLOC_TRACE=1` prints a backtrace of each counted allocation.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The system allocator, counting while [`allocations_in`] runs.
pub struct CountingAllocator;

static COUNTING: AtomicBool = AtomicBool::new(false);
static TRACE: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Set while this thread prints a backtrace (which allocates itself).
    static IN_TRACE: Cell<bool> = const { Cell::new(false) };
}

fn count() {
    if !COUNTING.load(Ordering::Relaxed) {
        return;
    }
    ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    if TRACE.load(Ordering::Relaxed) && !IN_TRACE.with(|t| t.replace(true)) {
        eprintln!("{}", std::backtrace::Backtrace::force_capture());
        IN_TRACE.with(|t| t.set(false));
    }
}

// SAFETY: every call goes to the system allocator unchanged; counting only touches atomics
// (and, when tracing, allocates behind a re-entrancy guard).
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Heap allocations any thread made while `f` ran (0 unless [`CountingAllocator`] is the
/// binary's global allocator).
pub fn allocations_in(f: impl FnOnce()) -> usize {
    TRACE.store(
        std::env::var_os("MOESERVE_ALLOC_TRACE").is_some(),
        Ordering::Relaxed,
    );
    ALLOCATIONS.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::SeqCst);
    f();
    COUNTING.store(false, Ordering::SeqCst);
    ALLOCATIONS.load(Ordering::Relaxed)
}

//! Small helpers for sharing output buffers across rayon tasks and reusing scratch memory.

use std::cell::RefCell;
use std::thread::LocalKey;

/// A raw pointer that rayon tasks may share. Each task writes a disjoint set of elements; the
/// creator guarantees that and that the buffer outlives the tasks.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub *mut T);
// SAFETY: only used for disjoint writes from tasks that finish before the buffer is released.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer. (A method, so closures capture the whole `Send` wrapper rather than the
    /// raw field.)
    #[inline(always)]
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

/// Runs `f` with a thread-local scratch vector. The vector is taken out of its slot while `f`
/// runs, so a nested call on the same thread (rayon work stealing) gets a fresh one instead of
/// a `RefCell` borrow panic.
#[inline(always)]
pub(crate) fn with_scratch<T, R>(
    slot: &'static LocalKey<RefCell<Vec<T>>>,
    f: impl FnOnce(&mut Vec<T>) -> R,
) -> R {
    let mut buf = take_scratch(slot);
    let r = f(&mut buf);
    return_scratch(slot, buf);
    r
}

/// Takes the thread-local scratch vector out of its slot (leaving an empty one), for code that
/// cannot run inside a closure (e.g. `#[target_feature]` kernels). Give it back with
/// [`return_scratch`].
pub(crate) fn take_scratch<T>(slot: &'static LocalKey<RefCell<Vec<T>>>) -> Vec<T> {
    slot.with(|s| std::mem::take(&mut *s.borrow_mut()))
}

/// Puts a scratch vector back for the next call on this thread.
pub(crate) fn return_scratch<T>(slot: &'static LocalKey<RefCell<Vec<T>>>, buf: Vec<T>) {
    slot.with(|s| {
        let mut s = s.borrow_mut();
        if s.capacity() < buf.capacity() {
            *s = buf;
        }
    });
}

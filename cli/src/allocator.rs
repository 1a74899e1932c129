//! The binary's allocator and its settings.

use std::ffi::c_int;

/// mimalloc keeps freed megabyte buffers (KV chunks, activations) for reuse instead of
/// returning them to the kernel and faulting them in again, as glibc's thread arenas do.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` in mimalloc.h's `mi_option_t` (libmimalloc-sys names no constant
/// for it): how long freed pages wait before they go back to the kernel, in ms (default 1000;
/// -1: never).
const PURGE_DELAY: c_int = 15;

/// Keeps the pages freed from now on instead of returning them to the kernel. For a run that
/// stays near its peak memory until it ends (the simulator): a returned page is faulted in
/// and zeroed again when it is next used, and on a host that backs a huge page only after
/// compacting memory for it, that fault is slow. Over the 1,000-node hour the event loop
/// ran 3-6% faster in each of five alternated pairs, for 100 MB more at the peak.
/// Servers keep the default, which gives memory back when idle.
pub fn keep_freed_pages() {
    // SAFETY: sets one of mimalloc's options, which it reads at its next purge.
    unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, -1) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn purge_delay_names_mimallocs_option() {
        // SAFETY: reads an option.
        let delay = |option| unsafe { libmimalloc_sys::mi_option_get(option) };
        assert_eq!(delay(PURGE_DELAY), 1000, "mimalloc's default purge delay");
        keep_freed_pages();
        assert_eq!(delay(PURGE_DELAY), -1);
    }
}
